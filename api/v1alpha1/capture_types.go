package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// CaptureMode is how the relay learns of new rows.
// +kubebuilder:validation:Enum=Poll;LogicalReplication
type CaptureMode string

const (
	// CapturePoll claims unpublished rows in id order.
	CapturePoll CaptureMode = "Poll"
	// CaptureLogicalReplication streams the table's inserts from a
	// logical replication slot and publishes them in commit order.
	CaptureLogicalReplication CaptureMode = "LogicalReplication"
)

// DefaultMaxRetainedWAL is spec.capture.maxRetainedWAL's default.
const DefaultMaxRetainedWAL = "4Gi"

// CaptureSpec says how the relay learns of new rows. With
// LogicalReplication one relay pod streams the table's inserts from a
// replication slot (pgoutput) and publishes them in commit order within
// milliseconds, with no LISTEN/NOTIFY cost to the writers; the other pods
// wait as standbys and take over within seconds. The table stays the
// source of truth: what the stream cannot deliver is published by
// polling. It needs wal_level = logical and a role with REPLICATION.
// +kubebuilder:validation:XValidation:rule="!has(self.writerDeletes) || !self.writerDeletes || self.mode == 'LogicalReplication'",message="spec.capture.writerDeletes needs spec.capture.mode LogicalReplication: a polling relay never sees rows deleted in the transaction that inserts them"
type CaptureSpec struct {
	// Mode is Poll (the default) or LogicalReplication.
	// +kubebuilder:default=Poll
	// +optional
	Mode CaptureMode `json:"mode,omitempty"`

	// MaxRetainedWAL is the most WAL the slot may hold back (while Kafka
	// is down, say) before the relay drops it and polls, so PostgreSQL's
	// disk never fills for the relay's sake; 64Mi to 1Pi. Default: 4Gi.
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('64Mi')) >= 0",message="spec.capture.maxRetainedWAL must be at least 64Mi"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('1Pi')) <= 0",message="spec.capture.maxRetainedWAL must be at most 1Pi"
	// +optional
	MaxRetainedWAL *resource.Quantity `json:"maxRetainedWAL,omitempty"`

	// WriterDeletes says the writers delete each row in the transaction
	// that inserts it (outbox.WithDeleteOnStore), as Debezium's outbox
	// pattern does: the relay publishes the rows it decodes from the
	// stream, with no claim or mark, and puts back into the table only what
	// it cannot publish now. The slot is then the only copy of an event
	// until it is out, so the relay never gives it up (maxRetainedWAL only
	// warns). LogicalReplication only. Default: false.
	// +optional
	WriterDeletes bool `json:"writerDeletes,omitempty"`
}

// SlotStatus is a replication slot as the operator last read it from
// pg_replication_slots.
type SlotStatus struct {
	// Name of the slot.
	Name string `json:"name"`
	// Exists is false before a relay made the slot, or after it gave it up.
	Exists bool `json:"exists"`
	// Active: a relay pod streams from it now.
	Active bool `json:"active,omitempty"`
	// RetainedWAL is the WAL the slot holds back (pg_current_wal_lsn() -
	// restart_lsn), which PostgreSQL keeps on disk for it.
	// +optional
	RetainedWAL *resource.Quantity `json:"retainedWAL,omitempty"`
	// ConfirmedLag is the WAL not yet confirmed as published
	// (pg_current_wal_lsn() - confirmed_flush_lsn).
	// +optional
	ConfirmedLag *resource.Quantity `json:"confirmedLag,omitempty"`
	// InactiveSince is the first of the operator's readings in a row that
	// found the slot with no relay pod streaming from it; unset while one
	// streams. (Its readings since it started: a manager restart starts
	// it again.)
	// +optional
	InactiveSince *metav1.Time `json:"inactiveSince,omitempty"`
}
