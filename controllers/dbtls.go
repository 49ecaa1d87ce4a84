package controllers

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"

	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// dbTLS is what spec.database.tls gives the operator's own backlog reads:
// the CA bundle and, optionally, a client certificate and key (PEM). The
// relay pods get the same files mounted (children.go).
type dbTLS struct {
	ca, cert, key []byte
}

// errDatabaseCAInvalid: spec.database.tls.ca holds no PEM certificate.
var errDatabaseCAInvalid = errors.New("spec.database.tls.ca holds no PEM certificate")

// errDatabaseClientCertInvalid: the client certificate and key do not load.
var errDatabaseClientCertInvalid = errors.New("spec.database.tls.clientCertSecretRef holds no valid tls.crt and tls.key pair")

// config is a TLS client configuration verifying host's certificate
// against t's CA (verify-full).
func (t *dbTLS) config(host string) (*tls.Config, error) {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(t.ca) {
		return nil, errDatabaseCAInvalid
	}
	c := &tls.Config{RootCAs: roots, ServerName: host, MinVersion: tls.VersionTLS12}
	if len(t.cert) > 0 {
		pair, err := tls.X509KeyPair(t.cert, t.key)
		if err != nil {
			return nil, errDatabaseClientCertInvalid
		}
		c.Certificates = []tls.Certificate{pair}
	}
	return c, nil
}

// digest tells two materials apart without keeping them as map keys; "" for nil.
func (t *dbTLS) digest() string {
	if t == nil {
		return ""
	}
	h := sha256.New()
	for _, b := range [][]byte{t.ca, t.cert, t.key} {
		h.Write(b)
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// dbAuth is spec.database.auth as the backlog reads use it: the relay's
// method and the AWS region.
type dbAuth struct {
	method relayconfig.DatabaseAuth
	region string
}

// token says whether the method logs in with a token.
func (a dbAuth) token() bool {
	return a.method != "" && a.method != relayconfig.DatabaseAuthPassword
}
