// Package version is the release the operator's binaries were built from,
// stamped in at build time:
//
//	go build -ldflags "-X github.com/outbox-relay/outbox-operator/version.Version=v0.1.0" ./cmd/...
//
// The release tooling (hack/images) stamps it into the manager and the
// relay, and tags the image with it; the manager's default relay image
// carries the same tag.
package version

import "runtime"

// Version is the release, "latest" in a build that was not stamped.
var Version = "latest"

// LDFlag is the -ldflags -X setting that stamps v in.
func LDFlag(v string) string {
	return "-X github.com/outbox-relay/outbox-operator/version.Version=" + v
}

// String is what --version prints: the program, the release, and the Go
// toolchain and platform it was built with.
func String(program string) string {
	return program + " " + Version + " (" + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH + ")"
}
