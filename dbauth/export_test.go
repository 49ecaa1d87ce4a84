package dbauth

import "time"

// SetGCPTokenRequestTimeout sets the token request timeout until the
// returned func restores it.
func SetGCPTokenRequestTimeout(d time.Duration) (restore func()) {
	old := gcpTokenRequestTimeout
	gcpTokenRequestTimeout = d
	return func() { gcpTokenRequestTimeout = old }
}
