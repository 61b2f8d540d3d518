package leasehold

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// WithTLSConfig makes every connection of the client, the unary calls', the
// KeepAlive streams' and every retry's and failover's, use TLS with cfg
// (given to credentials.NewTLS), whatever the address's scheme. A client
// certificate in cfg (Certificates or GetClientCertificate) authenticates
// the client to a server started with --tls-client-ca and --identity-map
// (docs/security.md, "Client certificates"); TLSConfigFromFiles makes one
// whose files are read again for new connections. Transport credentials
// given through WithDialOptions still win, as they come after.
func WithTLSConfig(cfg *tls.Config) Option {
	return func(c *config) { c.tlsConfig = cfg }
}

// tlsOption is the part of config WithTLSConfig sets.
type tlsOption struct {
	tlsConfig *tls.Config
}

// transportOptions of a connection to an address that asks for TLS
// (https://) or not: its credentials and, when its client certificate is
// read for each connection, the interceptor that moves a call refused for
// an expired one to a new connection.
func (cfg *config) transportOptions(useTLS bool) []grpc.DialOption {
	switch {
	case cfg.tlsConfig != nil && cfg.tlsConfig.GetClientCertificate != nil:
		creds := &reconnectingTLS{TransportCredentials: credentials.NewTLS(cfg.tlsConfig), conns: map[*trackedConn]struct{}{}}
		return []grpc.DialOption{grpc.WithTransportCredentials(creds), grpc.WithChainUnaryInterceptor(creds.unary)}
	case cfg.tlsConfig != nil:
		return []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(cfg.tlsConfig))}
	case useTLS:
		return []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(nil))}
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
}

// reconnectingTLS is TLS whose connections can be closed by the client. A
// connection keeps the certificate it was made with; once that certificate
// has expired the server refuses every call on it (UNAUTHENTICATED,
// certificate_expired). The server sends GOAWAY at that moment, but a call
// that races the GOAWAY (or a server of an older release, which keeps the
// connection open) is refused: the unary interceptor closes the connection
// then and sends the call again on a new one, made with the rotated files.
// The server refused it before doing anything, so sending it again is safe
// for every method.
type reconnectingTLS struct {
	credentials.TransportCredentials

	mu    sync.Mutex
	conns map[*trackedConn]struct{}
}

type trackedConn struct {
	net.Conn
	owner *reconnectingTLS
}

func (t *trackedConn) Close() error {
	t.owner.mu.Lock()
	delete(t.owner.conns, t)
	t.owner.mu.Unlock()
	return t.Conn.Close()
}

func (r *reconnectingTLS) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := r.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return nil, nil, err
	}
	tracked := &trackedConn{Conn: conn, owner: r}
	r.mu.Lock()
	r.conns[tracked] = struct{}{}
	r.mu.Unlock()
	return tracked, info, nil
}

func (r *reconnectingTLS) Clone() credentials.TransportCredentials {
	return &reconnectingTLS{TransportCredentials: r.TransportCredentials.Clone(), conns: map[*trackedConn]struct{}{}}
}

