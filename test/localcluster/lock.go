package localcluster

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"
)

// machineLock is the file whose lock a running stack holds: the node's
// bridge, address and name are the machine's, so two stacks (a demo and
// the end-to-end test, say) cannot run at once; the second waits.
const machineLock = "/run/outbox-localcluster.lock"

// lockMachine takes the machine lock, waiting while another stack holds it,
// and returns its release.
func lockMachine(ctx context.Context, progress func(string)) (func() error, error) {
	f, err := os.OpenFile(machineLock, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("local cluster lock: %w", err)
	}
	said := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if err != syscall.EWOULDBLOCK {
			f.Close()
			return nil, fmt.Errorf("local cluster lock %s: %w", machineLock, err)
		}
		if !said {
			progress("waiting for another local cluster on this machine to stop (" + machineLock + ")")
			said = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("another local cluster holds %s: %w", machineLock, ctx.Err())
		case <-time.After(time.Second):
		}
	}
	return f.Close, nil // closing the file releases the lock
}

// tryLockMachine takes the machine lock if no stack holds it; ok is false
// when one does.
func tryLockMachine() (release func() error, ok bool) {
	f, err := os.OpenFile(machineLock, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, false
	}
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		f.Close()
		return nil, false
	}
	return f.Close, true
}
