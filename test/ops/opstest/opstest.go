// Package opstest holds what the chart, install-bundle and monitoring tests
// share: a manager process tied to a test, and a client of the test API
// server that knows the OutboxRelay types.
package opstest

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/devproc"
	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Ready waits until the manager p is ready and stops it when the test
// ends, printing its output if the test failed.
func Ready(t *testing.T, p *devproc.Proc) {
	t.Helper()
	t.Cleanup(func() {
		p.Stop(10 * time.Second)
		if t.Failed() {
			t.Logf("manager output:\n%s", p.Output())
		}
	})
	require.NoError(t, p.WaitReady(context.Background(), 60*time.Second))
}

// Admin is a client of the test API server with the built-in and OutboxRelay types.
func Admin(t *testing.T) client.Client {
	t.Helper()
	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, outboxv1alpha1.AddToScheme(scheme))
	c, err := client.New(testenv.Kube().Config, client.Options{Scheme: scheme})
	require.NoError(t, err)
	return c
}
