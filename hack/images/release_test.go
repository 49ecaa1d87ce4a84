package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	cdx "github.com/CycloneDX/cyclonedx-go"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// TestRelease writes a release twice and checks what a user verifies: the
// checksums, an OCI image index for linux/amd64 and linux/arm64 whose
// binaries are built for that machine and report the version, the same
// digest on a rebuild, install.yaml pinned by that digest, an SBOM of the
// linked modules, and the packaged chart at the release's version.
func TestRelease(t *testing.T) {
	t.Parallel()
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	require.NotEmpty(t, assets, "KUBEBUILDER_ASSETS (make test sets it) holds the kubectl that renders config/default")
	kubectl := filepath.Join(assets, "kubectl")
	const version = "1.2.3"
	ctx := context.Background()
	o := testOptions(t, t.TempDir())
	res, err := release(ctx, o, version, kubectl)
	require.NoError(t, err)
	again := testOptions(t, t.TempDir())
	res2, err := release(ctx, again, version, kubectl)
	require.NoError(t, err)
	require.Equal(t, res.Index, res2.Index, "a rebuild gives the same index digest")
	for _, f := range res.Files {
		a, err := os.ReadFile(filepath.Join(o.OutDir, f))
		require.NoError(t, err)
		b, err := os.ReadFile(filepath.Join(again.OutDir, f))
		require.NoError(t, err)
		require.True(t, bytes.Equal(a, b), "%s is reproducible", f)
	}

	// checksums.txt covers every other file.
	sums, err := os.ReadFile(filepath.Join(o.OutDir, releaseChecksumsFile))
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(sums)), "\n")
	require.Len(t, lines, len(res.Files)-1)
	for _, line := range lines {
		sum, name, ok := strings.Cut(line, "  ")
		require.True(t, ok, line)
		data, err := os.ReadFile(filepath.Join(o.OutDir, name))
		require.NoError(t, err)
		got := sha256.Sum256(data)
		require.Equal(t, sum, hex.EncodeToString(got[:]), name)
	}

	// The image index.
	dir := t.TempDir()
	untar(t, filepath.Join(o.OutDir, releaseImageFile(version)), dir)
	lp, err := layout.FromPath(dir)
	require.NoError(t, err)
	idx, err := lp.ImageIndex() // index.json is the release's index
	require.NoError(t, err)
	digest, err := idx.Digest()
	require.NoError(t, err)
	require.Equal(t, res.Index, digest, "index.json is the index install.yaml pins")
	mt, err := idx.MediaType()
	require.NoError(t, err)
	require.Equal(t, types.OCIImageIndex, mt)
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Equal(t, "v"+version, im.Annotations["org.opencontainers.image.version"])
	machines := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	var platforms []string
	for _, d := range im.Manifests {
		platforms = append(platforms, d.Platform.String())
		img, err := idx.Image(d.Digest)
		require.NoError(t, err)
		cfg, err := img.ConfigFile()
		require.NoError(t, err)
		require.Equal(t, d.Platform.Architecture, cfg.Architecture)
		require.Equal(t, "v"+version, cfg.Config.Labels["org.opencontainers.image.version"])
		bins := extract(t, img, "/manager", "/relay")
		for p, data := range bins {
			f, err := elf.NewFile(bytes.NewReader(data))
			require.NoError(t, err, p)
			require.Equal(t, machines[d.Platform.Architecture], f.Machine, "%s of %s", p, d.Platform)
			require.True(t, bytes.Contains(data, []byte("v"+version)), "%s of %s carries the version", p, d.Platform)
		}
		if d.Platform.Architecture == runtimeArch() {
			exe := filepath.Join(t.TempDir(), "relay")
			require.NoError(t, os.WriteFile(exe, bins["/relay"], 0o755))
			out, err := exec.Command(exe, "--version").CombinedOutput()
			require.NoError(t, err, "%s", out)
			require.True(t, strings.HasPrefix(string(out), "relay v"+version+" "), "%s", out)
		}
	}
	require.ElementsMatch(t, []string{"linux/amd64", "linux/arm64"}, platforms)

	// install.yaml runs the index by digest, nothing by tag.
	install, err := os.ReadFile(filepath.Join(o.OutDir, releaseInstallFile))
	require.NoError(t, err)
	pinned := operatorRepo + "@" + res.Index.String()
	require.Equal(t, 2, strings.Count(string(install), pinned), "the manager's image and the default relay image")
	require.NotContains(t, string(install), operatorRepo+":")

	// The SBOM names the modules the binaries link.
	sbom, err := os.Open(filepath.Join(o.OutDir, releaseSBOMFile))
	require.NoError(t, err)
	defer sbom.Close()
	bom := cdx.NewBOM()
	require.NoError(t, cdx.NewBOMDecoder(sbom, cdx.BOMFileFormatJSON).Decode(bom))
	require.Equal(t, "v"+version, bom.Metadata.Component.Version)
	purls := map[string]cdx.Component{}
	for _, c := range *bom.Components {
		purls[c.Name] = c
	}
	for _, mod := range []string{"github.com/jackc/pgx/v5", "github.com/segmentio/kafka-go", "sigs.k8s.io/controller-runtime", "stdlib"} {
		c, ok := purls[mod]
		require.True(t, ok, "the SBOM lists %s", mod)
		require.True(t, strings.HasPrefix(c.PackageURL, "pkg:golang/"+mod+"@"), c.PackageURL)
	}
	require.NotNil(t, purls["github.com/jackc/pgx/v5"].Hashes, "with its go.sum hash")

	// The chart, at the release's version.
	chart := readTarGz(t, filepath.Join(o.OutDir, releaseChartFile(version)))
	meta := map[string]any{}
	require.NoError(t, yaml.Unmarshal(chart["outbox-operator/Chart.yaml"], &meta))
	require.Equal(t, version, meta["version"])
	require.Equal(t, "v"+version, meta["appVersion"])
	require.Contains(t, chart, "outbox-operator/templates/deployment.yaml")
	require.Contains(t, chart, "outbox-operator/values.schema.json")

	_, err = release(ctx, o, "v1.2.3", kubectl)
	require.ErrorContains(t, err, `-version "v1.2.3" is not MAJOR.MINOR.PATCH`)
}