func (r *reconnectingTLS) unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if authFailure(fromStatus(err)) != "certificate_expired" {
		return err
	}
	ready := cc.GetState() == connectivity.Ready
	r.mu.Lock()
	conns := make([]*trackedConn, 0, len(r.conns))
	for conn := range r.conns {
		conns = append(conns, conn)
	}
	r.mu.Unlock()
	for _, conn := range conns {
		_ = conn.Close()
	}
	if ready {
		// Not on the connection being closed: once gRPC has seen it close,
		// the call makes a new one.
		cc.WaitForStateChange(ctx, connectivity.Ready)
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// reopensOnExpiry: a KeepAlive stream the server ended because the
// certificate it opened with expired is worth opening again when the
// certificate is read again for each connection (a rotated file gives the
// next one) and no static token could have been what expired.
func (cfg *config) reopensOnExpiry() bool {
	return cfg.token == nil && cfg.tlsConfig != nil && cfg.tlsConfig.GetClientCertificate != nil
}

// TLSConfigFromFiles is a TLS configuration for WithTLSConfig from PEM
// files, any of them empty for none: caFile, the CA bundle the server's
// certificate is checked against (empty: the system roots), and certFile
// and keyFile, the client certificate chain and its key. The files are read
// now (an error names what is wrong with them) and again, for each new
// connection, once one has changed on disk, so a certificate rotated by
// SPIRE's helper or cert-manager is used without a restart; a connection
// already open keeps the certificate it was made with. While a file is being
// replaced (absent, or a new certificate beside the old key) the last good
// one is used.
//
// The client certificate comes from GetClientCertificate. crypto/tls has no
// such hook for a client's roots, so the server's certificate is verified by
// VerifyConnection against the CA bundle read at that moment, as crypto/tls
// itself would (the chain, with the connection's intermediates, for server
// authentication, and the host name or IP address the connection was made
// to); InsecureSkipVerify is set only to hand the check over to it, which
// crypto/tls documents for this case. A configuration copied from this one
// must keep its VerifyConnection.
func TLSConfigFromFiles(caFile, certFile, keyFile string) (*tls.Config, error) {
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("leasehold: a client certificate needs its key: give certFile and keyFile together")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if certFile != "" {
		pair := &reloaded[tls.Certificate]{files: []string{certFile, keyFile}, parse: func(b [][]byte) (*tls.Certificate, error) {
			cert, err := tls.X509KeyPair(b[0], b[1])
			if err != nil {
				return nil, fmt.Errorf("client certificate %s with key %s: %w", certFile, keyFile, err)
			}
			return &cert, nil
		}}
		if _, err := pair.get(); err != nil {
			return nil, fmt.Errorf("leasehold: %w", err)
		}
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return pair.get()
		}
	}
	if caFile != "" {
		roots := &reloaded[x509.CertPool]{files: []string{caFile}, parse: func(b [][]byte) (*x509.CertPool, error) {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(b[0]) {
				return nil, fmt.Errorf("CA bundle %s: no PEM certificate in it", caFile)
			}
			return pool, nil
		}}
		if _, err := roots.get(); err != nil {
			return nil, fmt.Errorf("leasehold: %w", err)
		}
		cfg.InsecureSkipVerify = true // verified by VerifyConnection, against the current bundle
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			pool, err := roots.get()
			if err != nil {
				return err
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("leasehold: the server presented no certificate")
			}
			intermediates := x509.NewCertPool()
			for _, cert := range cs.PeerCertificates[1:] {
				intermediates.AddCert(cert)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{
				Roots:         pool,
				Intermediates: intermediates,
				DNSName:       cs.ServerName,
				KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			})
			return err
		}
	}
	return cfg, nil
}

// reloaded is what some files parse to, parsed again when one of them has
// changed (another inode, modification time or size: a rename into place or
// a rewrite).
type reloaded[T any] struct {
	files []string
	parse func([][]byte) (*T, error)

	mu     sync.Mutex
	stamps []fileStamp
	value  *T
}

type fileStamp struct {
	info  os.FileInfo
	mtime time.Time
	size  int64
}

func (r *reloaded[T]) get() (*T, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	value, err := r.reload()
	if err != nil && r.value != nil {
		return r.value, nil // a file being replaced: the last good one
	}
	return value, err
}

func (r *reloaded[T]) reload() (*T, error) {
	stamps := make([]fileStamp, len(r.files))
	for i, f := range r.files {
		info, err := os.Stat(f)
		if err != nil {
			return nil, err
		}
		stamps[i] = fileStamp{info, info.ModTime(), info.Size()}
	}
	if r.value != nil && sameStamps(stamps, r.stamps) {
		return r.value, nil
	}
	contents := make([][]byte, len(r.files))
	for i, f := range r.files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		contents[i] = b
	}
	value, err := r.parse(contents)
	if err != nil {
		return nil, err
	}
	r.value, r.stamps = value, stamps
	return value, nil
}

func sameStamps(a, b []fileStamp) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !os.SameFile(a[i].info, b[i].info) || !a[i].mtime.Equal(b[i].mtime) || a[i].size != b[i].size {
			return false
		}
	}
	return true
}
