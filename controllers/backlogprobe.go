package controllers

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/outbox"
)

// DefaultBacklogInterval is how often the operator reads an OutboxRelay's
// backlog when spec.backlog.interval is not set.
const DefaultBacklogInterval = outboxv1alpha1.DefaultBacklogInterval

// BacklogProbe reads an outbox table's backlog with an OutboxRelay
// observer's session settings, statement and bound, so that what one read
// costs the database can be measured (test/bench). An observer reads more
// beside it, which the probe leaves out: the held table's join, once that
// table exists, and its replication slot's row in pg_replication_slots.
type BacklogProbe struct {
	pool  *pgxpool.Pool
	table outbox.Table
}

// NewBacklogProbe opens the observer's one-connection pool on dsn.
func NewBacklogProbe(ctx context.Context, dsn string, table outbox.Table) (*BacklogProbe, error) {
	pool, err := newBacklogPool(ctx, flowTarget{dsn: dsn, table: table, interval: outboxv1alpha1.DefaultBacklogInterval})
	if err != nil {
		return nil, err
	}
	return &BacklogProbe{pool: pool, table: table}, nil
}

// Read reads the backlog once and returns the number of unpublished rows
// read (at most outboxv1alpha1.BacklogBound).
func (p *BacklogProbe) Read(ctx context.Context) (int64, error) {
	s, err := observeBacklog(ctx, p.pool, backlogQuery{table: p.table}, outboxv1alpha1.BacklogBound)
	return s.read, err
}

// Close closes the pool.
func (p *BacklogProbe) Close() { p.pool.Close() }
