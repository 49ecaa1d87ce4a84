package main

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"debug/buildinfo"
	"debug/elf"
	"errors"
	versionpkg "github.com/outbox-relay/outbox-operator/version"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/stretchr/testify/require"
)

// testVersion is not the default, so that the tests see it go where it must.
const testVersion = "v0.0.0-imagetest"

// The images are built once and shared by the tests that only read them.
var shared struct {
	once            sync.Once
	dir             string
	operator, pause result
	err             error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.dir != "" {
		os.RemoveAll(shared.dir)
	}
	os.Exit(code)
}

func testOptions(t *testing.T, out string) options {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	require.NoError(t, err)
	return options{
		RepoRoot: root,
		OutDir:   out,
		Version:  testVersion,
		GOARCH:   runtime.GOARCH,
		CABundle: defaultCABundle,
		Epoch:    time.Unix(0, 0).UTC(),
	}
}

func build(t *testing.T, out string) (operator, pause result, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	return buildImages(ctx, testOptions(t, out))
}

func built(t *testing.T) (operator, pause result) {
	t.Helper()
	shared.once.Do(func() {
		if shared.dir, shared.err = os.MkdirTemp("", "outbox-images-test-"); shared.err != nil {
			return
		}
		shared.operator, shared.pause, shared.err = build(t, shared.dir)
	})
	require.NoError(t, shared.err)
	return shared.operator, shared.pause
}

// entry is one path of an image's flattened filesystem.
type entry struct {
	hdr  *tar.Header
	data []byte
}

// readImage reads a written tarball back and flattens its layers.
func readImage(t *testing.T, r result) (*v1.ConfigFile, map[string]entry) {
	t.Helper()
	img, err := tarball.ImageFromPath(r.Path, &r.Tag)
	require.NoError(t, err, "reading %s back", r.Path)
	digest, err := img.Digest()
	require.NoError(t, err)
	require.Equal(t, r.Digest, digest, "the digest of %s as read back", r.Path)
	cfg, err := img.ConfigFile()
	require.NoError(t, err)

	files := map[string]entry{}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		files["/"+path.Clean(hdr.Name)] = entry{hdr: hdr, data: data}
	}
	return cfg, files
}

func TestOperatorImageFiles(t *testing.T) {
	t.Parallel()
	operator, _ := built(t)
	require.Equal(t, operatorRepo+":"+testVersion, operator.Tag.String())
	require.Equal(t, filepath.Join(shared.dir, "outbox-operator.tar"), operator.Path)
	_, files := readImage(t, operator)

	for _, b := range operatorBinaries(testVersion) {
		e, ok := files[b.Path]
		require.True(t, ok, "%s is in the image", b.Path)
		require.Equal(t, byte(tar.TypeReg), e.hdr.Typeflag, b.Path)
		require.Equal(t, int64(0o755), e.hdr.Mode, "%s is executable by anyone", b.Path)
	}

	require.Contains(t, string(files["/etc/passwd"].data),
		"\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")
	require.Contains(t, string(files["/etc/passwd"].data), "root:x:0:0:root:/root:/sbin/nologin\n")
	require.Contains(t, string(files["/etc/group"].data), "\nnonroot:x:65532:\n")
	require.Contains(t, string(files["/etc/nsswitch.conf"].data), "\nhosts: files dns\n")

	ca := files["/etc/ssl/certs/ca-certificates.crt"].data
	want, err := os.ReadFile(defaultCABundle)
	require.NoError(t, err)
	require.Equal(t, want, ca, "the CA bundle is the build machine's")
	require.True(t, x509.NewCertPool().AppendCertsFromPEM(ca), "the CA bundle holds certificates")

	tmp := files["/tmp"]
	require.NotNil(t, tmp.hdr, "/tmp is in the image")
	require.Equal(t, byte(tar.TypeDir), tmp.hdr.Typeflag)
	require.Equal(t, int64(0o1777), tmp.hdr.Mode, "/tmp is world-writable and sticky")
	home := files["/home/nonroot"]
	require.NotNil(t, home.hdr, "/home/nonroot is in the image")
	require.Equal(t, []int{nonrootID, nonrootID, 0o700}, []int{home.hdr.Uid, home.hdr.Gid, int(home.hdr.Mode)})

	for p, e := range files {
		require.Equal(t, time.Unix(0, 0).UTC(), e.hdr.ModTime.UTC(), "%s has the fixed time", p)
		if p != "/home/nonroot" {
			require.Equal(t, []int{0, 0}, []int{e.hdr.Uid, e.hdr.Gid}, "%s is owned by root", p)
		}
	}
}

