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
	blockedKeys   *prometheus.GaugeVec
	setAside      prometheus.Gauge
	stalled       *prometheus.GaugeVec
	pruned        prometheus.Counter
	// prunedPartitions counts the partitions dropped by retention on a
	// partitioned table.
	prunedPartitions prometheus.Counter
	pruneDuration    prometheus.Histogram
	// pruneErrors counts the retention passes that failed.
	pruneErrors prometheus.Counter
	// partitionDropDelay is, per reason, how long the drop of an old
	// partition waiting for it is past its time (dropDelays).
	partitionDropDelay *prometheus.GaugeVec
	// restamped counts rows acknowledged with the publish time because
	// their topic takes no record with their created_at (restamp, tooOld).
	restamped prometheus.Counter
	// headersSkipped counts row headers not forwarded because the relay
	// sets a header of that name itself.
	headersSkipped prometheus.Counter
	// captureStreaming is 1 while this replica streams from the slot.
	captureStreaming prometheus.Gauge
	// captureWriterDeletes is 1 while this replica's stream lets the
	// writers delete (it marked the publication and holds the lock).
	captureWriterDeletes prometheus.Gauge
	// captureFallback is 1 while a logical-replication relay polls
	// because it cannot stream.
	captureFallback prometheus.Gauge
	// streamLeftBehind counts rows the stream stopped retrying in place
	// (Config.StreamRetryLimit): the sweep publishes them after later rows of
	// their keys.
	streamLeftBehind prometheus.Counter
	// slotRetainedWAL is the WAL the replication slot holds back.
	slotRetainedWAL prometheus.Gauge
	// slotMaxRetainedWAL is --max-retained-wal, for the alert's ratio.
	slotMaxRetainedWAL prometheus.Gauge
}

// metricSet builds the relay's collectors and registers each on reg (when
// there is one) as it is made, so a collector cannot be left unregistered.
type metricSet struct{ reg prometheus.Registerer }

func (f metricSet) add(c prometheus.Collector) {
	if f.reg != nil {
		f.reg.MustRegister(c)
	}
}

func (f metricSet) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	f.add(c)
	return c
}

func (f metricSet) counterVec(name, help, label string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{label})
	f.add(c)
	return c
}

func (f metricSet) gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	f.add(g)
	return g
}

// gaugeVec makes a gauge with one label, with a series for each of values
// from the start (so a 0 is visible before the first change).
func (f metricSet) gaugeVec(name, help, label string, values []string) *prometheus.GaugeVec {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, []string{label})
	for _, v := range values {
		g.WithLabelValues(v)
	}
	f.add(g)
	return g
}

// histogram makes a histogram of n exponential buckets from start, doubling.
func (f metricSet) histogram(name, help string, start float64, n int) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: prometheus.ExponentialBuckets(start, 2, n)})
	f.add(h)
	return h
}

