package relay

import (
	"slices"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outbox-relay/outbox-operator/outbox"
)

// Headers of the CloudEvents format: the Kafka protocol binding's binary
// content mode (attributes as ce_<name> headers, the data's media type as
// content-type, the data as the value).
const (
	HeaderCESpecVersion = "ce_specversion"
	HeaderCEID          = "ce_id"
	HeaderCESource      = "ce_source"
	HeaderCEType        = "ce_type"
	HeaderCESubject     = "ce_subject"
	HeaderCETime        = "ce_time"
	HeaderContentType   = "content-type"
	// CloudEventsSpecVersion is the CloudEvents version the relay speaks.
	CloudEventsSpecVersion = "1.0"
	// CloudEventsContentType is the media type of the data: the payload is JSON.
	CloudEventsContentType = "application/json"
)

// rowHeaders reads a row's headers column: the entries the relay forwards,
// sorted by name, and how many it skipped because the relay sets a header of
// that name itself. An error (not an object of strings, over the limits)
// makes the row invalid.
func rowHeaders(raw []byte) ([]kafka.Header, int, error) {
	h, err := outbox.ParseHeaders(raw)
	if err != nil || len(h) == 0 {
		return nil, 0, err
	}
	out := make([]kafka.Header, 0, len(h))
	skipped := 0
	for k, v := range h {
		if outbox.IsReservedHeader(k) {
			skipped++
			continue
		}
		out = append(out, kafka.Header{Key: k, Value: []byte(v)})
	}
	slices.SortFunc(out, func(a, b kafka.Header) int { return strings.Compare(a.Key, b.Key) })
	return out, skipped, nil
}

// message builds a row's record for topic: key, value, the relay's headers,
// the format's headers, then the row's own (x.headers, after admit).
func (r *Relay) message(x row, topic string) kafka.Message {
	n := 4 + len(x.custom)
	if r.cfg.Format == FormatCloudEvents {
		n += 7
	}
	h := make([]kafka.Header, 0, n)
	h = append(h,
		kafka.Header{Key: HeaderEventID, Value: []byte(x.eventID)},
		kafka.Header{Key: HeaderEventType, Value: []byte(x.eventType)},
		kafka.Header{Key: HeaderAggregateType, Value: []byte(x.aggregateType)},
		kafka.Header{Key: HeaderAggregateID, Value: []byte(x.aggregateID)},
	)
	if r.cfg.Format == FormatCloudEvents {
		h = append(h,
			kafka.Header{Key: HeaderCESpecVersion, Value: []byte(CloudEventsSpecVersion)},
			kafka.Header{Key: HeaderCEID, Value: []byte(x.eventID)},
			kafka.Header{Key: HeaderCESource, Value: []byte(r.cfg.CloudEventsSource)},
			kafka.Header{Key: HeaderCEType, Value: []byte(x.eventType)},
		)
		if x.aggregateID != "" { // subject is optional but must not be empty
			h = append(h, kafka.Header{Key: HeaderCESubject, Value: []byte(x.aggregateID)})
		}
		h = append(h,
			kafka.Header{Key: HeaderCETime, Value: []byte(x.createdAt.UTC().Format(time.RFC3339Nano))},
			kafka.Header{Key: HeaderContentType, Value: []byte(CloudEventsContentType)},
		)
	}
	h = append(h, x.custom...)
	m := kafka.Message{Topic: topic, Key: []byte(x.partitionKey), Value: x.payload, Headers: h}
	if r.cfg.RecordTimestamp == RecordTimestampCreatedAt {
		m.Time = x.createdAt // zero (the writer's clock) takes the publish time
	}
	return m
}

// compression is kafka-go's codec for c.
func compression(c Compression) kafka.Compression {
	switch c {
	case "gzip":
		return kafka.Gzip
	case "snappy":
		return kafka.Snappy
	case "lz4":
		return kafka.Lz4
	case "zstd":
		return kafka.Zstd
	}
	return 0 // none
}