func TestOperatorImageConfig(t *testing.T) {
	t.Parallel()
	operator, _ := built(t)
	cfg, _ := readImage(t, operator)
	require.Equal(t, "linux", cfg.OS)
	require.Equal(t, runtime.GOARCH, cfg.Architecture)
	require.Equal(t, []string{"/manager"}, cfg.Config.Entrypoint)
	require.Empty(t, cfg.Config.Cmd)
	require.Equal(t, "65532:65532", cfg.Config.User)
	require.Equal(t, "/", cfg.Config.WorkingDir)
	require.Equal(t, map[string]struct{}{"8443/tcp": {}, "8081/tcp": {}, "9090/tcp": {}}, cfg.Config.ExposedPorts)
	require.Contains(t, cfg.Config.Env, "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt")
	require.Len(t, cfg.RootFS.DiffIDs, 2, "a base layer and a binaries layer")
	require.Len(t, cfg.History, 2)
}

// TestBinariesAreStaticAndBuiltAsDeclared reads each program back out of its
// image: a static ELF for the image's architecture (no interpreter, no
// shared libraries), whose embedded build information carries the declared
// flags.
func TestBinariesAreStaticAndBuiltAsDeclared(t *testing.T) {
	t.Parallel()
	operator, pause := built(t)
	_, opFiles := readImage(t, operator)
	_, pauseFiles := readImage(t, pause)
	module := "github.com/outbox-relay/outbox-operator"
	for _, c := range []struct {
		b     goBinary
		files map[string]entry
	}{
		{operatorBinaries(testVersion)[0], opFiles},
		{operatorBinaries(testVersion)[1], opFiles},
		{pauseBinary, pauseFiles},
	} {
		data := c.files[c.b.Path].data
		require.NotEmpty(t, data, c.b.Path)

		f, err := elf.NewFile(bytes.NewReader(data))
		require.NoError(t, err, "%s is an ELF file", c.b.Path)
		require.Equal(t, elfMachine(t, runtime.GOARCH), f.Machine, c.b.Path)
		for _, p := range f.Progs {
			require.NotEqual(t, elf.PT_INTERP, p.Type, "%s asks for a dynamic loader", c.b.Path)
			require.NotEqual(t, elf.PT_DYNAMIC, p.Type, "%s is dynamically linked", c.b.Path)
		}
		libs, err := f.ImportedLibraries()
		require.NoError(t, err)
		require.Empty(t, libs, c.b.Path)

		info, err := buildinfo.Read(bytes.NewReader(data))
		require.NoError(t, err, "%s carries its build information", c.b.Path)
		require.Equal(t, module+"/"+strings.TrimPrefix(c.b.Pkg, "./"), info.Path)
		settings := map[string]string{}
		for _, s := range info.Settings {
			settings[s.Key] = s.Value
		}
		require.Equal(t, "true", settings["-trimpath"], c.b.Path)
		// -trimpath keeps -ldflags out of the build information: look for
		// what they do instead.
		require.Nil(t, f.Section(".symtab"), "%s has a symbol table (-s)", c.b.Path)
		require.Nil(t, f.Section(".debug_info"), "%s has DWARF (-w)", c.b.Path)
		if strings.Contains(c.b.LDFlags, versionpkg.LDFlag("")) {
			require.True(t, bytes.Contains(data, []byte(testVersion)), "%s carries its version", c.b.Path)
		}
		require.Equal(t, "0", settings["CGO_ENABLED"], c.b.Path)
		require.Equal(t, "linux", settings["GOOS"], c.b.Path)
		require.Equal(t, runtime.GOARCH, settings["GOARCH"], c.b.Path)
		require.NotContains(t, settings, "vcs.revision", "%s is stamped with the checkout's state", c.b.Path)
	}
	for _, b := range operatorBinaries(testVersion) {
		require.Contains(t, b.LDFlags, versionpkg.LDFlag(testVersion), b.Path)
	}
}

func elfMachine(t *testing.T, goarch string) elf.Machine {
	t.Helper()
	m, ok := map[string]elf.Machine{
		"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64, "arm": elf.EM_ARM,
		"386": elf.EM_386, "ppc64le": elf.EM_PPC64, "s390x": elf.EM_S390, "riscv64": elf.EM_RISCV,
	}[goarch]
	require.True(t, ok, "no ELF machine known for GOARCH %s", goarch)
	return m
}

