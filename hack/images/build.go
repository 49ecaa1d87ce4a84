package main

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/outbox-relay/outbox-operator/hack/releasekit"
	versionpkg "github.com/outbox-relay/outbox-operator/version"
)

// What the images are called and where they are written.
const (
	// operatorRepo is the operator image's repository; config/manager runs
	// operatorRepo:latest (and the manager's default relay image is
	// operatorRepo:<its version>).
	operatorRepo = releasekit.OperatorRepo
	// defaultVersion is the operator image's tag and the manager's
	// version (package version) when none is given, as in the Dockerfile (ARG VERSION).
	defaultVersion = "latest"
	// pauseTag names the pod sandbox image, for the container runtime's
	// sandbox image setting. "localhost/" keeps it apart from any registry.
	pauseTag = "localhost/outbox-pause:3.10"

	operatorFile = "outbox-operator.tar"
	pauseFile    = "pause.tar"

	// defaultCABundle is where Debian's ca-certificates package puts the
	// bundle; the image gets a copy at the same path.
	defaultCABundle = "/etc/ssl/certs/ca-certificates.crt"
)

// The users the images run as.
const (
	// nonrootID is distroless's "nonroot" user and group, which the
	// Dockerfile's USER and config/manager's runAsUser name.
	nonrootID = 65532
	// pauseID is the user the sandbox image runs as (the upstream pause
	// image's choice: an id no other image uses).
	pauseID = 65535
)

// operatorPorts are the manager's metrics (8443, HTTPS) and probe (8081) ports and
// the relay's metrics port (9090): the Dockerfile's EXPOSE.
var operatorPorts = []string{"8443/tcp", "8081/tcp", "9090/tcp"}

// baseEnv is the environment gcr.io/distroless/static sets, which the
// Dockerfile's image inherits.
var baseEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
}

// goBinary is one program of an image and how it is built.
type goBinary struct {
	// Path is where the image holds it.
	Path string
	// Pkg is its main package, relative to the repository root.
	Pkg string
	// LDFlags is the -ldflags value.
	LDFlags string
}

// buildFlags are the `go build` flags, without -o and the package. The
// Dockerfile's build stage passes the same (the tests compare them).
func (b goBinary) buildFlags() []string {
	return []string{"-trimpath", "-buildvcs=false", "-ldflags", b.LDFlags}
}

// buildEnv is the environment `go build` runs with, on top of the caller's:
// static binaries (no cgo) for linux/goarch. GOFLAGS is cleared so that the
// flags above are all the flags, as in the Dockerfile's golang image.
func buildEnv(goarch string) []string {
	return []string{"CGO_ENABLED=0", "GOOS=linux", "GOARCH=" + goarch, "GOFLAGS="}
}

// operatorBinaries are the operator image's programs: the manager (the
// entrypoint, which stamps its version into the default relay image) and
// the relay, which relay pods run.
func operatorBinaries(release string) []goBinary {
	return []goBinary{
		{Path: "/manager", Pkg: "./cmd/manager", LDFlags: "-s -w " + versionpkg.LDFlag(release)},
		{Path: "/relay", Pkg: "./cmd/relay", LDFlags: "-s -w " + versionpkg.LDFlag(release)},
	}
}

// pauseBinary is the sandbox image's only program.
var pauseBinary = goBinary{Path: "/pause", Pkg: "./hack/images/pause", LDFlags: "-s -w"}

// operatorConfig is the operator image's configuration: what the
// Dockerfile's final stage gives (its USER, WORKDIR, EXPOSE and ENTRYPOINT
// over the distroless base's environment).
func operatorConfig(release string) v1.Config {
	ports := make(map[string]struct{}, len(operatorPorts))
	for _, p := range operatorPorts {
		ports[p] = struct{}{}
	}
	return v1.Config{
		Entrypoint:   []string{"/manager"},
		Labels:       operatorLabels(release),
		User:         fmt.Sprintf("%d:%d", nonrootID, nonrootID),
		ExposedPorts: ports,
		Env:          append([]string(nil), baseEnv...),
		WorkingDir:   "/",
	}
}

// operatorLabels are the operator image's OCI annotations (the Dockerfile's LABELs).
func operatorLabels(release string) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       "outbox-operator",
		"org.opencontainers.image.description": "Kubernetes operator for transactional-outbox relays (PostgreSQL to Kafka); /manager and /relay",
		"org.opencontainers.image.source":      "https://github.com/outbox-relay/outbox-operator",
		"org.opencontainers.image.licenses":    "Apache-2.0",
		"org.opencontainers.image.version":     release,
	}
}

// pauseConfig is the sandbox image's configuration.
func pauseConfig() v1.Config {
	return v1.Config{
		Entrypoint: []string{"/pause"},
		User:       fmt.Sprintf("%d:%d", pauseID, pauseID),
		WorkingDir: "/",
	}
}

