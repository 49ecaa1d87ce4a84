package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"mime"
	"net/url"
	"regexp"
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

// ceAttributeRE is a CloudEvents attribute name: lower-case letters and
// digits, at most 20 (the specification's advice for portability).
var ceAttributeRE = regexp.MustCompile(`^[a-z0-9]{1,20}$`)

// CloudEventsAttribute reports whether header key is a CloudEvents
// attribute (ce_ in any case), and for one its name and whether value is
// valid for it: a relay with a CloudEvents format publishes the row's
// ce_* headers as attributes and holds a row with an invalid one, so Store
// refuses it whatever the format (a relay's format can change after the
// row is written). The attributes a relay derives from the row are
// reserved (IsReservedHeader).
func CloudEventsAttribute(key, value string) (name string, ok bool, err error) {
	if len(key) < 3 || !strings.EqualFold(key[:3], "ce_") {
		return "", false, nil
	}
	name = key[3:] // attribute names are lower-case: ce_TenantID is refused, not folded
	switch {
	case !ceAttributeRE.MatchString(name):
		err = errors.New("names are 1 to 20 lower-case letters and digits")
	case name == "data" || name == "data_base64":
		err = errors.New("the data is the payload")
	case name == "subject" && value == "":
		err = errors.New("must not be empty")
	case name == "dataschema":
		if u, perr := url.Parse(value); perr != nil || !u.IsAbs() {
			err = fmt.Errorf("%q is not an absolute URI", value)
		}
	case name == "datacontenttype":
		if _, _, perr := mime.ParseMediaType(value); perr != nil {
			err = fmt.Errorf("%q is not a media type", value)
		}
	}
	if err != nil {
		return name, true, fmt.Errorf("CloudEvents attribute %s: %w", key, err)
	}
	return name, true, nil
}

// checkEntryHeaders is what Store refuses: CheckHeaders, a NUL byte, reserved names,
// and CloudEvents attributes a relay would hold the row for. Past CheckHeaders
// (which reports its first problem alone), it reports every problem of the
// entry, each header in sorted order, so a caller mends them in one pass.
func checkEntryHeaders(h map[string]string) error {
	if err := CheckHeaders(h); err != nil {
		return err
	}
	var errs []error
	var reserved []string
	for _, k := range slices.Sorted(maps.Keys(h)) {
		if strings.IndexByte(k, 0) >= 0 || strings.IndexByte(h[k], 0) >= 0 {
			errs = append(errs, fmt.Errorf("header %q holds a NUL byte, which the headers column (jsonb) refuses", k))
		}
		if IsReservedHeader(k) {
			reserved = append(reserved, fmt.Sprintf("%q", k))
			continue
		}
		if _, _, err := CloudEventsAttribute(k, h[k]); err != nil {
			errs = append(errs, err)
		}
	}
	if len(reserved) > 0 {
		errs = append(errs, fmt.Errorf("header names reserved for the relay: %s (event_id, event_type, aggregate_type, aggregate_id, content-type, outbox_*, ce_specversion, ce_id, ce_source, ce_type, ce_time)",
			strings.Join(reserved, ", ")))
	}
	return errors.Join(errs...)
}
