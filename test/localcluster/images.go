package localcluster

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// imageVersion is the tag of the operator image the stack builds and runs.
// Not "latest": a pod whose image is tagged latest is pulled on every start,
// and nothing can be pulled here.
const imageVersion = "local"

// imageSet is what buildImages wrote.
type imageSet struct {
	tarballs    []string // the operator image, then the pause image
	operatorTag string
	pauseTag    string
}

// buildImages builds the operator and pause images into dir with the
// project's image builder (make images), from the working tree.
func buildImages(ctx context.Context, dir, logPath string) (imageSet, error) {
	cmd := exec.CommandContext(ctx, "go", "run", "./hack/images", "-out", dir, "-version", imageVersion)
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.CombinedOutput()
	_ = os.WriteFile(logPath, out, 0o644)
	if err != nil {
		return imageSet{}, fmt.Errorf("build the images (go run ./hack/images): %w\n%s", err, out)
	}
	set := imageSet{tarballs: []string{filepath.Join(dir, "outbox-operator.tar"), filepath.Join(dir, "pause.tar")}}
	if set.operatorTag, err = tarballTag(set.tarballs[0]); err != nil {
		return imageSet{}, err
	}
	if set.pauseTag, err = tarballTag(set.tarballs[1]); err != nil {
		return imageSet{}, err
	}
	return set, nil
}

// tarballTag reads the one tag of a docker-archive tarball from its
// manifest.json.
func tarballTag(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return "", fmt.Errorf("%s: no manifest.json", path)
		}
		if err != nil {
			return "", fmt.Errorf("%s: %w", path, err)
		}
		if h.Name != "manifest.json" {
			continue
		}
		var m []struct{ RepoTags []string }
		if err := json.NewDecoder(tr).Decode(&m); err != nil {
			return "", fmt.Errorf("%s: manifest.json: %w", path, err)
		}
		if len(m) != 1 || len(m[0].RepoTags) != 1 {
			return "", fmt.Errorf("%s: want one image with one tag, manifest.json has %+v", path, m)
		}
		return m[0].RepoTags[0], nil
	}
}
