package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/relay"
	"github.com/outbox-relay/outbox-operator/relayconfig"
	"github.com/outbox-relay/outbox-operator/test/outboxtest"
)

// profileSummary is the relay's CPU and allocation profile at its best batch size.
type profileSummary struct {
	Batch      int     `json:"batch"`
	Rows       int     `json:"rows"`
	EventsPerS float64 `json:"events_per_s"`
	CPUFile    string  `json:"cpu_file"`
	AllocFile  string  `json:"alloc_file"`
	CPUTop     string  `json:"cpu_top"`
	AllocTop   string  `json:"alloc_top"`
}

// runProfile drains a backlog with an in-process relay (the binary has no
// pprof endpoint) under the CPU profiler, at the batch size that drained
// fastest, and keeps the allocation profile of the drain alone (with the
// relay's start-up checks, a few queries).
func runProfile(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	batch, best := 500, 0.0
	for _, b := range o.batches {
		if v, ok := rep.get(scDrain, fmt.Sprintf("ordering=none batch=%d", b), "events_per_s"); ok && v > best {
			batch, best = b, v
		}
	}
	if err := e.freshTable(ctx, o.rows); err != nil {
		return err
	}
	topic, err := e.newTopic(o, scProfile)
	if err != nil {
		return err
	}
	defer e.deleteTopic(topic)
	if err := os.MkdirAll(o.profileDir, 0o755); err != nil {
		return err
	}
	cpuFile := filepath.Join(o.profileDir, fmt.Sprintf("relay-cpu-batch%d.pprof", batch))
	allocFile := filepath.Join(o.profileDir, fmt.Sprintf("relay-allocs-batch%d.pprof", batch))
	baseFile := filepath.Join(e.work, "allocs-base.pprof")
	if err := writeProfile("allocs", baseFile); err != nil {
		return err
	}
	f, err := os.Create(cpuFile)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		return err
	}
	_, err = inProcessDrain(ctx, e, topic, batch, o.rows, nil)
	pprof.StopCPUProfile()
	if err != nil {
		return err
	}
	if err := writeProfile("allocs", allocFile); err != nil {
		return err
	}
	_, rate, err := e.drainSpan(ctx)
	if err != nil {
		return err
	}
	cpuTop, err := pprofTop("-top", "-cum", "-nodecount=30", cpuFile)
	if err != nil {
		return err
	}
	allocTop, err := pprofTop("-top", "-sample_index=alloc_space", "-nodecount=20", "-base", baseFile, allocFile)
	if err != nil {
		return err
	}
	logf("profile at batch %d: %.0f events/s; %s, %s", batch, rate, cpuFile, allocFile)
	rep.Profile = &profileSummary{Batch: batch, Rows: o.rows, EventsPerS: rate, CPUFile: cpuFile, AllocFile: allocFile, CPUTop: cpuTop, AllocTop: allocTop}
	return nil
}

// inProcessDrain runs a relay in this process on the benchmark table until
// it has published rows events, then stops it, and returns the relay's
// metrics; w, when not nil, is its Kafka writer.
func inProcessDrain(ctx context.Context, e *benchEnv, topic string, batch, rows int, w relay.MessageWriter) (*prometheus.Registry, error) {
	x, err := outboxtest.RunRelay(relay.Config{
		Settings: relay.Settings{DSN: e.dsn, Brokers: []string{e.kafka.Addr()}, Topics: map[string]string{eventType: topic}, BatchSize: batch},
	}, w)
	if err != nil {
		return nil, err
	}
	defer x.Close()
	if err := x.WaitPublished(ctx, rows); err != nil {
		return nil, err
	}
	return x.Reg, x.Close()
}

func writeProfile(name, path string) error {
	runtime.GC()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return pprof.Lookup(name).WriteTo(f, 0)
}

// pprofTop runs `go tool pprof` and keeps its table without the header noise.
func pprofTop(args ...string) (string, error) {
	out, err := exec.Command("go", append([]string{"tool", "pprof"}, args...)...).Output()
	if err != nil {
		return "", fmt.Errorf("go tool pprof %s: %w", strings.Join(args, " "), err)
	}
	var keep []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "File:") || strings.HasPrefix(l, "Build ID:") || strings.HasPrefix(l, "Type:") || strings.HasPrefix(l, "Time:") {
			continue
		}
		keep = append(keep, l)
	}
	return strings.TrimLeft(strings.Join(keep, "\n"), "\n"), nil
}

// timedWriter measures the time the relay spends in WriteMessages.
type timedWriter struct {
	w     *kafka.Writer
	calls atomic.Int64
	nanos atomic.Int64
}

func (t *timedWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	start := time.Now()
	err := t.w.WriteMessages(ctx, msgs...)
	t.nanos.Add(int64(time.Since(start)))
	t.calls.Add(1)
	return err
}

// runBreakdown splits one batch's wall time into claim, publish and the
// rest (mark and commit) for each batch size: an in-process relay with a
// Writer configured as relay.New configures its own, wrapped in a timer.
func runBreakdown(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	for _, batch := range o.batches {
		reps, err := repeat(&options{reps: 1}, func(int) (map[string]float64, error) {
			if err := e.freshTable(ctx, o.rows); err != nil {
				return nil, err
			}
			topic, err := e.newTopic(o, fmt.Sprintf("breakdown-%d", batch))
			if err != nil {
				return nil, err
			}
			defer e.deleteTopic(topic)
			tw := &timedWriter{w: &kafka.Writer{
				Addr: kafka.TCP(e.kafka.Addr()), Balancer: &kafka.Murmur2Balancer{}, RequiredAcks: kafka.RequireAll,
				BatchTimeout: time.Microsecond, BatchSize: batch, BatchBytes: 1 << 20, MaxAttempts: 3,
				WriteBackoffMin: 50 * time.Millisecond, WriteBackoffMax: 500 * time.Millisecond,
				ReadTimeout: relayconfig.DefaultPublishTimeout, WriteTimeout: relayconfig.DefaultPublishTimeout,
				Transport: &kafka.Transport{},
			}}
			defer tw.w.Close()
			reg, err := inProcessDrain(ctx, e, topic, batch, o.rows, tw)
			if err != nil {
				return nil, err
			}
			_, rate, err := e.drainSpan(ctx)
			if err != nil {
				return nil, err
			}
			bn, bs, err := outboxtest.ReadMetric(reg, "outbox_relay_batch_duration_seconds")
			if err != nil {
				return nil, err
			}
			cn, cs, err := outboxtest.ReadMetric(reg, "outbox_relay_claim_duration_seconds")
			if err != nil {
				return nil, err
			}
			batchMS, claimMS := 1000*bs/bn, 1000*cs/cn
			publishMS := float64(tw.nanos.Load()) / 1e6 / float64(tw.calls.Load())
			logf("breakdown batch=%d: %.0f events/s; per batch %.2f ms = claim %.2f + publish %.2f + mark/commit %.2f",
				batch, rate, batchMS, claimMS, publishMS, batchMS-claimMS-publishMS)
			return map[string]float64{"events_per_s": rate, "batch_ms": batchMS, "claim_ms": claimMS, "publish_ms": publishMS,
				"mark_commit_ms": batchMS - claimMS - publishMS}, nil
		})
		if err != nil {
			return err
		}
		rep.add(scBreakdown, fmt.Sprintf("batch=%d", batch), map[string]any{"batch": batch}, reps)
	}
	return nil
}
