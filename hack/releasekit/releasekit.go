// Package releasekit is what the release tools (hack/images -release,
// hack/bundle) share: the version rule, the operator image's repository,
// and config/default as it installs the operator. Development tooling: the
// manager and the relay do not link it.
package releasekit

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
)

// OperatorRepo is the operator image's repository.
const OperatorRepo = "ghcr.io/outbox-relay/outbox-operator"

// Placeholder is the image config/ runs (the manager's and its default
// relay image); a release replaces it with the release's image.
const Placeholder = OperatorRepo + ":latest"

// versionRE is a release version: MAJOR.MINOR.PATCH with an optional
// pre-release, no leading "v" (image tags and appVersion add it).
var versionRE = regexp.MustCompile(`^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$`)

// CheckVersion applies the release version rule. A version ending in -dev
// is the tree's between releases (charts/outbox-operator/Chart.yaml), never
// a release's: the chart renders without an image set only when it is not.
func CheckVersion(v string) error {
	if !versionRE.MatchString(v) {
		return fmt.Errorf("-version %q is not MAJOR.MINOR.PATCH[-PRERELEASE] (without a leading v)", v)
	}
	if strings.HasSuffix(v, "-dev") {
		return fmt.Errorf("-version %q is a development version (-dev), not a release's", v)
	}
	return nil
}

// RenderDefault is config/default of the repository at root as kubectl
// kustomize renders it, with Placeholder replaced by image.
func RenderDefault(ctx context.Context, root, kubectl, image string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, kubectl, "kustomize", "config/default")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s kustomize config/default: %w: %s", kubectl, err, stderr.String())
	}
	if !bytes.Contains(out, []byte(Placeholder)) {
		return nil, fmt.Errorf("config/default does not run %s; the release would not pin its image", Placeholder)
	}
	return bytes.ReplaceAll(out, []byte(Placeholder), []byte(image)), nil
}

// Release is a published release: its version and the commit it was cut
// from (the commit its v-tag points to).
type Release struct {
	Version string // without the leading "v"
	Commit  string // full hash
}

// Tag is the release's git tag.
func (r Release) Tag() string { return "v" + r.Version }

// Releases lists every release, oldest first. Cutting a release appends one
// (docs/release.md): a clone without tags (CI checks out main alone) still
// knows which commit the upgrade test must start from, and a test checks
// each entry against its tag wherever the tags are present.
var Releases = []Release{
	{Version: "0.1.0", Commit: "47e31cbef7ce1aa79b5217e0ef6a40ff641e0f0b"},
}

// Latest is the newest release.
func Latest() Release { return Releases[len(Releases)-1] }
