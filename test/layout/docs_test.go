package layout

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// yamlBlock is a fenced YAML block of a Markdown page, indented or not
// (in a list item).
var yamlBlock = regexp.MustCompile("(?ms)^( *)```ya?ml\n(.*?)^ *```")

// Every YAML block of the docs parses, so what a reader copies is at least
// YAML. Before, a kustomization in docs/install.md put a URL with '?' in a
// flow list, which kustomize refuses.
func TestDocsYAMLParses(t *testing.T) {
	root := testenv.RepoRoot()
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	pages = append(pages, filepath.Join(root, "README.md"))
	blocks := 0
	for _, page := range pages {
		text, err := os.ReadFile(page)
		require.NoError(t, err)
		for _, m := range yamlBlock.FindAllSubmatch(text, -1) {
			blocks++
			block := regexp.MustCompile("(?m)^"+string(m[1])).ReplaceAll(m[2], nil)
			dec := yaml.NewDecoder(bytes.NewReader(block))
			for {
				var doc any
				err := dec.Decode(&doc)
				if errors.Is(err, io.EOF) {
					break
				}
				require.NoError(t, err, "%s:\n%s", filepath.Base(page), block)
			}
		}
	}
	require.GreaterOrEqual(t, blocks, 8, "the pattern finds the docs' YAML blocks")
}
