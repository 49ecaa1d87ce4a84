// Command images builds the project's container images without Docker, with
// go-containerregistry, and writes them as docker-archive tarballs (what
// `ctr images import`, `docker load` and `kind load image-archive` read):
//
//   - outbox-operator.tar, tagged ghcr.io/outbox-relay/outbox-operator:<version>:
//     the static binaries /manager (the entrypoint) and /relay, with the files
//     of gcr.io/distroless/static's nonroot variant that they rely on
//     (/etc/passwd and /etc/group with nonroot 65532, the CA bundle, /tmp),
//     on an empty base; user 65532:65532, ports 8443, 8081 and 9090. It is
//     the image the Dockerfile builds, file for file where it matters (the
//     tests parse the Dockerfile and compare).
//   - pause.tar, tagged localhost/outbox-pause:3.10: the pod sandbox image
//     (/pause, which waits for SIGTERM), for a container runtime that must
//     not pull one.
//
// Layers are reproducible: fixed times (-source-date-epoch, default
// $SOURCE_DATE_EPOCH or 0), sorted entries, files owned by root, so the same
// sources, toolchain and CA bundle give the same image digests.
//
// Run it from the repository (make images does):
//
//	go run ./hack/images -out bin/images [-version v0.1.0]
//
// With -release MAJOR.MINOR.PATCH it writes a release instead (make release,
// docs/release.md): the operator image for linux/amd64 and linux/arm64 as
// an OCI image index in an OCI layout tar, its CycloneDX SBOM, the packaged
// chart, install.yaml pinned by the index's digest, and checksums.txt.
//
// It is development tooling: the manager and the relay do not link it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	epoch, err := envEpoch()
	if err != nil {
		fail(err)
	}
	o := options{}
	flag.StringVar(&o.OutDir, "out", "bin/images", "directory the tarballs are written to")
	flag.StringVar(&o.Version, "version", defaultVersion, "the operator image's tag and the binaries' version (package version)")
	flag.StringVar(&o.GOARCH, "goarch", runtime.GOARCH, "the images' architecture (GOARCH); the OS is linux")
	flag.StringVar(&o.CABundle, "ca-bundle", defaultCABundle, "PEM CA bundle copied to /etc/ssl/certs/ca-certificates.crt")
	seconds := flag.Int64("source-date-epoch", epoch, "Unix time of every file and of the images' creation")
	releaseVersion := flag.String("release", "", "write release MAJOR.MINOR.PATCH into -out instead: the image index (linux/"+strings.Join(releaseArchs, ", linux/")+"), its SBOM, the chart, install.yaml and checksums.txt")
	kubectl := flag.String("kubectl", "kubectl", "kubectl that renders config/default for -release")
	untagged := flag.Bool("untagged", false, "with -release: build from the working tree as it is, not only from a clean checkout of tag v<release> (a trial; never publish it)")
	flag.Parse()
	if flag.NArg() != 0 {
		fail(fmt.Errorf("unexpected arguments %q", flag.Args()))
	}
	o.Epoch = time.Unix(*seconds, 0).UTC()

	if o.RepoRoot, err = repoRoot(); err != nil {
		fail(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *releaseVersion != "" {
		if !*untagged {
			if err := checkReleaseTree(o.RepoRoot, *releaseVersion); err != nil {
				fail(err)
			}
		}
		res, err := release(ctx, o, *releaseVersion, *kubectl)
		if err != nil {
			fail(err)
		}
		for _, f := range res.Files {
			fmt.Println(filepath.Join(o.OutDir, f))
		}
		fmt.Printf("image index %s@%s\n", operatorRepo, res.Index)
		return
	}
	operator, pause, err := buildImages(ctx, o)
	if err != nil {
		fail(err)
	}
	for _, r := range []result{operator, pause} {
		fmt.Printf("%s\t%s\t%s\n", r.Path, r.Tag, r.Digest)
	}
}

// envEpoch is $SOURCE_DATE_EPOCH, or 0.
func envEpoch() (int64, error) {
	v := os.Getenv("SOURCE_DATE_EPOCH")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("SOURCE_DATE_EPOCH=%q is not a Unix time: %w", v, err)
	}
	return n, nil
}

// repoRoot is the directory of the main module's go.mod, as the go command
// finds it from the working directory.
func repoRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("run this inside the repository (no go.mod found from the working directory)")
	}
	return filepath.Dir(gomod), nil
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "images:", err)
	os.Exit(1)
}
