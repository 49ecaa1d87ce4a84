package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"
)

// Limits of an entry's headers. A header travels in every copy of its
// record and in every consumer's memory; these bounds keep one row's
// headers from crowding out its payload or the relay's batch budget.
const (
	// MaxHeaders is the most headers one entry carries.
	MaxHeaders = 64
	// MaxHeaderBytes is the most bytes of keys and values together.
	MaxHeaderBytes = 16 << 10
)

// reservedHeaders are header names the relay sets itself, in every format:
// its own, and the CloudEvents attributes it derives from the row. Other
// ce_* names (ce_subject, ce_dataschema, ce_datacontenttype, extensions)
// are the row's to set: in a CloudEvents format they become attributes.
var reservedHeaders = []string{"event_id", "event_type", "aggregate_type", "aggregate_id", "content-type",
	"ce_specversion", "ce_id", "ce_source", "ce_type", "ce_time"}

// reservedPrefixes start header names the relay sets itself: outbox_* on
// dead-lettered records.
var reservedPrefixes = []string{"outbox_"}

// IsReservedHeader reports whether name is one of the headers the relay sets
// itself (compared without regard to case, so that no consumer that folds
// case can be misled). An entry may not carry one; a row that does has it
// skipped by the relay.
func IsReservedHeader(name string) bool {
	n := strings.ToLower(name)
	for _, r := range reservedHeaders {
		if n == r {
			return true
		}
	}
	for _, p := range reservedPrefixes {
		if strings.HasPrefix(n, p) {
			return true
		}
	}
	return false
}

// CheckHeaders applies the shape rules both the writer and the relay
// enforce: at most MaxHeaders entries and MaxHeaderBytes of keys and values,
// non-empty keys, valid UTF-8. Reserved names are not its concern.
func CheckHeaders(h map[string]string) error {
	if len(h) > MaxHeaders {
		return fmt.Errorf("%d headers, at most %d", len(h), MaxHeaders)
	}
	n := 0
	for k, v := range h {
		if k == "" {
			return errors.New("a header has an empty name")
		}
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return fmt.Errorf("header %q is not valid UTF-8", k)
		}
		n += len(k) + len(v)
	}
	if n > MaxHeaderBytes {
		return fmt.Errorf("headers hold %d bytes, at most %d", n, MaxHeaderBytes)
	}
	return nil
}

// ParseHeaders reads the headers column as stored: NULL (nil) is no
// headers; anything else must be a JSON object of strings that passes
// CheckHeaders.
func ParseHeaders(raw []byte) (map[string]string, error) {
	if raw == nil {
		return nil, nil
	}
	var h map[string]string
	if err := json.Unmarshal(raw, &h); err != nil {
		return nil, fmt.Errorf("headers are not a JSON object of strings: %w", err)
	}
	if h == nil {
		return nil, errors.New("headers are JSON null, not an object")
	}
	if err := CheckHeaders(h); err != nil {
		return nil, err
	}
	return h, nil
}

// checkEntryHeaders is what Store refuses: CheckHeaders, and reserved names.
func checkEntryHeaders(h map[string]string) error {
	if err := CheckHeaders(h); err != nil {
		return err
	}
	var reserved []string
	for k := range h {
		if IsReservedHeader(k) {
			reserved = append(reserved, fmt.Sprintf("%q", k))
		}
	}
	if len(reserved) > 0 {
		slices.Sort(reserved)
		return fmt.Errorf("header names reserved for the relay: %s (event_id, event_type, aggregate_type, aggregate_id, content-type, outbox_*, ce_specversion, ce_id, ce_source, ce_type, ce_time)",
			strings.Join(reserved, ", "))
	}
	return nil
}
