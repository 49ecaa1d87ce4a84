package relay

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"mime"
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
	// CloudEventsStructuredContentType is the record's content-type in the
	// structured content mode: the value is the whole event as JSON.
	CloudEventsStructuredContentType = "application/cloudevents+json"
)

// ceAttributes takes the row's ce_* headers out of headers as CloudEvents
// attributes (subject, dataschema, datacontenttype and extensions) and
// checks them (outbox.CloudEventsAttribute, the rule Store refuses them
// by); the attributes the relay derives from the row are reserved
// (outbox.IsReservedHeader) and never reach here. An error names the
// attribute and makes the row invalid: sent without it, the event would
// not be what its writer meant.
func ceAttributes(headers []kafka.Header) (map[string]string, []kafka.Header, error) {
	var attrs map[string]string
	rest := headers[:0:0]
	for _, h := range headers {
		v := string(h.Value)
		name, ok, err := outbox.CloudEventsAttribute(h.Key, v)
		if !ok {
			rest = append(rest, h)
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		if attrs == nil {
			attrs = map[string]string{}
		}
		attrs[name] = v
	}
	return attrs, rest, nil
}

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
	n := 4 + len(x.custom) + len(x.ceAttrs)
	if r.cfg.Format != FormatRaw {
		n += 7
	}
	h := make([]kafka.Header, 0, n)
	h = append(h,
		kafka.Header{Key: HeaderEventID, Value: []byte(x.eventID)},
		kafka.Header{Key: HeaderEventType, Value: []byte(x.eventType)},
		kafka.Header{Key: HeaderAggregateType, Value: []byte(x.aggregateType)},
		kafka.Header{Key: HeaderAggregateID, Value: []byte(x.aggregateID)},
	)
	value := x.payload
	switch r.cfg.Format {
	case FormatCloudEvents:
		attrs := r.ceEvent(x)
		for _, name := range []string{"specversion", "id", "source", "type", "subject", "time"} {
			if v, ok := attrs[name]; ok {
				h = append(h, kafka.Header{Key: "ce_" + name, Value: []byte(v)})
			}
		}
		for _, name := range slices.Sorted(maps.Keys(attrs)) {
			if !slices.Contains([]string{"specversion", "id", "source", "type", "subject", "time", "datacontenttype"}, name) {
				h = append(h, kafka.Header{Key: "ce_" + name, Value: []byte(attrs[name])})
			}
		}
		h = append(h, kafka.Header{Key: HeaderContentType, Value: []byte(attrs["datacontenttype"])})
	case FormatCloudEventsStructured:
		value = structuredEvent(r.ceEvent(x), x.payload)
		h = append(h, kafka.Header{Key: HeaderContentType, Value: []byte(CloudEventsStructuredContentType)})
	}
	h = append(h, x.custom...)
	m := kafka.Message{Topic: topic, Key: []byte(x.partitionKey), Value: value, Headers: h}
	if r.cfg.RecordTimestamp == RecordTimestampCreatedAt {
		m.Time = x.createdAt // zero (the writer's clock) takes the publish time
		if r.topics.tooOld(topic, x.createdAt, time.Now()) {
			m.Time = time.Time{} // the topic would refuse it (restamp)
		}
	}
	if x.partition != nil {
		m.WriterData = explicitPartition(*x.partition) // explicitBalancer sends it there
	}
	return m
}

// ceEvent is x's CloudEvents attributes: those the relay derives from the
// row, and those the row's ce_* headers set (which may replace subject and
// datacontenttype, and add dataschema and extensions).
func (r *Relay) ceEvent(x row) map[string]string {
	attrs := map[string]string{
		"specversion": CloudEventsSpecVersion, "id": x.eventID, "source": r.cfg.CloudEventsSource, "type": x.eventType,
		"time": x.createdAt.UTC().Format(time.RFC3339Nano), "datacontenttype": CloudEventsContentType,
	}
	if x.aggregateID != "" { // subject is optional but must not be empty
		attrs["subject"] = x.aggregateID
	}
	maps.Copy(attrs, x.ceAttrs)
	return attrs
}

// structuredEvent is the event in the structured content mode's JSON:
// its attributes as members, and the payload as data when it is JSON of a
// JSON media type, else as data_base64.
func structuredEvent(attrs map[string]string, payload []byte) []byte {
	ev := make(map[string]any, len(attrs)+1)
	for k, v := range attrs {
		ev[k] = v
	}
	ct := attrs["datacontenttype"]
	mediaType, _, _ := mime.ParseMediaType(ct)
	if (mediaType == "application/json" || strings.HasSuffix(mediaType, "+json")) && json.Valid(payload) {
		ev["data"] = json.RawMessage(payload)
	} else {
		ev["data_base64"] = base64.StdEncoding.EncodeToString(payload)
	}
	b, err := json.Marshal(ev)
	if err != nil { // strings and valid JSON always marshal
		panic(fmt.Sprintf("structured CloudEvent: %v", err))
	}
	return b
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