// options say what buildImages builds.
type options struct {
	// RepoRoot is the module's root directory.
	RepoRoot string
	// OutDir receives the tarballs.
	OutDir string
	// Version is the operator image's tag and the binaries' version (package version).
	Version string
	// GOARCH is the images' architecture (their OS is linux).
	GOARCH string
	// CABundle is the PEM file copied to /etc/ssl/certs/ca-certificates.crt.
	CABundle string
	// Epoch is every file's modification time and the images' creation time.
	Epoch time.Time
}

// result is one written image.
type result struct {
	// Path is the docker-archive tarball.
	Path string
	// Tag is the name it carries.
	Tag name.Tag
	// Digest is its manifest's digest.
	Digest v1.Hash
}

// buildImages builds the binaries and writes the operator image and the
// sandbox image as docker-archive tarballs into o.OutDir. The same inputs
// (sources, toolchain, CA bundle, options) give the same bytes.
func buildImages(ctx context.Context, o options) (operator, pause result, err error) {
	opTag, err := name.NewTag(operatorRepo+":"+o.Version, name.StrictValidation)
	if err != nil {
		return result{}, result{}, fmt.Errorf("version %q does not make an image tag: %w", o.Version, err)
	}
	pTag, err := name.NewTag(pauseTag, name.StrictValidation)
	if err != nil {
		return result{}, result{}, err
	}
	ca, err := readCABundle(o.CABundle)
	if err != nil {
		return result{}, result{}, err
	}

	binDir, err := os.MkdirTemp("", "outbox-images-")
	if err != nil {
		return result{}, result{}, err
	}
	defer os.RemoveAll(binDir)
	progs := append(operatorBinaries(o.Version), pauseBinary)
	bins, err := buildBinaries(ctx, o.RepoRoot, o.GOARCH, binDir, progs)
	if err != nil {
		return result{}, result{}, err
	}

	opImg, err := operatorImage(o, o.GOARCH, ca, bins[:len(progs)-1])
	if err != nil {
		return result{}, result{}, err
	}
	pauseBin, err := layerOf(bins[len(progs)-1:], o.Epoch)
	if err != nil {
		return result{}, result{}, err
	}
	pImg, err := assemble(pauseConfig(), o.GOARCH, o.Epoch,
		mutate.Addendum{Layer: pauseBin, History: history(o.Epoch, "go build: /pause (./hack/images/pause)")})
	if err != nil {
		return result{}, result{}, err
	}

	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return result{}, result{}, err
	}
	if operator, err = write(filepath.Join(o.OutDir, operatorFile), opTag, opImg); err != nil {
		return result{}, result{}, err
	}
	if pause, err = write(filepath.Join(o.OutDir, pauseFile), pTag, pImg); err != nil {
		return result{}, result{}, err
	}
	return operator, pause, nil
}

// operatorImage assembles the operator image for goarch from the CA bundle
// and its binaries (operatorBinaries, built for goarch). layerOpts set the
// layers' media type (the docker-archive's default, or OCI's).
func operatorImage(o options, goarch string, ca []byte, bins []file, layerOpts ...tarball.LayerOption) (v1.Image, error) {
	base, err := layerOf(baseFiles(ca), o.Epoch, layerOpts...)
	if err != nil {
		return nil, err
	}
	opBins, err := layerOf(bins, o.Epoch, layerOpts...)
	if err != nil {
		return nil, err
	}
	return assemble(operatorConfig(o.Version), goarch, o.Epoch,
		mutate.Addendum{Layer: base, History: history(o.Epoch,
			"users (root, nobody, nonroot 65532), nsswitch.conf, CA certificates, /tmp, home directories")},
		mutate.Addendum{Layer: opBins, History: history(o.Epoch,
			"go build "+o.Version+": /manager (./cmd/manager), /relay (./cmd/relay)")})
}

// readCABundle reads a PEM bundle and checks that it holds certificates.
func readCABundle(p string) ([]byte, error) {
	ca, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("CA certificates: %w (Debian's ca-certificates package provides %s)", err, defaultCABundle)
	}
	if !x509.NewCertPool().AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("CA certificates: %s holds no PEM certificate", p)
	}
	return ca, nil
}

// buildBinaries builds progs into dir, concurrently, and returns them as
// image files (mode 0755, owned by root) in the same order.
func buildBinaries(ctx context.Context, repoRoot, goarch, dir string, progs []goBinary) ([]file, error) {
	files := make([]file, len(progs))
	errs := make([]error, len(progs))
	var wg sync.WaitGroup
	for i, b := range progs {
		wg.Go(func() {
			out := filepath.Join(dir, path.Base(b.Path))
			args := append(append([]string{"build"}, b.buildFlags()...), "-o", out, b.Pkg)
			cmd := exec.CommandContext(ctx, "go", args...)
			cmd.Dir = repoRoot
			cmd.Env = append(os.Environ(), buildEnv(goarch)...)
			if msg, err := cmd.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, msg)
				return
			}
			data, err := os.ReadFile(out)
			if err != nil {
				errs[i] = err
				return
			}
			files[i] = file{Name: b.Path, Mode: 0o755, Data: data}
		})
	}
	wg.Wait()
	return files, errors.Join(errs...)
}