func newMetrics(reg prometheus.Registerer) *metrics {
	f := metricSet{reg}
	return &metrics{
		published: f.counterVec("outbox_relay_events_published_total",
			"Outbox rows Kafka acknowledged (acks=all), by topic; a row published again (its batch's mark failed, a relay restarted) counts again.", "topic"),
		publishErrors: f.counterVec("outbox_relay_publish_errors_total",
			"Rows whose publish failed, by reason (transient, permanent, topic_unavailable), and failed database calls (database).", "reason"),
		batches: f.counter("outbox_relay_batches_total",
			"Claim-publish-mark transactions that claimed at least one row."),
		batchSize: f.histogram("outbox_relay_batch_size_rows", "Rows claimed per batch.", 1, 14),
		batchDuration: f.histogram("outbox_relay_batch_duration_seconds",
			"Duration of a claim-publish-mark transaction, from begin to commit.", 0.0005, 16),
		claimDuration: f.histogram("outbox_relay_claim_duration_seconds", "Duration of the claim query.", 0.0001, 16),
		held: f.gaugeVec("outbox_relay_rows_held",
			"Unpublished rows the relay holds back, by reason (unroutable: event type not in the topic map; invalid_row: a NULL in a column the relay reads, a created_at out of range, or malformed headers; topic_unavailable: the topic is missing or not writable; too_large: larger than its topic and the dead-letter topic take; refused: refused by Kafka for good, with no dead-letter topic, or one that refused the copy or is unavailable).",
			"reason", heldReasons),
		deadLettered: f.counter("outbox_relay_dead_lettered_total",
			"Rows published to the dead-letter topic after a permanent error."),
		backlog: f.gauge("outbox_relay_backlog_rows",
			"Unpublished rows in the table, counted up to a cap (100000)."),
		oldestAge: f.gauge("outbox_relay_oldest_unpublished_age_seconds",
			"Age of the oldest unpublished row (0 when none)."),
		latency: f.histogram("outbox_relay_commit_to_publish_seconds",
			"Time from a row's created_at to its acknowledgement by Kafka.", 0.001, 18),
		buckets: f.gauge("outbox_relay_ordering_buckets_owned",
			"Key-hash buckets (of 64) this replica publishes in partition-key ordering mode."),
		blockedKeys: f.gaugeVec("outbox_relay_ordering_blocked_keys",
			"Partition keys held back on a topic in partition-key ordering mode because an earlier row of the key on that topic could not be published yet, by topic (unmapped:<type> for an event type missing from the topic map).",
			"topic", nil),
		setAside: f.gauge("outbox_relay_rows_set_aside",
			"Rows this replica leaves out of its claims (polling with no ordering) because the Kafka partition they go to is set aside, its leader having not answered a write within --publish-timeout, or an older row of their key waits for it. They are claimed again once its backoff ends."),
		stalled: f.gaugeVec("outbox_relay_stalled",
			"1 while the relay is stalled for the reason (batch_failing, no_progress, rows_waiting, mode_conflict, loop_wedged), else 0. Any 1 fails /readyz; loop_wedged also fails /healthz.",
			"reason", stallReasons),
		pruned: f.counter("outbox_relay_pruned_rows_total",
			"Published rows this replica deleted because they were older than --keep-published-for (on a partitioned table: the rows of the partitions it dropped)."),
		prunedPartitions: f.counter("outbox_relay_pruned_partitions_total",
			"Partitions of a partitioned outbox this replica detached and dropped: their range ended more than --keep-published-for ago and all their rows were published."),
		pruneErrors: f.counter("outbox_relay_prune_errors_total",
			"Retention passes of this replica that failed (the log says why: a lock wait that ran out, a privilege missing, the database out of reach); the published rows or partitions they were to remove stay until a pass succeeds."),
		pruneDuration: f.histogram("outbox_relay_prune_duration_seconds",
			"Duration of one prune step: a transaction of at most --prune-batch-size rows, or on a partitioned table the detach and drop of one partition.", 0.0005, 16),
		partitionDropDelay: f.gaugeVec("outbox_relay_partition_drop_delay_seconds",
			"How long ago the drop of the old partition waiting longest became due (its range ended more than --keep-published-for ago), by what it waits for: transactions (a transaction that may have begun before its range ended is still open, idle in transaction, say, or prepared), slot (the table's replication slot has not confirmed past them), unpublished (a row of it is not published yet, held, say) or failing (a step of its drop failed; the log says which); default_partition when the table has a DEFAULT partition, so no partition is dropped. 0 when no drop waits. Set by each replica at its own retention passes (take the max across pods).",
			"reason", dropWaitReasons),
		captureStreaming: f.gauge("outbox_relay_capture_streaming",
			"1 while this replica streams the table's inserts from the replication slot (--capture logical-replication); the other replicas wait as standbys."),
		captureWriterDeletes: f.gauge("outbox_relay_capture_writer_deletes",
			"1 while this replica streams with --writer-deletes and lets the writers delete their rows: it marked the slot's publication and holds the writer-deletes lock. 0 on every pod while such a relay streams means its role may not mark the publication (it does not own it), so the writers keep their rows and the relay claims them from the table."),
		captureFallback: f.gauge("outbox_relay_capture_fallback",
			"1 while this logical-replication replica polls because it cannot stream (the slot was lost or given up, or streaming failed)."),
		restamped: f.counter("outbox_relay_records_restamped_total",
			"Rows that went out stamped with the publish time because their topic takes no record with their created_at (older than message.timestamp.before.max.ms, or refused with INVALID_TIMESTAMP)."),
		streamLeftBehind: f.counter("outbox_relay_capture_rows_left_behind_total",
			"Rows that failed for longer than the stream retries them in place (a minute) and were left in the table for the sweep, which publishes them after later rows of their keys: each a break of commit order."),
		slotRetainedWAL: f.gauge("outbox_relay_slot_retained_wal_bytes",
			"WAL the replication slot holds back (pg_current_wal_lsn() - restart_lsn), read by the streaming replica every 5 s (0 on a standby, on a replica whose stream has failed for 30 s, and once the slot is dropped; the operator reads it whoever streams); beyond --max-retained-wal the relay drops the slot and polls."),
		slotMaxRetainedWAL: f.gauge("outbox_relay_slot_max_retained_wal_bytes",
			"--max-retained-wal of a logical-replication relay: the retained WAL at which it drops the slot and polls."),
		headersSkipped: f.counter("outbox_relay_headers_skipped_total",
			"Entries of rows' headers column not forwarded because the relay sets a header of that name itself (event_id, event_type, aggregate_type, aggregate_id, content-type, outbox_*, ce_specversion, ce_id, ce_source, ce_type, ce_time); counted each time a record is built."),
	}
}
