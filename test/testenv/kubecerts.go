package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// The file names envtest's API server reads from its certificate folder.
const (
	apiServerCertFile = "apiserver.crt"
	apiServerKeyFile  = "apiserver.key"
	saSignerCertFile  = "sa-signer.crt"
	saSignerKeyFile   = "sa-signer.key"
	// ServingCAFile is the CA of the API server's serving certificate.
	ServingCAFile = "serving-ca.crt"
)

// writeServingCerts writes a CA, the API server's serving certificate for
// the given addresses and names, and a service-account signing key into
// dir, and returns the CA in PEM. envtest generates these itself, but only
// for loopback; pods reach the API server at the kubernetes Service's
// ClusterIP and the node's address, which must both be in the certificate.
func writeServingCerts(dir string, ips []net.IP, names []string) ([]byte, error) {
	caDER, der, key, err := servingPair("outbox-local-cluster-ca", "kube-apiserver", ips, names)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	saTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(3),
		Subject:      pkix.Name{CommonName: "service-accounts"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	saDER, err := x509.CreateCertificate(rand.Reader, saTmpl, saTmpl, &saKey.PublicKey, saKey)
	if err != nil {
		return nil, err
	}
	caPEM := pemBlock("CERTIFICATE", caDER)
	files := map[string][]byte{
		ServingCAFile:     caPEM,
		apiServerCertFile: pemBlock("CERTIFICATE", der),
		saSignerCertFile:  pemBlock("CERTIFICATE", saDER),
	}
	for name, k := range map[string]*ecdsa.PrivateKey{apiServerKeyFile: key, saSignerKeyFile: saKey} {
		b, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			return nil, err
		}
		files[name] = pemBlock("EC PRIVATE KEY", b)
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return nil, err
		}
	}
	return caPEM, nil
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

// servingPair makes a CA and a serving certificate it signs for ips and
// names, valid for a week: the CA's and the certificate's DER, and the
// certificate's key.
func servingPair(caName, name string, ips []net.IP, names []string) (caDER, der []byte, key *ecdsa.PrivateKey, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: caName},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	if caDER, err = x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey); err != nil {
		return nil, nil, nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, nil, nil, err
	}
	if key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
		return nil, nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  ips,
		DNSNames:     names,
	}
	if der, err = x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey); err != nil {
		return nil, nil, nil, err
	}
	return caDER, der, key, nil
}

// WriteTLSPair writes tls.crt and tls.key (as a kubernetes.io/tls Secret
// holds them) of a serving certificate for ips into dir, and returns the
// PEM of the CA that signed it.
func WriteTLSPair(dir string, ips []net.IP) ([]byte, error) {
	caDER, der, key, err := servingPair("outbox-test-ca", "outbox-test", ips, nil)
	if err != nil {
		return nil, err
	}
	b, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "tls.crt"), pemBlock("CERTIFICATE", der), 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "tls.key"), pemBlock("EC PRIVATE KEY", b), 0o600); err != nil {
		return nil, err
	}
	return pemBlock("CERTIFICATE", caDER), nil
}
