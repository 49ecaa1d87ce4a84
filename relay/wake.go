package relay

import (
	"context"
	"time"
)

// listen keeps a session LISTENing on the table's notify channel (with
// --notify) and wakes the loop on every notification, coalesced: one
// pending wake-up at most. Notifications sent while the session is down are
// lost, so the loop keeps polling; this only makes it early.
func (r *Relay) listen(ctx context.Context) {
	channel := r.table.NotifyChannel()
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := func() error {
			conn, err := r.connect(ctx)
			if err != nil {
				return err
			}
			defer conn.Close(context.WithoutCancel(ctx))
			if _, err := conn.Exec(ctx, sqlListen(channel)); err != nil {
				return err
			}
			backoff = 100 * time.Millisecond
			r.wakeUp() // anything written while no one listened
			for {
				if _, err := conn.WaitForNotification(ctx); err != nil {
					return err
				}
				r.wakeUp()
			}
		}()
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("notify session lost; polling meanwhile", "channel", channel, "err", err, "backoff", backoff)
		sleep(ctx, jitter(backoff))
		backoff = min(2*backoff, r.cfg.MaxBackoff)
	}
}

func (r *Relay) wakeUp() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// pause sleeps d, or less when a notification wakes the loop.
func (r *Relay) pause(ctx context.Context, d time.Duration) {
	r.health.idleUntil(time.Now().Add(d))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-r.wake:
	}
}
