package controllers

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/runtime"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/internal/testenv"
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
// produced, and returns its message.
func requireHealth(t testing.TB, relay *outboxv1alpha1.OutboxRelay, want string) string {
	t.Helper()
	got, msg := argoHealth(t, relay)
	require.Equal(t, want, got, "Argo CD health of %s: %s\nconditions: %+v", relay.Name, msg, relay.Status.Conditions)
	return msg
}
