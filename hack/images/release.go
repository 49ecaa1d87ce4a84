package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	cdx "github.com/CycloneDX/cyclonedx-go"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"sigs.k8s.io/yaml"

	"github.com/outbox-relay/outbox-operator/hack/releasekit"
)

// releaseArchs are the platforms of a release's image index (linux/<arch>).
var releaseArchs = []string{"amd64", "arm64"}

// The files of a release, in dist/.
func releaseImageFile(v string) string { return "outbox-operator-image-v" + v + ".oci.tar" }
func releaseChartFile(v string) string { return "outbox-operator-" + v + ".tgz" }

const (
	releaseSBOMFile      = "sbom.cdx.json"
	releaseInstallFile   = "install.yaml"
	releaseChecksumsFile = "checksums.txt"
)

// releaseResult is what a release wrote.
type releaseResult struct {
	// Index is the image index's digest: install.yaml pins it.
	Index v1.Hash
	// Files are the release's files in o.OutDir, checksums.txt last.
	Files []string
}

// release writes release version (MAJOR.MINOR.PATCH) into o.OutDir: the
// operator image for every releaseArchs as an OCI image layout (tar), its
// SBOM (CycloneDX, from the Go modules linked into the binaries), the
// packaged Helm chart, install.yaml with the image pinned by the index's
// digest, and checksums.txt. kubectl renders config/default. The same
// sources, toolchain, CA bundle and epoch give the same bytes.
func release(ctx context.Context, o options, version, kubectl string) (releaseResult, error) {
	if err := releasekit.CheckVersion(version); err != nil {
		return releaseResult{}, err
	}
	o.Version = "v" + version
	ca, err := readCABundle(o.CABundle)
	if err != nil {
		return releaseResult{}, err
	}
	binDir, err := os.MkdirTemp("", "outbox-release-")
	if err != nil {
		return releaseResult{}, err
	}
	defer os.RemoveAll(binDir)

	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	var linked [][]byte // the binaries of the first platform, for the SBOM
	for _, arch := range releaseArchs {
		dir := filepath.Join(binDir, arch)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return releaseResult{}, err
		}
		bins, err := buildBinaries(ctx, o.RepoRoot, arch, dir, operatorBinaries(o.Version))
		if err != nil {
			return releaseResult{}, err
		}
		if linked == nil {
			for _, b := range bins {
				linked = append(linked, b.Data)
			}
		}
		img, err := operatorImage(o, arch, ca, bins, tarball.WithMediaType(types.OCILayer))
		if err != nil {
			return releaseResult{}, err
		}
		img = mutate.ConfigMediaType(mutate.MediaType(img, types.OCIManifestSchema1), types.OCIConfigJSON)
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			Platform:    &v1.Platform{OS: "linux", Architecture: arch},
			Annotations: map[string]string{"org.opencontainers.image.version": o.Version},
		}})
	}
	idx = mutate.Annotations(idx, operatorLabels(o.Version)).(v1.ImageIndex)
	digest, err := idx.Digest()
	if err != nil {
		return releaseResult{}, err
	}

	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return releaseResult{}, err
	}
	res := releaseResult{Index: digest}
	writeFile := func(name string, data []byte) error {
		res.Files = append(res.Files, name)
		return os.WriteFile(filepath.Join(o.OutDir, name), data, 0o644)
	}

	image, err := ociLayoutTar(idx, o.Epoch)
	if err != nil {
		return res, err
	}
	if err := writeFile(releaseImageFile(version), image); err != nil {
		return res, err
	}
	sbom, err := sbomOf(o.Version, linked)
	if err != nil {
		return res, err
	}
	if err := writeFile(releaseSBOMFile, sbom); err != nil {
		return res, err
	}
	chart, err := packageChart(filepath.Join(o.RepoRoot, "charts", "outbox-operator"), version, o.Version, o.Epoch)
	if err != nil {
		return res, err
	}
	if err := writeFile(releaseChartFile(version), chart); err != nil {
		return res, err
	}
	install, err := installManifest(ctx, o.RepoRoot, kubectl, operatorRepo+"@"+digest.String())
	if err != nil {
		return res, err
	}
	if err := writeFile(releaseInstallFile, install); err != nil {
		return res, err
	}
	var sums bytes.Buffer
	for _, name := range slices.Sorted(slices.Values(res.Files)) {
		data, err := os.ReadFile(filepath.Join(o.OutDir, name))
		if err != nil {
			return res, err
		}
		sum := sha256.Sum256(data)
		fmt.Fprintf(&sums, "%s  %s\n", hex.EncodeToString(sum[:]), name)
	}
	return res, writeFile(releaseChecksumsFile, sums.Bytes())
}