func runtimeArch() string { return runtime.GOARCH }

// extract returns the files at paths in img's flattened filesystem.
func extract(t *testing.T, img v1.Image, paths ...string) map[string][]byte {
	t.Helper()
	want := map[string]bool{}
	for _, p := range paths {
		want[strings.TrimPrefix(p, "/")] = true
	}
	out := map[string][]byte{}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		if name := strings.TrimPrefix(hdr.Name, "/"); want[name] {
			data, err := io.ReadAll(tr)
			require.NoError(t, err)
			out["/"+name] = data
		}
	}
	require.Len(t, out, len(paths))
	return out
}

func untar(t *testing.T, file, dir string) {
	t.Helper()
	f, err := os.Open(file)
	require.NoError(t, err)
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return
		}
		require.NoError(t, err)
		p := filepath.Join(dir, filepath.FromSlash(hdr.Name))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, data, 0o644))
	}
}

func readTarGz(t *testing.T, file string) map[string][]byte {
	t.Helper()
	f, err := os.Open(file)
	require.NoError(t, err)
	defer f.Close()
	gz, err := gzip.NewReader(f)
	require.NoError(t, err)
	tr := tar.NewReader(gz)
	out := map[string][]byte{}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		out[hdr.Name] = data
	}
}

// A release is built only from a clean checkout of its tag, whose chart is
// the release's: an untagged HEAD, uncommitted or untracked files, or a
// chart of another version are refused, each saying what to do.
func TestReleaseOnlyFromItsTag(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-C", root, "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"}, args...)...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "git %v: %s", args, out)
	}
	chart := func(version string) {
		t.Helper()
		dir := filepath.Join(root, "charts", "outbox-operator")
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "Chart.yaml"), []byte("name: outbox-operator\nversion: "+version+"\nappVersion: v"+version+"\n"), 0o644))
	}
	git("init", "-q")
	chart("1.2.3")
	git("add", ".")
	git("commit", "-q", "-m", "release 1.2.3")

	require.ErrorContains(t, checkReleaseTree(root, "1.2.3"), "no tag v1.2.3")
	git("tag", "v1.2.3")
	require.NoError(t, checkReleaseTree(root, "1.2.3"))
	require.ErrorContains(t, checkReleaseTree(root, "1.2.4"), "no tag v1.2.4")

	require.NoError(t, os.WriteFile(filepath.Join(root, "stray.txt"), []byte("x"), 0o644))
	require.ErrorContains(t, checkReleaseTree(root, "1.2.3"), "uncommitted or untracked files (?? stray.txt")
	require.NoError(t, os.Remove(filepath.Join(root, "stray.txt")))

	chart("1.3.0-dev") // main after the release
	git("commit", "-q", "-am", "next development version")
	require.ErrorContains(t, checkReleaseTree(root, "1.2.3"), "HEAD is")
	require.ErrorContains(t, checkReleaseTree(root, "1.2.3"), "git checkout v1.2.3")

	git("tag", "v1.3.0")
	require.ErrorContains(t, checkReleaseTree(root, "1.3.0"), `Chart.yaml at v1.3.0 has version "1.3.0-dev"`)
}
