package controllers

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
)

// A relay whose backlog stops being read by choice (a token login while
// token logins are off) has its status.backlog cleared, and its backlog
// gauges go with it: a last reading does not stand in them for good. Its
// other gauges stay. Before, the backlog gauges kept their last values.
func TestBacklogGaugesGoWithTheBacklog(t *testing.T) {
	t.Parallel()
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	relay := unitRelay()
	relay.Spec.Capture = &outboxv1alpha1.CaptureSpec{Mode: outboxv1alpha1.CaptureLogicalReplication}
	relay.Status.Backlog = &outboxv1alpha1.BacklogStatus{Pending: 7, OldestAge: metav1.Duration{Duration: time.Minute},
		Held:       outboxv1alpha1.HeldRows{TooLarge: 2},
		Slot:       &outboxv1alpha1.SlotStatus{Name: "outbox", Exists: true, RetainedWAL: ptr.To(resource.MustParse("1Mi"))},
		ObservedAt: metav1.Now()}
	key := types.NamespacedName{Namespace: relay.Namespace, Name: relay.Name}
	backlogGauges := map[string]*prometheus.GaugeVec{"backlog": m.backlog, "oldestAge": m.oldestAge, "held": m.held,
		"slotRetained": m.slotRetained, "slotMaxRetained": m.slotMaxRetained}

	m.set(key, relay)
	for name, v := range backlogGauges {
		require.Positive(t, testutil.CollectAndCount(v), name)
	}
	require.Equal(t, 7.0, testutil.ToFloat64(m.backlog.WithLabelValues(key.Namespace, key.Name)))

	relay.Status = computeStatus(relay, nil, nil, observation{notRead: tokenLoginsOff})
	require.Nil(t, relay.Status.Backlog)
	m.set(key, relay)
	for name, v := range backlogGauges {
		require.Zero(t, testutil.CollectAndCount(v), "%s outlived status.backlog", name)
	}
	for name, v := range map[string]*prometheus.GaugeVec{"desired": m.desired, "ready": m.ready, "lagging": m.lagging} {
		require.Equal(t, 1, testutil.CollectAndCount(v), name)
	}
}
