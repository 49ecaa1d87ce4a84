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
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-operator/relay"
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

// runProfile drains a backlog with relay.New/Run in this process (the binary
// has no pprof endpoint) under the CPU profiler, at the batch size that
// drained fastest, and keeps the allocation profile of the drain alone.
func runProfile(ctx context.Context, o *options, e *benchEnv, rep *report) error {
	batch, best := 500, 0.0
	for _, b := range o.batches {
		if v, ok := rep.get("drain", fmt.Sprintf("ordering=none batch=%d", b), "events_per_s"); ok && v > best {
			batch, best = b, v
		}
	}
	if err := e.freshTable(ctx, o.rows); err != nil {
		return err
	}
	topic, err := e.newTopic(o, "profile")
	if err != nil {
		return err
	}
	defer e.deleteTopic(topic)
	reg := prometheus.NewRegistry()
	r, err := relay.New(relay.Config{DSN: e.dsn, Brokers: []string{e.kafka.Addr()}, Topics: map[string]string{eventType: topic},
		BatchSize: batch, Registerer: reg})
	if err != nil {
		return err
	}
	defer r.Close()
	if err := r.Check(ctx); err != nil {
		return err
	}
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
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	for published(reg) < float64(o.rows) {
		select {
		case err := <-done:
			cancel()
			pprof.StopCPUProfile()
			f.Close()
			return fmt.Errorf("relay stopped during the profiled drain: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	pprof.StopCPUProfile()
	f.Close()
	cancel()
	if err := <-done; err != nil {
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

func published(reg *prometheus.Registry) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == "outbox_relay_events_published_total" {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}
