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
)

// OperatorRepo is the operator image's repository.
const OperatorRepo = "ghcr.io/outbox-relay/outbox-operator"

// Placeholder is the image config/ runs (the manager's and its default
// relay image); a release replaces it with the release's image.
const Placeholder = OperatorRepo + ":latest"

// versionRE is a release version: MAJOR.MINOR.PATCH with an optional
// pre-release, no leading "v" (image tags and appVersion add it).
var versionRE = regexp.MustCompile(`^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$`)

// CheckVersion applies the release version rule.
func CheckVersion(v string) error {
	if !versionRE.MatchString(v) {
		return fmt.Errorf("-version %q is not MAJOR.MINOR.PATCH[-PRERELEASE] (without a leading v)", v)
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
