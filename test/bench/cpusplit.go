package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// cpuSplit divides the CPUs the benchmark may use between the database
// side (the PostgreSQL server and the benchmark process, whose goroutines
// are the writers) and the rest (the relay and the Kafka broker), as a
// deployment does when the relay and the broker run on machines of their
// own. With the split, what the writers lose beside a relay is what the
// relay costs the database server (its claims, marks and walsender), not
// the CPU the relay and the broker take from a machine all of them share.
type cpuSplit struct {
	all, db, rest unix.CPUSet
}

// newCPUSplit gives the first CPU this process may use to the database
// side and the others to the rest; ok is false with fewer than two.
func newCPUSplit() (s cpuSplit, ok bool, err error) {
	if err := unix.SchedGetaffinity(0, &s.all); err != nil {
		return s, false, fmt.Errorf("read the benchmark's CPU affinity: %w", err)
	}
	if s.all.Count() < 2 {
		return s, false, nil
	}
	first := true
	for cpu := range len(s.all) * 64 { // a CPUSet holds 64 CPUs per element
		if !s.all.IsSet(cpu) {
			continue
		}
		if first {
			s.db.Set(cpu)
			first = false
		} else {
			s.rest.Set(cpu)
		}
	}
	return s, true, nil
}

// describe says how the split divides the CPUs, for the report.
func (s cpuSplit) describe() string {
	return fmt.Sprintf("database server and writers on %d CPU, relay and Kafka broker on %d", s.db.Count(), s.rest.Count())
}

// pinProcess sets the CPUs of every thread of process pid (the threads it
// starts later take them from the thread that starts them).
func pinProcess(pid int, set *unix.CPUSet) error {
	tasks, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "task"))
	if err != nil {
		return fmt.Errorf("list the threads of process %d: %w", pid, err)
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		// A thread may end while the list is read: only the process's
		// own first thread must take the setting.
		if err := unix.SchedSetaffinity(tid, set); err != nil && tid == pid {
			return fmt.Errorf("set the CPUs of process %d: %w", pid, err)
		}
	}
	return nil
}

// pinDatabaseSide sets the CPUs of the database server (its postmaster,
// whose new backends take them, and every process it runs now) and of
// the benchmark process.
func (e *benchEnv) pinDatabaseSide(ctx context.Context, set *unix.CPUSet) error {
	if _, err := e.serverCPUSeconds(ctx); err != nil { // finds the postmaster
		return err
	}
	for _, pid := range []int{e.postmaster, os.Getpid()} {
		if err := pinProcess(pid, set); err != nil {
			return err
		}
	}
	// A backend that ends while the list is read is not an error.
	return e.serverProcs(func(pid int, _ procStat) { _ = pinProcess(pid, set) })
}

// split applies s: the database side on s.db, the Kafka broker on
// s.rest, and every relay startRelay starts from now on on s.rest.
func (e *benchEnv) split(ctx context.Context, s cpuSplit) error {
	if err := e.pinDatabaseSide(ctx, &s.db); err != nil {
		return err
	}
	if err := pinProcess(e.kafka.Pid(), &s.rest); err != nil {
		return err
	}
	e.relayCPUs = &s.rest
	return nil
}

// unsplit gives every process of the benchmark all of s's CPUs again.
func (e *benchEnv) unsplit(ctx context.Context, s cpuSplit) error {
	e.relayCPUs = nil
	if err := e.pinDatabaseSide(ctx, &s.all); err != nil {
		return err
	}
	return pinProcess(e.kafka.Pid(), &s.all)
}