// checkReleaseTree refuses to release version from root unless root is a
// git checkout with nothing uncommitted, its HEAD is the commit tag
// v<version> names, and the chart there is the release's (Chart.yaml's
// version, which the tagged commit sets: docs/release.md). Before, `make
// release` built whatever the working tree held under any VERSION given,
// such as main's next development version published as the release.
func checkReleaseTree(root, version string) error {
	git := func(args ...string) (string, error) {
		out, err := exec.Command("git", append([]string{"-C", root}, args...)...).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	status, err := git("status", "--porcelain")
	if err != nil {
		return fmt.Errorf("release %s: %s is not a git checkout: %v: %s", version, root, err, status)
	}
	if status != "" {
		first, _, _ := strings.Cut(status, "\n")
		return fmt.Errorf("release %s: the tree has uncommitted or untracked files (%s, ...): a release is built from its tagged commit alone", version, first)
	}
	tag := "v" + version
	tagged, err := git("rev-parse", "--verify", "--quiet", tag+"^{commit}")
	if err != nil {
		return fmt.Errorf("release %s: no tag %s: tag the release's commit first (docs/release.md)", version, tag)
	}
	if head, _ := git("rev-parse", "HEAD"); head != tagged {
		return fmt.Errorf("release %s: HEAD is %.12s, not %s (%.12s): git checkout %s", version, head, tag, tagged, tag)
	}
	b, err := os.ReadFile(filepath.Join(root, "charts", "outbox-operator", "Chart.yaml"))
	if err != nil {
		return err
	}
	var meta struct{ Version string }
	if err := yaml.Unmarshal(b, &meta); err != nil {
		return fmt.Errorf("Chart.yaml: %w", err)
	}
	if meta.Version != version {
		return fmt.Errorf("release %s: charts/outbox-operator/Chart.yaml at %s has version %q: the release's commit sets the chart's version and appVersion to the release's (docs/release.md)", version, tag, meta.Version)
	}
	return nil
}

// ociLayoutTar is idx as an OCI image layout (oci-layout, index.json,
// blobs/), in a reproducible tar: `crane push` or `oras cp` push it as is
// (docs/release.md).
func ociLayoutTar(idx v1.ImageIndex, mtime time.Time) ([]byte, error) {
	dir, err := os.MkdirTemp("", "outbox-oci-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if _, err := layout.Write(dir, idx); err != nil {
		return nil, fmt.Errorf("write the OCI layout: %w", err)
	}
	return tarDir(dir, "", mtime, false)
}

// tarDir tars the files under dir (sorted, with prefix before each name,
// mode 0644 or 0755, owned by root, at mtime), gzipped when zip.
func tarDir(dir, prefix string, mtime time.Time, zip bool, edit ...func(name string, data []byte) ([]byte, error)) ([]byte, error) {
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		names = append(names, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	var buf bytes.Buffer
	var w io.Writer = &buf
	var gz *gzip.Writer
	if zip {
		gz = gzip.NewWriter(&buf) // no name, no modification time
		w = gz
	}
	tw := tar.NewWriter(w)
	for _, name := range names {
		data, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(name)))
		if err != nil {
			return nil, err
		}
		for _, e := range edit {
			if data, err = e(name, data); err != nil {
				return nil, err
			}
		}
		hdr := &tar.Header{Name: path.Join(prefix, name), Mode: 0o644, Size: int64(len(data)), ModTime: mtime, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if gz != nil {
		if err := gz.Close(); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}

// packageChart is what `helm package` makes of the chart in dir: a gzipped
// tar under outbox-operator/, with Chart.yaml's version and appVersion set
// (the image tag defaults to appVersion).
func packageChart(dir, version, appVersion string, mtime time.Time) ([]byte, error) {
	return tarDir(dir, "outbox-operator", mtime, true, func(name string, data []byte) ([]byte, error) {
		if name != "Chart.yaml" {
			return data, nil
		}
		meta := map[string]any{}
		if err := yaml.Unmarshal(data, &meta); err != nil {
			return nil, fmt.Errorf("Chart.yaml: %w", err)
		}
		meta["version"], meta["appVersion"] = version, appVersion
		return yaml.Marshal(meta)
	})
}

// installManifest is config/default as kubectl kustomize renders it, with
// the image config/ runs (the manager's and the default relay image)
// replaced by image.
func installManifest(ctx context.Context, repoRoot, kubectl, image string) ([]byte, error) {
	out, err := releasekit.RenderDefault(ctx, repoRoot, kubectl, image)
	if err != nil {
		return nil, err
	}
	header := "# outbox-operator " + strings.TrimPrefix(image, operatorRepo) + ": kubectl apply --server-side -f install.yaml\n"
	return append([]byte(header), out...), nil
}

// sbomOf is the CycloneDX SBOM of the binaries: every Go module linked into
// any of them (their build information), with its version, package URL
// and go.sum hash.
func sbomOf(version string, binaries [][]byte) ([]byte, error) {
	mods := map[string]cdx.Component{}
	var goVersion string
	for _, b := range binaries {
		info, err := buildinfo.Read(bytes.NewReader(b))
		if err != nil {
			return nil, fmt.Errorf("build information: %w", err)
		}
		goVersion = info.GoVersion
		for _, d := range info.Deps {
			if d.Replace != nil {
				d = d.Replace
			}
			c := cdx.Component{
				BOMRef: "pkg:golang/" + d.Path + "@" + d.Version, Type: cdx.ComponentTypeLibrary,
				Name: d.Path, Version: d.Version, PackageURL: "pkg:golang/" + d.Path + "@" + d.Version,
			}
			if h, ok := strings.CutPrefix(d.Sum, "h1:"); ok {
				if raw, err := base64.StdEncoding.DecodeString(h); err == nil {
					c.Hashes = &[]cdx.Hash{{Algorithm: cdx.HashAlgoSHA256, Value: hex.EncodeToString(raw)}}
				}
			}
			mods[d.Path] = c
		}
	}
	components := make([]cdx.Component, 0, len(mods)+1)
	components = append(components, cdx.Component{
		BOMRef: "pkg:golang/stdlib@" + goVersion, Type: cdx.ComponentTypeLibrary,
		Name: "stdlib", Version: goVersion, PackageURL: "pkg:golang/stdlib@" + goVersion,
	})
	for _, p := range slices.Sorted(func(yield func(string) bool) {
		for k := range mods {
			if !yield(k) {
				return
			}
		}
	}) {
		components = append(components, mods[p])
	}
	bom := cdx.NewBOM()
	bom.SerialNumber = ""
	bom.Metadata = &cdx.Metadata{Component: &cdx.Component{
		BOMRef: "pkg:oci/outbox-operator@" + version, Type: cdx.ComponentTypeContainer,
		Name: operatorRepo, Version: version,
		Licenses: &cdx.Licenses{{License: &cdx.License{ID: "Apache-2.0"}}},
	}}
	bom.Components = &components
	var buf bytes.Buffer
	enc := cdx.NewBOMEncoder(&buf, cdx.BOMFileFormatJSON)
	enc.SetPretty(true)
	if err := enc.Encode(bom); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
