package version

import (
	"reflect"
	"strings"
	"testing"
)

// LDFlag names the variable by its real import path, so a stamped build
// changes Version (a renamed package or variable fails here).
func TestLDFlagNamesVersion(t *testing.T) {
	t.Parallel()
	type marker struct{}
	path := reflect.TypeOf(marker{}).PkgPath()
	want := "-X " + path + ".Version=v9.9.9"
	if got := LDFlag("v9.9.9"); got != want {
		t.Fatalf("LDFlag = %q, want %q", got, want)
	}
	if s := String("relay"); !strings.HasPrefix(s, "relay "+Version+" (go") {
		t.Fatalf("String = %q", s)
	}
}
