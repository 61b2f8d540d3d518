package leasehold_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"log/slog"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/internal/testenv"
)

// Mutual TLS (issue 39, docs/security.md "Client certificates"): the client
// authenticates with a client certificate alone (WithTLSConfig,
// TLSConfigFromFiles) to a lease server started with --tls-cert,
// --tls-key, --tls-client-ca and --identity-map. The certificates are made
// at test time with crypto/x509; no private key is checked in.

const certAccount = "acme"

func spiffeID(workload string) string { return "spiffe://test.example/ns/acme/sa/" + workload }

// testCA signs the certificates of one test, written as PEM files in dir.
type testCA struct {
	t    *testing.T
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	file string
}

type certFiles struct{ cert, key string }

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "go-client-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(30 * 24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{t: t, dir: t.TempDir(), cert: cert, key: key}
	ca.file = filepath.Join(ca.dir, "ca.pem")
	writePEM(t, ca.file, "CERTIFICATE", der)
	return ca
}

type leafOptions struct {
	spiffeID            string
	ip                  net.IP
	server              bool
	notBefore, notAfter time.Time
}

// leaf is a certificate signed by the CA, for client authentication unless
// o.server, valid from o.notBefore to o.notAfter (default: an hour ago to
// a day from now).
func (ca *testCA) leaf(name string, o leafOptions) certFiles {
	t := ca.t
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    o.notBefore,
		NotAfter:     o.notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if tmpl.NotBefore.IsZero() {
		tmpl.NotBefore = time.Now().Add(-time.Hour)
	}
	if tmpl.NotAfter.IsZero() {
		tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	}
	if o.server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	if o.spiffeID != "" {
		u, err := url.Parse(o.spiffeID)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = []*url.URL{u}
	}
	if o.ip != nil {
		tmpl.IPAddresses = []net.IP{o.ip}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	files := certFiles{filepath.Join(ca.dir, name+".pem"), filepath.Join(ca.dir, name+"-key.pem")}
	writePEM(t, files.cert, "CERTIFICATE", der)
	writePEM(t, files.key, "PRIVATE KEY", keyDER)
	return files
}

func writePEM(t *testing.T, file, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// install replaces the files at to with those of from by rename, as
// rotation tools do (never a half-written file): the key first.
func install(t *testing.T, from, to certFiles) {
	t.Helper()
	for _, p := range [][2]string{{from.key, to.key}, {from.cert, to.cert}} {
		b, err := os.ReadFile(p[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p[1]+".tmp", b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(p[1]+".tmp", p[1]); err != nil {
			t.Fatal(err)
		}
	}
}

// mtlsServer is a lease server that authenticates clients by certificate:
// .../sa/ops is account acme with the admin scope, anything under
// .../ns/acme/ account acme.
func mtlsServer(t *testing.T, ca *testCA) *testenv.Server {
	t.Helper()
	server := ca.leaf("server", leafOptions{ip: net.IPv4(127, 0, 0, 1), server: true})
	identities := filepath.Join(ca.dir, "identities.yaml")
	err := os.WriteFile(identities, []byte("identities:\n"+
		"  - spiffe_id: "+spiffeID("ops")+"\n"+
		"    account: "+certAccount+"\n"+
		"    scopes: [leasehold:admin]\n"+
		"  - spiffe_id_prefix: spiffe://test.example/ns/acme/\n"+
		"    account: "+certAccount+"\n"), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	return testenv.StartServer(t, "--tls-cert", server.cert, "--tls-key", server.key,
		"--tls-client-ca", ca.file, "--identity-map", identities)
}

// certClient is a client with no token, authenticated by the certificate
// in files, closed at cleanup.
func certClient(t *testing.T, addr string, ca *testCA, files certFiles, opts ...leasehold.Option) *leasehold.Client {
	t.Helper()
	cfg, err := leasehold.TLSConfigFromFiles(ca.file, files.cert, files.key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := leasehold.Dial(context.Background(), []string{addr}, append([]leasehold.Option{leasehold.WithTLSConfig(cfg)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func certKey(t *testing.T) leasehold.SessionKey {
	k := freshKey(t)
	k.AccountID = certAccount
	return k
}

// sleepPastFirstTTL returns once the lease's first TTL has passed on the
// database clock, which only renewals on the KeepAlive stream survive.
func sleepPastFirstTTL(t *testing.T, key leasehold.SessionKey) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.Get().LeaseDB)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT pg_sleep_until(acquired_at + ttl + interval '50 milliseconds')
		FROM leases WHERE account_id = $1 AND session_id = $2`, key.AccountID, key.SessionID); err != nil {
		t.Fatal(err)
	}
}

func refusalCause(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetMetadata()["cause"]
		}
	}
	return ""
}

func TestTLSConfigFromFilesNamesWhatIsWrong(t *testing.T) {
	ca := newTestCA(t)
	worker := ca.leaf("worker", leafOptions{spiffeID: spiffeID("worker")})
	other := ca.leaf("other", leafOptions{spiffeID: spiffeID("other")})
	if _, err := leasehold.TLSConfigFromFiles(ca.file, worker.cert, ""); err == nil || !strings.Contains(err.Error(), "needs its key") {
		t.Errorf("certificate without key: %v", err)
	}
	if _, err := leasehold.TLSConfigFromFiles(ca.file, worker.cert, other.key); err == nil || !strings.Contains(err.Error(), "private key does not match public key") {
		t.Errorf("another certificate's key: %v", err)
	}
	if _, err := leasehold.TLSConfigFromFiles(worker.key, worker.cert, worker.key); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("a key as the CA bundle: %v", err)
	}
}

func TestClientCertificateHoldsALease(t *testing.T) {
	ca := newTestCA(t)
	s := mtlsServer(t, ca)
	c := certClient(t, s.Addr, ca, ca.leaf("worker", leafOptions{spiffeID: spiffeID("worker")}))
	key := certKey(t)
	l, err := c.Hold(context.Background(), key, leasehold.HoldOptions{TTL: 600 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sleepPastFirstTTL(t, key)
	if err := l.Err(); err != nil {
		t.Fatalf("lease lost past its first TTL: %v", err)
	}
	got, err := c.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if got.GetRunId() != l.RunID() {
		t.Fatalf("Get: run %q holds, want %q", got.GetRunId(), l.RunID())
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestClientCertificateRefused(t *testing.T) {
	ca := newTestCA(t)
	s := mtlsServer(t, ca)
	ctx := context.Background()
	t.Run("a certificate the identity map does not name is PERMISSION_DENIED", func(t *testing.T) {
		c := certClient(t, s.Addr, ca, ca.leaf("stranger", leafOptions{spiffeID: "spiffe://elsewhere.example/x"}))
		_, err := c.Acquire(ctx, certKey(t), leasehold.AcquireOptions{TTL: 5 * time.Second})
		if !errors.Is(err, leasehold.ErrPermissionDenied) || !strings.Contains(err.Error(), "not in the server's identity map") {
			t.Fatalf("Acquire = %v, want ErrPermissionDenied naming the identity map", err)
		}
	})
	t.Run("an expired certificate is UNAUTHENTICATED certificate_expired", func(t *testing.T) {
		c := certClient(t, s.Addr, ca, ca.leaf("expired", leafOptions{
			spiffeID:  spiffeID("worker"),
			notBefore: time.Now().Add(-30 * 24 * time.Hour),
			notAfter:  time.Now().Add(-24 * time.Hour),
		}))
		_, err := c.Acquire(ctx, certKey(t), leasehold.AcquireOptions{TTL: 5 * time.Second})
		if !errors.Is(err, leasehold.ErrUnauthenticated) || refusalCause(err) != "certificate_expired" {
			t.Fatalf("Acquire = %v (cause %q), want ErrUnauthenticated with cause certificate_expired", err, refusalCause(err))
		}
	})
}

// records keeps the messages of a client's log.
type records struct {
	mu   sync.Mutex
	msgs []string
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *records) WithGroup(string) slog.Handler            { return r }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, rec.Message)
	return nil
}

func (r *records) count(prefix string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, m := range r.msgs {
		if strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}

// TestRotatedCertificateFilesAreUsedForNewConnections: the files are
// replaced while the client holds a lease. The KeepAlive stream keeps its
// connection until the old certificate expires; the server then ends it,
// and the client reopens it with the files read again: the lease goes on.
// The unary connection, refused from then on, is made again and the call
// sent again on it, with the new certificate (the admin scope that tells
// the two apart).
func TestRotatedCertificateFilesAreUsedForNewConnections(t *testing.T) {
	ca := newTestCA(t)
	s := mtlsServer(t, ca)
	// The first certificate expires soon: time for the client to open its
	// stream with it, on a loaded machine.
	short := ca.leaf("short", leafOptions{spiffeID: spiffeID("worker"), notAfter: time.Now().Add(6 * time.Second)})
	next := ca.leaf("ops", leafOptions{spiffeID: spiffeID("ops")})
	live := certFiles{filepath.Join(ca.dir, "live.pem"), filepath.Join(ca.dir, "live-key.pem")}
	install(t, short, live)
	log := &records{}
	c := certClient(t, s.Addr, ca, live, leasehold.WithLogger(slog.New(log)))
	ctx := context.Background()
	key := certKey(t)
	l, err := c.Hold(ctx, key, leasehold.HoldOptions{TTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Revoke(ctx, certKey(t), "needs the admin scope"); !errors.Is(err, leasehold.ErrPermissionDenied) {
		t.Fatalf("Revoke with the first certificate = %v, want ErrPermissionDenied", err)
	}
	// A renewal answered: the KeepAlive stream's connection was made with
	// the first certificate, before the rotation.
	granted := l.Lease().GetExpiresAt().AsTime()
	testenv.WaitFor(t, 10*time.Second, "renewal on the first stream", func() bool {
		return l.Lease().GetExpiresAt().AsTime().After(granted)
	})
	install(t, next, live)
	const reopening = "leasehold: keepalive stream reopening"
	testenv.WaitFor(t, 30*time.Second, "KeepAlive stream ended at the old certificate's expiry and reopened", func() bool {
		return log.count(reopening) > 0
	})
	renewedFrom := l.Lease().GetExpiresAt().AsTime()
	testenv.WaitFor(t, 10*time.Second, "renewal on the reopened stream", func() bool {
		return l.Lease().GetExpiresAt().AsTime().After(renewedFrom)
	})
	if err := l.Err(); err != nil {
		t.Fatalf("lease lost across the rotation: %v", err)
	}
	// The unary connection made with the first certificate, expired now.
	if _, err := c.Revoke(ctx, certKey(t), "the new certificate"); err != nil {
		t.Fatalf("Revoke after the first certificate expired: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
}
