package leasehold

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
)

// TokenFunc returns the current bearer token. The client calls it for every
// unary call and every time a stream opens, so a token about to expire can
// be replaced by a fresh one.
type TokenFunc func(ctx context.Context) (string, error)

// TraceparentFunc returns the W3C traceparent header of ctx, or "" for none.
type TraceparentFunc func(ctx context.Context) string

type config struct {
	dialOptions        []grpc.DialOption
	token              TokenFunc
	staticToken        bool
	logger             *slog.Logger
	traceparent        TraceparentFunc
	callTimeout        time.Duration
	maxLeasesPerStream int
	backoffInitial     time.Duration
	backoffMax         time.Duration
	tlsOption
}

// Option configures Dial.
type Option func(*config)

// WithDialOptions passes options to every grpc.NewClient the client makes:
// TLS credentials, the caller's interceptors, keepalive parameters. They
// come after the client's own, so transport credentials given here replace
// the default (plaintext for "host:port" and "http://" addresses, TLS with
// the system roots for "https://", WithTLSConfig's configuration for all).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *config) { c.dialOptions = append(c.dialOptions, opts...) }
}

// WithToken sets a static bearer token (a JWT). A stream the server ends
// because that token expired cannot be reopened: its leases are lost with
// reason LossTokenExpired. Use WithTokenFunc for tokens that expire.
func WithToken(token string) Option {
	return func(c *config) {
		c.token = func(context.Context) (string, error) { return token, nil }
		c.staticToken = true
	}
}

// WithTokenFunc sets a function returning the current bearer token, called
// for every call and every stream (re)open. When the server ends the
// KeepAlive stream because the token it opened with expired, the client
// reopens it with a fresh token and keeps its leases.
func WithTokenFunc(f TokenFunc) Option {
	return func(c *config) { c.token, c.staticToken = f, false }
}

// WithLogger receives the client's background events (stream opened,
// failed and reopened; failovers; failed releases). Default: none.
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// WithTraceparent sets the traceparent header of every call from f (for
// example, from an OpenTelemetry span context). A caller already using
// otelgrpc's stats handler (WithDialOptions(grpc.WithStatsHandler(...)))
// gets it from there and needs no hook.
func WithTraceparent(f TraceparentFunc) Option { return func(c *config) { c.traceparent = f } }

// WithCallTimeout bounds every unary call whose context has no earlier
// deadline; default 10s.
func WithCallTimeout(d time.Duration) Option { return func(c *config) { c.callTimeout = d } }

// WithMaxLeasesPerStream sets how many leases one KeepAlive stream carries
// before the client opens another; default 1,000, the server's default
// --max-leases-per-stream. A server with a lower bound refuses the stream
// that passes it, naming its bound: the client lowers its own to it and
// moves the leases beyond it to another stream.
func WithMaxLeasesPerStream(n int) Option { return func(c *config) { c.maxLeasesPerStream = n } }

// WithReconnectBackoff bounds the KeepAlive reconnect delay (full jitter);
// default 100ms initial, 2s max.
func WithReconnectBackoff(initial, max time.Duration) Option {
	return func(c *config) { c.backoffInitial, c.backoffMax = initial, max }
}

// newConfig is the defaults with opts applied, checked.
func newConfig(opts []Option) (config, error) {
	cfg := config{
		callTimeout:        10 * time.Second,
		maxLeasesPerStream: 1000,
		backoffInitial:     100 * time.Millisecond,
		backoffMax:         2 * time.Second,
	}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.maxLeasesPerStream < 1 {
		return cfg, fmt.Errorf("leasehold: max leases per stream must be at least 1, got %d", cfg.maxLeasesPerStream)
	}
	if cfg.callTimeout <= 0 {
		return cfg, fmt.Errorf("leasehold: call timeout must be positive, got %s", cfg.callTimeout)
	}
	return cfg, nil
}
