package relay

import "github.com/prometheus/client_golang/prometheus"

// metrics are the relay's Prometheus collectors (docs/metrics.md).
type metrics struct {
	published     *prometheus.CounterVec
	publishErrors *prometheus.CounterVec
	batches       prometheus.Counter
	batchSize     prometheus.Histogram
	batchDuration prometheus.Histogram
	claimDuration prometheus.Histogram
	held          *prometheus.GaugeVec
	deadLettered  prometheus.Counter
	backlog       prometheus.Gauge
	oldestAge     prometheus.Gauge
	latency       prometheus.Histogram
	buckets       prometheus.Gauge
	blockedKeys   prometheus.Gauge
	stalled       *prometheus.GaugeVec
	pruned        prometheus.Counter
	pruneDuration prometheus.Histogram
	// headersSkipped counts row headers not forwarded because the relay
	// sets a header of that name itself.
	headersSkipped prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_events_published_total",
			Help: "Outbox rows published to Kafka and marked published, by topic.",
		}, []string{"topic"}),
		publishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_publish_errors_total",
			Help: "Rows whose publish failed, by reason (transient, permanent, topic_unavailable), and failed database calls (database).",
		}, []string{"reason"}),
		batches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_batches_total",
			Help: "Claim-publish-mark transactions that claimed at least one row.",
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_relay_batch_size_rows",
			Help:    "Rows claimed per batch.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		batchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_relay_batch_duration_seconds",
			Help:    "Duration of a claim-publish-mark transaction, from begin to commit.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		claimDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_relay_claim_duration_seconds",
			Help:    "Duration of the claim query.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_rows_held",
			Help: "Unpublished rows the relay holds back, by reason (unroutable: event type not in the topic map; invalid_row: a NULL in a column the relay reads; topic_unavailable: the topic is missing or not writable; too_large: larger than its topic and the dead-letter topic take; refused: refused by Kafka with no dead-letter topic).",
		}, []string{"reason"}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_dead_lettered_total",
			Help: "Rows published to the dead-letter topic after a permanent error.",
		}),
		backlog: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_backlog_rows",
			Help: "Unpublished rows in the table, counted up to a cap (100000).",
		}),
		oldestAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_oldest_unpublished_age_seconds",
			Help: "Age of the oldest unpublished row (0 when none).",
		}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_relay_commit_to_publish_seconds",
			Help:    "Time from a row's created_at to its acknowledgement by Kafka.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
		}),
		buckets: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_ordering_buckets_owned",
			Help: "Key-hash buckets (of 64) this replica publishes in partition-key ordering mode.",
		}),
		blockedKeys: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_ordering_blocked_keys",
			Help: "Partition keys held back in partition-key ordering mode because an earlier row of the key could not be published yet.",
		}),
		stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_stalled",
			Help: "1 while the relay is stalled for the reason (batch_failing, no_progress, rows_waiting, mode_conflict, loop_wedged), else 0. Any 1 fails /readyz; loop_wedged also fails /healthz.",
		}, []string{"reason"}),
	}
	m.pruned = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_pruned_rows_total",
		Help: "Published rows this replica deleted because they were older than --keep-published-for.",
	})
	m.pruneDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "outbox_relay_prune_duration_seconds",
		Help:    "Duration of one prune transaction (at most --prune-batch-size rows).",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
	})
	m.headersSkipped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_headers_skipped_total",
		Help: "Entries of rows' headers column not forwarded because the relay sets a header of that name itself (event_id, event_type, aggregate_type, aggregate_id, content-type, outbox_*, ce_*); counted each time a record is built.",
	})
	for _, r := range heldReasons {
		m.held.WithLabelValues(r)
	}
	for _, r := range stallReasons {
		m.stalled.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m.published, m.publishErrors, m.batches, m.batchSize, m.batchDuration,
			m.claimDuration, m.held, m.deadLettered, m.backlog, m.oldestAge, m.latency, m.buckets, m.blockedKeys, m.stalled, m.pruned, m.pruneDuration, m.headersSkipped)
	}
	return m
}
