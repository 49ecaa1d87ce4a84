package main

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// distroless is what the Dockerfile's final stage starts from, as
// distroless defines its static nonroot variant: the configuration, and the
// files of it that the builder writes itself (the base layer). Its other
// files (tzdata, /etc/services, media types, os-release, package records)
// are read by nothing in the binaries, so the builder leaves them out.
var distroless = struct {
	image  string
	config struct {
		user, workdir string
		env           []string
	}
	files map[string]baseEntry
}{
	image: "gcr.io/distroless/static-debian12:nonroot",
	config: struct {
		user, workdir string
		env           []string
	}{
		user:    "65532",
		workdir: "/home/nonroot",
		env: []string{
			"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
		},
	},
	files: map[string]baseEntry{
		"/etc":                               {dir: true, mode: 0o755},
		"/etc/passwd":                        {mode: 0o644},
		"/etc/group":                         {mode: 0o644},
		"/etc/nsswitch.conf":                 {mode: 0o644},
		"/etc/ssl":                           {dir: true, mode: 0o755},
		"/etc/ssl/certs":                     {dir: true, mode: 0o755},
		"/etc/ssl/certs/ca-certificates.crt": {mode: 0o644},
		"/home":                              {dir: true, mode: 0o755},
		"/home/nonroot":                      {dir: true, mode: 0o700, uid: 65532, gid: 65532},
		"/root":                              {dir: true, mode: 0o700},
		"/tmp":                               {dir: true, mode: 0o1777},
	},
}

type baseEntry struct {
	dir      bool
	mode     int64
	uid, gid int
}

// instruction is one Dockerfile instruction, continuation lines joined and
// comments dropped.
type instruction struct {
	cmd  string // upper case
	args string
}