// file is one entry of a layer.
type file struct {
	// Name is the absolute path in the image.
	Name string
	// Mode is the permission bits, with the sticky bit (01000) if wanted.
	Mode int64
	// UID and GID own it; zero is root.
	UID, GID int
	// Dir makes it a directory (Data is then empty).
	Dir bool
	// Data is a regular file's contents.
	Data []byte
}

// baseFiles are the files of gcr.io/distroless/static's nonroot variant
// that the programs rely on: the users and groups (so uid 65532 has a name
// and a home), the resolver's lookup order, the CA bundle (TLS to Kafka and
// PostgreSQL, through the system roots), a world-writable /tmp and the home
// directories. Distroless also ships tzdata, netbase's /etc/services,
// media types and an os-release; nothing in the binaries reads them.
func baseFiles(caBundle []byte) []file {
	passwd := "root:x:0:0:root:/root:/sbin/nologin\n" +
		"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n" +
		fmt.Sprintf("nonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", nonrootID, nonrootID)
	group := "root:x:0:\n" +
		"nobody:x:65534:\n" +
		"tty:x:5:\n" +
		"staff:x:50:\n" +
		fmt.Sprintf("nonroot:x:%d:\n", nonrootID)
	nsswitch := "# Look names up in the files first, then (hosts) in DNS.\n" +
		"passwd: files\n" +
		"group: files\n" +
		"hosts: files dns\n"
	return []file{
		{Name: "/etc/passwd", Mode: 0o644, Data: []byte(passwd)},
		{Name: "/etc/group", Mode: 0o644, Data: []byte(group)},
		{Name: "/etc/nsswitch.conf", Mode: 0o644, Data: []byte(nsswitch)},
		{Name: "/etc/ssl/certs/ca-certificates.crt", Mode: 0o644, Data: caBundle},
		{Name: "/tmp", Dir: true, Mode: 0o1777},
		{Name: "/root", Dir: true, Mode: 0o700},
		{Name: "/home", Dir: true, Mode: 0o755},
		{Name: "/home/nonroot", Dir: true, Mode: 0o700, UID: nonrootID, GID: nonrootID},
	}
}

// layerOf makes a reproducible layer of files: entries sorted by path, every
// missing parent directory added (0755, root), every time set to mtime, no
// user or group names, and gzip without a timestamp.
func layerOf(files []file, mtime time.Time, opts ...tarball.LayerOption) (v1.Layer, error) {
	all := map[string]file{}
	for _, f := range files {
		clean := path.Clean("/" + f.Name)
		if clean == "/" {
			return nil, errors.New("a layer cannot hold / itself")
		}
		if _, dup := all[clean]; dup {
			return nil, fmt.Errorf("%s is in the layer twice", clean)
		}
		f.Name = clean
		all[clean] = f
		for dir := path.Dir(clean); dir != "/"; dir = path.Dir(dir) {
			if _, ok := all[dir]; !ok {
				all[dir] = file{Name: dir, Dir: true, Mode: 0o755}
			}
		}
	}
	names := make([]string, 0, len(all))
	for n := range all {
		names = append(names, n)
	}
	slices.Sort(names)

	mtime = mtime.UTC().Truncate(time.Second)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		f := all[n]
		hdr := &tar.Header{
			Name:    strings.TrimPrefix(n, "/"),
			Mode:    f.Mode,
			Uid:     f.UID,
			Gid:     f.GID,
			ModTime: mtime,
			Format:  tar.FormatPAX,
		}
		if f.Dir {
			if len(f.Data) > 0 {
				return nil, fmt.Errorf("directory %s has contents", n)
			}
			hdr.Typeflag = tar.TypeDir
			hdr.Name += "/"
		} else {
			hdr.Typeflag = tar.TypeReg
			hdr.Size = int64(len(f.Data))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.Data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, append([]tarball.LayerOption{tarball.WithCompressedCaching}, opts...)...)
}

// assemble puts layers on an empty base under cfg.
func assemble(cfg v1.Config, goarch string, epoch time.Time, layers ...mutate.Addendum) (v1.Image, error) {
	img, err := mutate.ConfigFile(empty.Image, &v1.ConfigFile{
		Architecture: goarch,
		OS:           "linux",
		Created:      v1.Time{Time: epoch.UTC()},
		Config:       cfg,
		RootFS:       v1.RootFS{Type: "layers"},
	})
	if err != nil {
		return nil, err
	}
	return mutate.Append(img, layers...)
}

func history(epoch time.Time, what string) v1.History {
	return v1.History{Created: v1.Time{Time: epoch.UTC()}, CreatedBy: "hack/images: " + what}
}

// write writes img as a docker-archive tarball tagged tag, through a
// temporary file so that p is either whole or absent.
func write(p string, tag name.Tag, img v1.Image) (result, error) {
	digest, err := img.Digest()
	if err != nil {
		return result{}, err
	}
	tmp := p + ".tmp"
	if err := tarball.WriteToFile(tmp, tag, img); err != nil {
		os.Remove(tmp)
		return result{}, fmt.Errorf("writing %s: %w", p, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		return result{}, err
	}
	return result{Path: p, Tag: tag, Digest: digest}, nil
}
