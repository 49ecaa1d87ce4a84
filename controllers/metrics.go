package controllers

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// Metrics are the operator's gauges per OutboxRelay, labelled namespace and
// name, as its status reports them. They are deleted with the OutboxRelay,
// and while its reconciliation is paused.
type Metrics struct {
	backlog, oldestAge, desired, ready, lagging *prometheus.GaugeVec
	slotRetained, slotMaxRetained               *prometheus.GaugeVec
	held                                        *prometheus.GaugeVec
	secretReads                                 prometheus.Counter
}

// NewMetrics registers the operator's gauges with reg (cmd/manager passes
// controller-runtime's registry, which the manager serves on /metrics).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	labels := []string{"namespace", "name"}
	gauge := func(name, help string, extra ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, append(labels, extra...))
	}
	m := &Metrics{
		backlog: gauge("outbox_operator_backlog_rows",
			"Unpublished rows a relay can claim, as status.backlog.pending (exact up to 100000, an estimate above)."),
		oldestAge: gauge("outbox_operator_oldest_waiting_age_seconds",
			"Age of the oldest row a relay can claim, 0 when none."),
		held: gauge("outbox_operator_rows_held",
			"Unpublished rows among the 100000 oldest that no relay publishes as things stand, by reason (unroutable, invalid, too_large, refused, blocked), as status.backlog.held.", "reason"),
		desired: gauge("outbox_operator_desired_replicas",
			"Relay replicas the operator asks the Deployment for."),
		ready: gauge("outbox_operator_ready_replicas",
			"Ready relay replicas."),
		lagging: gauge("outbox_operator_lagging",
			"1 while the Lagging condition is True, 0 while False, -1 while Unknown."),
		slotRetained: gauge("outbox_operator_slot_retained_wal_bytes",
			"WAL the replication slot of a LogicalReplication OutboxRelay holds back, as status.backlog.slot.retainedWAL; for a Poll relay, only a slot left behind by logical replication."),
		slotMaxRetained: gauge("outbox_operator_slot_max_retained_wal_bytes",
			"spec.capture.maxRetainedWAL of a LogicalReplication OutboxRelay, beside outbox_operator_slot_retained_wal_bytes: a streaming relay gives its slot up past it, and none does while no relay pod runs."),
	}
	for _, v := range []**prometheus.GaugeVec{&m.backlog, &m.oldestAge, &m.held, &m.desired, &m.ready, &m.lagging, &m.slotRetained, &m.slotMaxRetained} {
		err := reg.Register(*v)
		var dup prometheus.AlreadyRegisteredError
		switch {
		case errors.As(err, &dup): // a second manager in one process (tests) shares them
			existing, ok := dup.ExistingCollector.(*prometheus.GaugeVec)
			if !ok {
				return nil, err
			}
			*v = existing
		case err != nil:
			return nil, err
		}
	}
	m.secretReads = prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_operator_secret_reads_total",
		Help: "Secrets the operator read from the API server (each referenced Secret once per --secret-refresh-interval, and on a change of the OutboxRelay or a failed login)."})
	if err := reg.Register(m.secretReads); err != nil {
		var dup prometheus.AlreadyRegisteredError
		if !errors.As(err, &dup) {
			return nil, err
		}
		m.secretReads = dup.ExistingCollector.(prometheus.Counter)
	}
	return m, nil
}

// secretRead counts one Secret read.
func (m *Metrics) secretRead() {
	if m != nil {
		m.secretReads.Inc()
	}
}

// set reports a relay's status.
func (m *Metrics) set(key types.NamespacedName, relay *outboxv1alpha1.OutboxRelay) {
	if m == nil {
		return
	}
	ns, name := key.Namespace, key.Name
	st := &relay.Status
	m.desired.WithLabelValues(ns, name).Set(float64(st.DesiredReplicas))
	m.ready.WithLabelValues(ns, name).Set(float64(st.ReadyReplicas))
	lag := -1.0
	if c := meta.FindStatusCondition(st.Conditions, outboxv1alpha1.ConditionLagging); c != nil {
		switch c.Status {
		case "True":
			lag = 1
		case "False":
			lag = 0
		}
	}
	m.lagging.WithLabelValues(ns, name).Set(lag)
	if b := st.Backlog; b != nil {
		m.backlog.WithLabelValues(ns, name).Set(float64(b.Pending))
		m.oldestAge.WithLabelValues(ns, name).Set(b.OldestAge.Seconds())
		m.held.WithLabelValues(ns, name, "unroutable").Set(float64(b.Held.Unroutable))
		m.held.WithLabelValues(ns, name, "invalid").Set(float64(b.Held.Invalid))
		m.held.WithLabelValues(ns, name, "too_large").Set(float64(b.Held.TooLarge))
		m.held.WithLabelValues(ns, name, "refused").Set(float64(b.Held.Refused))
		m.held.WithLabelValues(ns, name, "blocked").Set(float64(b.Held.Blocked))
		if s := b.Slot; s != nil && s.RetainedWAL != nil {
			m.slotRetained.WithLabelValues(ns, name).Set(float64(s.RetainedWAL.Value()))
			limit := int64(relayconfig.DefaultMaxRetainedWAL)
			if c := relay.Spec.Capture; c != nil && c.MaxRetainedWAL != nil {
				limit = c.MaxRetainedWAL.Value()
			}
			m.slotMaxRetained.WithLabelValues(ns, name).Set(float64(limit))
		} else {
			m.slotRetained.DeleteLabelValues(ns, name)
			m.slotMaxRetained.DeleteLabelValues(ns, name)
		}
	} else {
		// No backlog in status: none read yet, or cleared because the
		// backlog is no longer read (by choice); a last reading must not
		// stand in the gauges either. Looked up by their labels, as this
		// runs at every pass of such a relay; only the held rows' reasons
		// need a scan.
		for _, v := range []*prometheus.GaugeVec{m.backlog, m.oldestAge, m.slotRetained, m.slotMaxRetained} {
			v.DeleteLabelValues(ns, name)
		}
		drop(key, m.held)
	}
}

// delete drops every series of a relay.
func (m *Metrics) delete(key types.NamespacedName) {
	if m == nil {
		return
	}
	drop(key, m.backlog, m.oldestAge, m.held, m.desired, m.ready, m.lagging, m.slotRetained, m.slotMaxRetained)
}

// drop deletes a relay's series of each gauge, whatever their other labels
// (the held rows' reason).
func drop(key types.NamespacedName, gauges ...*prometheus.GaugeVec) {
	match := prometheus.Labels{"namespace": key.Namespace, "name": key.Name}
	for _, v := range gauges {
		v.DeletePartialMatch(match)
	}
}
