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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// argoHealth runs health.lua (argoDir) over an OutboxRelay as Argo CD
// runs a resource health check: the object as the global obj (JSON numbers
// as Lua numbers, lists as 1-based tables), only the base, table and
// package libraries open, and a one-second deadline. It returns hs.status
// and hs.message.
func argoHealth(t testing.TB, relay *outboxv1alpha1.OutboxRelay) (status, message string) {
	t.Helper()
	script, err := os.ReadFile(filepath.Join(argoDir(), "health.lua"))
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

// argoDir holds the Argo CD customizations of OutboxRelay, in the layout of
// Argo CD's own resource_customizations folder.
func argoDir() string {
	return filepath.Join(testenv.RepoRoot(), "config", "argocd", "resource_customizations", "outbox.dev", "OutboxRelay")
}

// luaState is a Lua state as Argo CD gives a customization: the base, table,
// string and package libraries, and an os module whose date is fixed
// (restart stamps the time), with a one-second deadline.
func luaState(t testing.TB) *lua.LState {
	t.Helper()
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable}, {lua.StringLibName, lua.OpenString}} {
		require.NoError(t, l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), Protect: true}, lua.LString(lib.name)))
	}
	l.PreloadModule("os", func(l *lua.LState) int {
		mod := l.NewTable()
		mod.RawSetString("date", l.NewFunction(func(l *lua.LState) int { l.Push(lua.LString(argoFixedTime)); return 1 }))
		l.Push(mod)
		return 1
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	t.Cleanup(cancel)
	l.SetContext(ctx)
	return l
}

// argoFixedTime is what os.date returns in luaState.
const argoFixedTime = "0001-01-01T00:00:00Z"

// runLua runs script with obj as the global obj and returns what it returns.
func runLua(t testing.TB, script string, obj map[string]any) lua.LValue {
	t.Helper()
	l := luaState(t)
	t.Cleanup(l.Close)
	l.SetGlobal("obj", luaValue(l, obj))
	fn, err := l.LoadString(script)
	require.NoError(t, err)
	l.Push(fn)
	require.NoError(t, l.PCall(0, 1, nil))
	return l.Get(-1)
}

// goValue converts a Lua value back to JSON's, as Argo CD does with an
// action's result: a table with keys 1..n is a list, any other a map.
func goValue(v lua.LValue) any {
	switch v := v.(type) {
	case lua.LBool:
		return bool(v)
	case lua.LNumber:
		return float64(v)
	case lua.LString:
		return string(v)
	case *lua.LTable:
		if n := v.MaxN(); n > 0 {
			list := make([]any, 0, n)
			for i := 1; i <= n; i++ {
				list = append(list, goValue(v.RawGetInt(i)))
			}
			return list
		}
		m := map[string]any{}
		v.ForEach(func(k, val lua.LValue) { m[k.String()] = goValue(val) })
		return m
	}
	return nil
}

// TestArgoCDActions runs action_test.yaml as Argo CD runs its own: each
// discovery test lists the actions and whether they are disabled, each
// action test turns the input object into the expected one.
func TestArgoCDActions(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(argoDir(), "actions")
	b, err := os.ReadFile(filepath.Join(dir, "action_test.yaml"))
	require.NoError(t, err)
	var tests struct {
		DiscoveryTests []struct {
			InputPath string `json:"inputPath"`
			Result    []struct {
				Name     string `json:"name"`
				Disabled bool   `json:"disabled"`
			} `json:"result"`
		} `json:"discoveryTests"`
		ActionTests []struct {
			Action, InputPath, ExpectedOutputPath string
		} `json:"actionTests"`
	}
	require.NoError(t, yaml.UnmarshalStrict(b, &tests))
	read := func(p string) map[string]any {
		raw, err := os.ReadFile(filepath.Join(dir, p))
		require.NoError(t, err)
		relay := &outboxv1alpha1.OutboxRelay{}
		require.NoError(t, yaml.UnmarshalStrict(raw, relay), "%s is an OutboxRelay", p)
		m := map[string]any{}
		require.NoError(t, yaml.Unmarshal(raw, &m))
		return m
	}
	discovery, err := os.ReadFile(filepath.Join(dir, "action_discovery.lua"))
	require.NoError(t, err)
	actions := map[string]bool{}
	for _, tc := range tests.DiscoveryTests {
		got, ok := goValue(runLua(t, string(discovery), read(tc.InputPath))).(map[string]any)
		require.True(t, ok, "action_discovery.lua returns a table of actions")
		require.Len(t, got, len(tc.Result), tc.InputPath)
		for _, want := range tc.Result {
			a, ok := got[want.Name].(map[string]any)
			require.True(t, ok, "%s: action %s", tc.InputPath, want.Name)
			require.Equal(t, want.Disabled, a["disabled"], "%s: %s disabled", tc.InputPath, want.Name)
			actions[want.Name] = true
		}
	}
	tested := map[string]bool{}
	for _, tc := range tests.ActionTests {
		script, err := os.ReadFile(filepath.Join(dir, tc.Action, "action.lua"))
		require.NoError(t, err)
		got := goValue(runLua(t, string(script), read(tc.InputPath)))
		require.Equal(t, read(tc.ExpectedOutputPath), got, "%s on %s", tc.Action, tc.InputPath)
		tested[tc.Action] = true
	}
	require.Equal(t, actions, tested, "every discovered action has a test")
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
// its verdict are kept for config/argocd/resource_customizations/outbox.dev/OutboxRelay/testdata.
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
	"write the OutboxRelays the Argo CD health checks saw to config/argocd/resource_customizations/outbox.dev/OutboxRelay/testdata, with health_test.yaml")

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

// saveArgoTestdata replaces config/argocd/resource_customizations/outbox.dev/OutboxRelay/testdata and health_test.yaml
// with the cases kept in this run.
func saveArgoTestdata() error {
	dir := argoDir()
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
	dir := argoDir()
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

// A suspended relay whose pods still run (stopping, or a Deployment the
// operator could not scale down) is not Suspended yet: the conditions say
// what is going on. Before, Argo CD showed Suspended from spec alone.
func TestArgoCDHealthSuspendedOnceNoPodRuns(t *testing.T) {
	t.Parallel()
	relay := &outboxv1alpha1.OutboxRelay{}
	relay.Generation = 2
	relay.Spec.Suspend = true
	relay.Status.ObservedGeneration = 2
	relay.Status.Replicas = 2
	relay.Status.Conditions = []metav1.Condition{{Type: outboxv1alpha1.ConditionReconciling, Status: metav1.ConditionTrue,
		Reason: "ScalingDown", Message: "2 replicas run, 0 desired"}}
	status, msg := argoHealth(t, relay)
	require.Equal(t, "Progressing", status, msg)
	relay.Status.Replicas = 0
	status, _ = argoHealth(t, relay)
	require.Equal(t, "Suspended", status)
}
