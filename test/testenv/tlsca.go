package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"
)

// CA is a certificate authority made for a test.
type CA struct {
	// PEM is the CA's certificate.
	PEM    []byte
	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
	serial atomic.Int64
}

// NewCA makes a CA named name, valid for a day.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{PEM: pemBlock("CERTIFICATE", der), cert: cert, key: key}
	ca.serial.Store(1)
	return ca, nil
}

// Issue signs a certificate for the IP addresses and DNS names in hosts
// (server and client use), and returns it and its key in PEM.
func (ca *CA) Issue(commonName string, hosts ...string) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.serial.Add(1)), Subject: pkix.Name{CommonName: commonName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pemBlock("CERTIFICATE", der), pemBlock("EC PRIVATE KEY", keyDER), nil
}

// IssuePKCS8 is Issue with the key in PKCS #8 ("PRIVATE KEY"), the form
// Java's PEM key stores read.
func (ca *CA) IssuePKCS8(commonName string, hosts ...string) (certPEM, keyPEM []byte, err error) {
	certPEM, ecPEM, err := ca.Issue(commonName, hosts...)
	if err != nil {
		return nil, nil, err
	}
	block, _ := pem.Decode(ecPEM)
	key, err := x509.ParseECPrivateKey(block.Bytes)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return certPEM, pemBlock("PRIVATE KEY", der), nil
}

// EnableTLS turns TLS on for the cluster with the server certificate and
// key (PEM), and reloads it: clients may then connect with TLS (those
// asking for sslmode=disable still connect in plain text). The reload
// completes shortly after it returns.
func (c *PostgresCluster) EnableTLS(certPEM, keyPEM []byte) error {
	cert, key := filepath.Join(c.dataDir, "server.crt"), filepath.Join(c.dataDir, "server.key")
	for p, data := range map[string][]byte{cert: certPEM, key: keyPEM} {
		if err := os.WriteFile(p, data, 0o600); err != nil {
			return err
		}
		if c.asUser != nil {
			if err := chownTo(p, c.asUser); err != nil {
				return err
			}
		}
	}
	conf := fmt.Sprintf("\nssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\n", cert, key)
	if err := appendFile(filepath.Join(c.dataDir, "postgresql.conf"), conf); err != nil {
		return err
	}
	if out, err := c.command("pg_ctl", "reload", "-D", c.dataDir).CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl reload: %w\n%s", err, out)
	}
	return nil // the postmaster rereads its files on SIGHUP, asynchronously: callers retry their first TLS connection
}

// StartPostgresTLS starts a cluster under dir (StartPostgres) with TLS on,
// its certificate for 127.0.0.1 and localhost signed by a new CA, which it
// returns. The reload that turns TLS on completes shortly after it returns.
func StartPostgresTLS(dir string) (*PostgresCluster, *CA, error) {
	ca, err := NewCA("outbox-test-postgres-ca")
	if err != nil {
		return nil, nil, err
	}
	cert, key, err := ca.Issue("postgres", "127.0.0.1", "localhost")
	if err != nil {
		return nil, nil, err
	}
	pg, err := StartPostgres(dir)
	if err != nil {
		return nil, nil, err
	}
	if err := pg.EnableTLS(cert, key); err != nil {
		return nil, nil, errors.Join(err, pg.Close())
	}
	return pg, ca, nil
}

func chownTo(p string, u *user.User) error {
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return os.Chown(p, uid, gid)
}

// RequirePassword makes role log in over TCP with a password (SCRAM) and
// only over TLS: its plain-text connections are rejected. The reload
// completes shortly after it returns.
func (c *PostgresCluster) RequirePassword(role string) error {
	p := filepath.Join(c.dataDir, "pg_hba.conf")
	hba, err := os.ReadFile(p)
	if err != nil {
		return err
	}
	rules := fmt.Sprintf("hostssl all %[1]s all scram-sha-256\nhost all %[1]s all reject\n", role)
	if err := os.WriteFile(p, append([]byte(rules), hba...), 0o600); err != nil {
		return err
	}
	if out, err := c.command("pg_ctl", "reload", "-D", c.dataDir).CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl reload: %w\n%s", err, out)
	}
	return nil
}
