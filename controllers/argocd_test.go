package controllers

import (
	"context"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// argoHealth runs config/argocd/health.lua over an OutboxRelay as Argo CD
// runs a resource health check: the object as the global obj (JSON numbers
// as Lua numbers, lists as 1-based tables), only the base, table and
// package libraries open, and a one-second deadline. It returns hs.status
// and hs.message.
func argoHealth(t testing.TB, relay *outboxv1alpha1.OutboxRelay) (status, message string) {
	t.Helper()
	script, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "argocd", "health.lua"))
	require.NoError(t, err)
	relay = relay.DeepCopy()
	relay.APIVersion, relay.Kind = outboxv1alpha1.GroupVersion.String(), "OutboxRelay"
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(relay)
	require.NoError(t, err)

	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable}} {
		require.NoError(t, l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), Protect: true}, lua.LString(lib.name)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", luaValue(l, obj))
	fn, err := l.LoadString(string(script))
	require.NoError(t, err)
	l.Push(fn)
	require.NoError(t, l.PCall(0, lua.MultRet, nil))
	hs, ok := l.Get(-1).(*lua.LTable)
	require.True(t, ok, "health.lua returns a table")
	status, message = lua.LVAsString(hs.RawGetString("status")), lua.LVAsString(hs.RawGetString("message"))
	require.Contains(t, []string{"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}, status)
	require.NotEmpty(t, message)
	return status, message
}

// luaValue converts a JSON value as Argo CD does.
func luaValue(l *lua.LState, v any) lua.LValue {
	switch v := v.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case int:
		return lua.LNumber(v)
	case int32:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []any:
		t := l.CreateTable(len(v), 0)
		for _, item := range v {
			t.Append(luaValue(l, item))
		}
		return t
	case map[string]any:
		t := l.CreateTable(0, len(v))
		for k, item := range v {
			t.RawSetH(lua.LString(k), luaValue(l, item))
		}
		return t
	}
	return lua.LNil
}

// requireHealth checks the Argo CD health of an OutboxRelay the reconciler
// produced, and returns its message. With -argocd-testdata the object and
// its verdict are kept for config/argocd/testdata.
func requireHealth(t testing.TB, relay *outboxv1alpha1.OutboxRelay, want string) string {
	t.Helper()
	got, msg := argoHealth(t, relay)
	require.Equal(t, want, got, "Argo CD health of %s: %s\nconditions: %+v", relay.Name, msg, relay.Status.Conditions)
	if *writeArgoTestdata {
		keepArgoCase(t, relay, got, msg)
	}
	return msg
}

var writeArgoTestdata = flag.Bool("argocd-testdata", false,
	"write the OutboxRelays the Argo CD health checks saw to config/argocd/testdata, with health_test.yaml")

// argoCase is one object the health check judged, in the layout of Argo
// CD's own health tests (health_test.yaml beside health.lua).
type argoCase struct {
	HealthStatus struct {
		Status  string `json:"status"`
		Message string `json:"message"`
	} `json:"healthStatus"`
	InputPath string `json:"inputPath"`
	object    []byte
}

var (
	argoMu    sync.Mutex
	argoCases = map[string]argoCase{}
)

func keepArgoCase(t testing.TB, relay *outboxv1alpha1.OutboxRelay, status, message string) {
	relay = relay.DeepCopy()
	relay.APIVersion, relay.Kind = outboxv1alpha1.GroupVersion.String(), "OutboxRelay"
	relay.ManagedFields = nil
	b, err := yaml.Marshal(relay)
	require.NoError(t, err)
	base := strings.ToLower(status) + "-" + strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	argoMu.Lock()
	defer argoMu.Unlock()
	name := base + ".yaml"
	for i := 2; argoCases[name].InputPath != ""; i++ {
		name = fmt.Sprintf("%s-%d.yaml", base, i)
	}
	c := argoCase{InputPath: "testdata/" + name, object: b}
	c.HealthStatus.Status, c.HealthStatus.Message = status, message
	argoCases[name] = c
}

// saveArgoTestdata replaces config/argocd/testdata and health_test.yaml
// with the cases kept in this run.
func saveArgoTestdata() error {
	dir := filepath.Join(testenv.RepoRoot(), "config", "argocd")
	if err := os.RemoveAll(filepath.Join(dir, "testdata")); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "testdata"), 0o755); err != nil {
		return err
	}
	var tests struct {
		Tests []argoCase `json:"tests"`
	}
	for _, name := range slices.Sorted(maps.Keys(argoCases)) {
		c := argoCases[name]
		if err := os.WriteFile(filepath.Join(dir, c.InputPath), c.object, 0o644); err != nil {
			return err
		}
		tests.Tests = append(tests.Tests, c)
	}
	b, err := yaml.Marshal(tests)
	if err != nil {
		return err
	}
	header := "# OutboxRelays the reconciler produced in envtest, and their Argo CD health:\n" +
		"# go test ./controllers -run 'TestController|TestFlow' -argocd-testdata\n"
	return os.WriteFile(filepath.Join(dir, "health_test.yaml"), append([]byte(header), b...), 0o644)
}

// TestArgoCDHealthTestdata runs health.lua over every recorded object: the
// verdicts still hold, and every state has an object.
func TestArgoCDHealthTestdata(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(testenv.RepoRoot(), "config", "argocd")
	b, err := os.ReadFile(filepath.Join(dir, "health_test.yaml"))
	require.NoError(t, err)
	var tests struct {
		Tests []argoCase `json:"tests"`
	}
	require.NoError(t, yaml.Unmarshal(b, &tests))
	seen := map[string]bool{}
	for _, c := range tests.Tests {
		raw, err := os.ReadFile(filepath.Join(dir, c.InputPath))
		require.NoError(t, err)
		relay := &outboxv1alpha1.OutboxRelay{}
		require.NoError(t, yaml.UnmarshalStrict(raw, relay), c.InputPath)
		status, message := argoHealth(t, relay)
		require.Equal(t, c.HealthStatus.Status, status, c.InputPath)
		require.Equal(t, c.HealthStatus.Message, message, c.InputPath)
		seen[status] = true
	}
	for _, want := range []string{"Healthy", "Progressing", "Degraded", "Suspended"} {
		require.True(t, seen[want], "no recorded OutboxRelay is %s", want)
	}
}
