package caddymodule_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue signs a certificate for 127.0.0.1 usable by a server or a client; it returns it and its PEM
// certificate and key.
func (ca *testCA) issue(t *testing.T, name string, usage x509.ExtKeyUsage) (tls.Certificate, []byte, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return pair, certPEM, keyPEM
}

func writeFile(t *testing.T, dir, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// newTLSWorker is a testWorker served over TLS with cert, requiring a client certificate signed by
// clientCA.
func newTLSWorker(t *testing.T, name string, tokenUsage float64, waiting int, cert tls.Certificate, clientCA *testCA) *testWorker {
	t.Helper()
	w := &testWorker{name: name, release: make(chan struct{})}
	w.setLoad(tokenUsage, waiting)
	w.srv = httptest.NewUnstartedServer(http.HandlerFunc(w.serve))
	pool := x509.NewCertPool()
	pool.AddCert(clientCA.cert)
	w.srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool}
	w.srv.StartTLS()
	t.Cleanup(w.stop)
	return w
}

func tlsAddr(w *testWorker) string { return w.srv.Listener.Addr().String() }

// Load polls use the reverse proxy transport's TLS settings: its trust pool and its client certificate
// (mutual TLS). A worker whose certificate does not verify shows the handshake error in the admin view
// and the log, naming the worker, and the API key appears in neither.
func TestLoadPollsUseTransportTLS(t *testing.T) {
	const apiKey = "s3cret-api-key-value"
	dir := t.TempDir()
	ca, rogue := newTestCA(t, "workers"), newTestCA(t, "rogue")
	serverCert, _, _ := ca.issue(t, "worker", x509.ExtKeyUsageServerAuth)
	rogueCert, _, _ := rogue.issue(t, "impostor", x509.ExtKeyUsageServerAuth)
	_, clientPEM, clientKey := ca.issue(t, "caddy", x509.ExtKeyUsageClientAuth)
	caFile := writeFile(t, dir, "ca.pem", ca.pem)
	certFile, keyFile := writeFile(t, dir, "client.pem", clientPEM), writeFile(t, dir, "client-key.pem", clientKey) // caddytest rewrites paths ending .key and .crt

	busy := newTLSWorker(t, "busy", 0.9, 20, serverCert, ca)
	idle := newTLSWorker(t, "idle", 0.1, 0, serverCert, ca)
	impostor := newTLSWorker(t, "impostor", 0.0, 0, rogueCert, ca)
	logFile := filepath.Join(dir, "caddy.log")
	cfg := fmt.Sprintf(`{
	admin localhost:2999
	http_port 9080
	skip_install_trust
	sglang_load {
		interval 200ms
		timeout 2s
		stale_after 10s
	}
}
http://127.0.0.1:9080 {
	reverse_proxy https://%s https://%s https://%s {
		transport http {
			tls_trust_pool file %s
			tls_client_auth %s %s
		}
		lb_policy sglang_load {
			choose least
			api_key %s
		}
		lb_try_duration 2s
	}
}
`, tlsAddr(busy), tlsAddr(idle), tlsAddr(impostor), caFile, certFile, keyFile, apiKey)
	tester := caddytest.NewTester(t)
	tester.InitServer(withDebugLog(cfg, logFile), "caddyfile")

	var view map[string]worker
	eventually(t, 10*time.Second, func() bool {
		view = workers(t)
		return polledOK(view[tlsAddr(busy)]) && polledOK(view[tlsAddr(idle)]) && strings.Contains(view[tlsAddr(impostor)].LastError, "certificate")
	}, "the TLS workers polled and the impostor's poll failed")
	if v := view[tlsAddr(idle)]; v.Endpoint != "https://"+tlsAddr(idle) {
		t.Errorf("endpoint %q, want https://%s", v.Endpoint, tlsAddr(idle))
	}
	bad := view[tlsAddr(impostor)]
	if !strings.Contains(bad.LastError, "certificate") || !strings.Contains(bad.LastError, tlsAddr(impostor)) {
		t.Errorf("impostor's last error %q: want the certificate failure naming %s", bad.LastError, tlsAddr(impostor))
	}
	if bad.State == "fresh" || bad.PollsOK != 0 {
		t.Errorf("impostor: state %s, %d polls ok: a worker failing verification must have no report", bad.State, bad.PollsOK)
	}
	line := waitLog(t, logFile, "the handshake failure logged", `"endpoint":"https://`+tlsAddr(impostor), "certificate")
	if strings.Contains(line, apiKey) {
		t.Errorf("the log holds the API key")
	}
	if _, body := adminDo(t, http.MethodGet, "/sglang_load/workers"); strings.Contains(string(body), apiKey) {
		t.Errorf("the admin view holds the API key")
	}
	// Proxied requests go to the least loaded verified worker (the impostor fails verification in the
	// proxy's transport too, and has no report).
	if c := sendRequests(t, proxyURL, 30); c["idle"] != 30 {
		t.Errorf("requests: %v, want all 30 on idle", c)
	}
}