func parseDockerfile(t *testing.T, text string) (stages [][]instruction) {
	t.Helper()
	var cur strings.Builder
	flush := func() {
		line := strings.TrimSpace(cur.String())
		cur.Reset()
		if line == "" {
			return
		}
		cmd, args, _ := strings.Cut(line, " ")
		in := instruction{cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)}
		if in.cmd == "FROM" {
			stages = append(stages, nil)
		}
		require.NotEmpty(t, stages, "%s before the first FROM", in.cmd)
		stages[len(stages)-1] = append(stages[len(stages)-1], in)
	}
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		if body, ok := strings.CutSuffix(strings.TrimRight(line, " \t"), `\`); ok {
			cur.WriteString(body + " ")
			continue
		}
		cur.WriteString(line)
		flush()
	}
	flush()
	return stages
}

// shellWords splits a command line into words, honouring quotes (enough for
// the Dockerfile's RUN lines).
func shellWords(t *testing.T, s string) []string {
	t.Helper()
	var words []string
	var w strings.Builder
	inWord := false
	var quote rune
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			w.WriteRune(r)
		case r == '"' || r == '\'':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteRune(r)
			inWord = true
		}
	}
	require.Zero(t, quote, "unbalanced quote in %q", s)
	if inWord {
		words = append(words, w.String())
	}
	return words
}

// dockerGoBuild is one `go build` of the Dockerfile's build stage.
type dockerGoBuild struct {
	env   []string // the command's own assignments
	flags []string // without -o and the package
	out   string
	pkg   string
}

func dockerGoBuilds(t *testing.T, stage []instruction) []dockerGoBuild {
	t.Helper()
	var builds []dockerGoBuild
	for _, in := range stage {
		if in.cmd != "RUN" {
			continue
		}
		for _, part := range strings.Split(in.args, "&&") {
			words := shellWords(t, part)
			i := slices.Index(words, "go")
			if i < 0 || i+1 >= len(words) || words[i+1] != "build" {
				continue
			}
			b := dockerGoBuild{env: words[:i]}
			for j := i + 2; j < len(words); j++ {
				switch w := words[j]; {
				case w == "-o":
					j++
					b.out = words[j]
				case w == "-ldflags":
					b.flags = append(b.flags, w, words[j+1])
					j++
				case strings.HasPrefix(w, "-"):
					b.flags = append(b.flags, w)
				default:
					require.Empty(t, b.pkg, "one package per go build: %q", part)
					b.pkg = w
				}
			}
			builds = append(builds, b)
		}
	}
	return builds
}

// TestDockerfileBuildsTheSameImage holds the Dockerfile and the builder in
// step: the Dockerfile's image is the distroless nonroot base plus its
// final stage; the builder's is its base layer (those distroless files) plus
// the same binaries, built the same way, under the same configuration.
func TestDockerfileBuildsTheSameImage(t *testing.T) {
	t.Parallel()
	root := testOptions(t, "").RepoRoot
	text, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	require.NoError(t, err)
	stages := parseDockerfile(t, string(text))
	require.Len(t, stages, 2, "a build stage and the final image")
	buildStage, final := stages[0], stages[1]

	// The toolchain: the build stage's golang image is the go directive's
	// release.
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	require.NoError(t, err)
	goLine := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	require.NotNil(t, goLine, "go.mod's go directive")
	require.Equal(t, "golang:"+string(goLine[1])+" AS build", buildStage[0].args)

	// The sources: every directory of the module that the binaries import
	// is copied into the build stage (a package moved to a new directory
	// must not break `docker build`).
	var copiedDirs []string
	for _, in := range buildStage {
		if w := strings.Fields(in.args); in.cmd == "COPY" && len(w) == 2 && strings.HasSuffix(w[0], "/") {
			copiedDirs = append(copiedDirs, strings.TrimSuffix(w[0], "/"))
			_, err := os.Stat(filepath.Join(root, w[0]))
			require.NoError(t, err, "the Dockerfile copies %s, which is not in the repository", w[0])
		}
	}
	list := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", "./cmd/manager", "./cmd/relay")
	list.Dir = root
	out, err := list.Output()
	require.NoError(t, err)
	for _, pkg := range strings.Fields(string(out)) {
		rel, ok := strings.CutPrefix(pkg, "github.com/outbox-relay/outbox-operator/")
		if !ok {
			continue
		}
		top, _, _ := strings.Cut(rel, "/")
		require.Contains(t, copiedDirs, top, "the binaries import %s; the Dockerfile's build stage must COPY %s/", pkg, top)
	}

	// The build: each binary built with the builder's flags and environment.
	require.Contains(t, buildStage, instruction{cmd: "ENV", args: "CGO_ENABLED=0"})
	require.Contains(t, buildStage, instruction{cmd: "ARG", args: "TARGETOS=linux"})
	require.Contains(t, buildEnv("amd64"), "CGO_ENABLED=0")
	require.Contains(t, buildEnv("amd64"), "GOOS=linux")
	builds := dockerGoBuilds(t, buildStage)
	bins := operatorBinaries("${VERSION}")
	require.Len(t, builds, len(bins), "the Dockerfile's go builds")
	require.Contains(t, buildStage, instruction{cmd: "ARG", args: "VERSION=" + defaultVersion})
	outToPath := map[string]string{}
	for _, b := range bins {
		i := slices.IndexFunc(builds, func(d dockerGoBuild) bool { return d.pkg == b.Pkg })
		require.GreaterOrEqual(t, i, 0, "the Dockerfile builds %s", b.Pkg)
		d := builds[i]
		require.Equal(t, b.buildFlags(), d.flags, "go build flags of %s (Dockerfile, hack/images)", b.Pkg)
		require.Equal(t, []string{"GOOS=$TARGETOS", "GOARCH=$TARGETARCH"}, d.env, b.Pkg)
		outToPath[d.out] = b.Path
	}

	// The final stage: the distroless base, the binaries where the builder
	// puts them, and the configuration.
	require.Equal(t, distroless.image, final[0].args, "the final stage's base")
	cfg := struct {
		user, workdir    string
		env              []string
		ports            []string
		entrypoint, cmd  []string
		copied, copySrcs []string
		labels           map[string]string
	}{user: distroless.config.user, workdir: distroless.config.workdir, env: distroless.config.env, labels: map[string]string{}}
	for _, in := range final[1:] {
		switch in.cmd {
		case "ARG":
			require.Equal(t, "VERSION="+defaultVersion, in.args, "the final stage's only ARG")
		case "LABEL":
			k, v, ok := strings.Cut(in.args, "=")
			require.True(t, ok, "LABEL KEY=VALUE, one per line: %q", in.args)
			if u, err := strconv.Unquote(v); err == nil {
				v = u
			}
			cfg.labels[k] = v
		case "USER":
			cfg.user = in.args
		case "WORKDIR":
			cfg.workdir = in.args
		case "EXPOSE":
			for _, p := range strings.Fields(in.args) {
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				cfg.ports = append(cfg.ports, p)
			}
		case "ENTRYPOINT":
			require.NoError(t, json.Unmarshal([]byte(in.args), &cfg.entrypoint), "ENTRYPOINT in exec form")
		case "CMD":
			require.NoError(t, json.Unmarshal([]byte(in.args), &cfg.cmd), "CMD in exec form")
		case "ENV":
			k, v, ok := strings.Cut(in.args, "=")
			require.True(t, ok && !strings.ContainsAny(v, " \t"), "ENV KEY=VALUE, one per line: %q", in.args)
			cfg.env = slices.DeleteFunc(slices.Clone(cfg.env), func(e string) bool { return strings.HasPrefix(e, k+"=") })
			cfg.env = append(cfg.env, k+"="+v)
		case "COPY":
			words := strings.Fields(in.args)
			require.Equal(t, []string{"--from=build"}, words[:len(words)-2],
				"the final stage copies only build results: %q", in.args)
			cfg.copySrcs = append(cfg.copySrcs, words[len(words)-2])
			cfg.copied = append(cfg.copied, words[len(words)-1])
		default:
			t.Fatalf("the final stage has %s %s, which this test (and hack/images) does not know", in.cmd, in.args)
		}
	}
	want := operatorConfig("${VERSION}")
	require.Equal(t, want.Labels, cfg.labels, "LABELs (the image's OCI annotations)")
	require.Equal(t, want.User, cfg.user, "USER")
	require.Equal(t, want.WorkingDir, cfg.workdir, "WORKDIR")
	require.Equal(t, want.Env, cfg.env, "the environment")
	require.Equal(t, want.Entrypoint, cfg.entrypoint, "ENTRYPOINT")
	require.Equal(t, []string(nil), cfg.cmd, "CMD")
	require.ElementsMatch(t, operatorPorts, cfg.ports, "EXPOSE")
	var copied []string
	for i, src := range cfg.copySrcs {
		require.Equal(t, outToPath[src], cfg.copied[i], "COPY %s: where the builder puts that binary", src)
		copied = append(copied, cfg.copied[i])
	}
	var paths []string
	for _, b := range bins {
		paths = append(paths, b.Path)
	}
	require.ElementsMatch(t, paths, copied, "the binaries in the image")

	// The filesystem: the built image holds exactly the distroless files
	// listed above (same modes and owners) and the copied binaries.
	operator, _ := built(t)
	_, files := readImage(t, operator)
	for p, e := range files {
		if slices.Contains(copied, p) {
			continue
		}
		d, ok := distroless.files[p]
		require.True(t, ok, "%s is in the built image but neither in the distroless base nor copied by the Dockerfile", p)
		require.Equal(t, d.dir, e.hdr.Typeflag == tar.TypeDir, "%s: directory or file", p)
		require.Equal(t, fmt.Sprintf("%o %d:%d", d.mode, d.uid, d.gid),
			fmt.Sprintf("%o %d:%d", e.hdr.Mode, e.hdr.Uid, e.hdr.Gid), "%s: mode and owner", p)
	}
	for p := range distroless.files {
		require.Contains(t, files, p, "the built image lacks %s", p)
	}
	for _, p := range copied {
		require.Contains(t, files, p, "the built image lacks %s", p)
	}
}

// TestConfigRunsTheBuiltImage: config/manager runs the image `make images`
// tags by default, and uses it as the default relay image too.
func TestConfigRunsTheBuiltImage(t *testing.T) {
	t.Parallel()
	manifest, err := os.ReadFile(filepath.Join(testOptions(t, "").RepoRoot, "config", "manager", "manager.yaml"))
	require.NoError(t, err)
	image := operatorRepo + ":" + defaultVersion
	require.Regexp(t, `(?m)^\s+image: `+regexp.QuoteMeta(image)+`$`, string(manifest))
	require.Regexp(t, `(?m)^\s+- name: RELAY_IMAGE\n\s+value: `+regexp.QuoteMeta(image)+`$`, string(manifest))
	for _, m := range regexp.MustCompile(`(?m)^\s+image: (\S+)$`).FindAllSubmatch(manifest, -1) {
		require.Equal(t, image, string(m[1]))
	}
}