func TestPauseImage(t *testing.T) {
	t.Parallel()
	_, pause := built(t)
	require.Equal(t, pauseTag, pause.Tag.String())
	require.Equal(t, filepath.Join(shared.dir, "pause.tar"), pause.Path)
	cfg, files := readImage(t, pause)
	require.Equal(t, []string{"/pause"}, cfg.Config.Entrypoint)
	require.Equal(t, "65535:65535", cfg.Config.User)
	require.Equal(t, "linux", cfg.OS)
	require.Equal(t, runtime.GOARCH, cfg.Architecture)
	require.Equal(t, []string{"/pause"}, sortedKeys(files), "the sandbox image holds /pause alone")
	e := files["/pause"]
	require.Equal(t, int64(0o755), e.hdr.Mode)
	require.Equal(t, []int{0, 0}, []int{e.hdr.Uid, e.hdr.Gid})

	// It runs here (same architecture): it blocks, and SIGTERM ends it
	// cleanly.
	bin := filepath.Join(t.TempDir(), "pause")
	require.NoError(t, os.WriteFile(bin, e.data, 0o755))
	cmd := exec.Command(bin)
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		t.Fatalf("pause exited on its own: %v", err)
	case <-time.After(time.Second):
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "pause exits 0 on SIGTERM")
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("pause did not exit within 10 s of SIGTERM")
	}
}

func sortedKeys(m map[string]entry) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// TestImagesAreReproducible builds everything a second time, binaries
// included, and expects the same digests and the same tarball bytes.
func TestImagesAreReproducible(t *testing.T) {
	t.Parallel()
	operator, pause := built(t)
	operator2, pause2, err := build(t, t.TempDir())
	require.NoError(t, err)
	if operator.Digest != operator2.Digest {
		cfg, _ := readImage(t, operator)
		cfg2, _ := readImage(t, operator2)
		require.Equal(t, cfg.RootFS.DiffIDs[0], cfg2.RootFS.DiffIDs[0], "the base layer")
		require.Equal(t, cfg.RootFS.DiffIDs[1], cfg2.RootFS.DiffIDs[1],
			"the binaries layer (were sources of the manager or the relay edited while the test ran?)")
	}
	require.Equal(t, operator.Digest, operator2.Digest, "operator image digest")
	require.Equal(t, pause.Digest, pause2.Digest, "pause image digest")
	require.Equal(t, fileSum(t, operator.Path), fileSum(t, operator2.Path), "operator tarball bytes")
	require.Equal(t, fileSum(t, pause.Path), fileSum(t, pause2.Path), "pause tarball bytes")
}

func fileSum(t *testing.T, p string) [sha256.Size]byte {
	t.Helper()
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	return sha256.Sum256(data)
}

func TestLayerOfIsCanonical(t *testing.T) {
	t.Parallel()
	epoch := time.Unix(1700000000, 0)
	a, err := layerOf([]file{
		{Name: "/b/c/file", Mode: 0o644, Data: []byte("x")},
		{Name: "/a", Mode: 0o600, Data: []byte("y")},
	}, epoch)
	require.NoError(t, err)
	b, err := layerOf([]file{
		{Name: "/a", Mode: 0o600, Data: []byte("y")},
		{Name: "b/c/file", Mode: 0o644, Data: []byte("x")},
	}, epoch.Add(300*time.Millisecond))
	require.NoError(t, err)
	da, err := a.Digest()
	require.NoError(t, err)
	db, err := b.Digest()
	require.NoError(t, err)
	require.Equal(t, da, db, "input order and sub-second times do not matter")

	rc, err := a.Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	tr := tar.NewReader(rc)
	var names []string
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		names = append(names, hdr.Name)
		require.Equal(t, epoch.UTC(), hdr.ModTime.UTC())
		require.Empty(t, hdr.Uname+hdr.Gname)
		if hdr.Typeflag == tar.TypeDir {
			require.Equal(t, int64(0o755), hdr.Mode, "%s: parents are added as 0755", hdr.Name)
		}
	}
	require.Equal(t, []string{"a", "b/", "b/c/", "b/c/file"}, names)

	_, err = layerOf([]file{{Name: "/a"}, {Name: "a"}}, epoch)
	require.ErrorContains(t, err, "twice")
}

func TestVersionMustMakeATag(t *testing.T) {
	t.Parallel()
	o := testOptions(t, t.TempDir())
	o.Version = "not a tag"
	_, _, err := buildImages(context.Background(), o)
	require.ErrorContains(t, err, "does not make an image tag")
	_, err = name.NewTag(operatorRepo+":"+defaultVersion, name.StrictValidation)
	require.NoError(t, err)
}

// TestUserBinariesLeaveImageBuilderOut: the image builder and its library
// are development tooling, which the manager and the relay must not link.
func TestUserBinariesLeaveImageBuilderOut(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("go", "list", "-deps", "./cmd/manager", "./cmd/relay")
	cmd.Dir = testOptions(t, "").RepoRoot
	out, err := cmd.Output()
	require.NoError(t, err, "go list -deps")
	for _, pkg := range strings.Fields(string(out)) {
		require.False(t, strings.HasPrefix(pkg, "github.com/google/go-containerregistry/"),
			"the manager or the relay links %s", pkg)
		require.False(t, strings.HasPrefix(pkg, "github.com/outbox-relay/outbox-operator/hack/"),
			"the manager or the relay links %s", pkg)
	}
}
