package leasehold

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// SessionKey names a session: the account and the session within it.
type SessionKey struct {
	AccountID string
	SessionID string
}

func (k SessionKey) proto() *leasev1.SessionKey {
	return &leasev1.SessionKey{AccountId: k.AccountID, SessionId: k.SessionID}
}

func (k SessionKey) String() string { return k.AccountID + "/" + k.SessionID }

// Client is a client of one Leasehold service (one or more instances on one
// database). Its methods are safe for concurrent use.
type Client struct {
	cfg       config
	clock     clock
	addrs     []string
	endpoints []*endpoint
	preferred atomic.Int32
	keepAlive *keepAliveChannel

	mu      sync.Mutex
	leases  map[*Lease]struct{}
	keepers map[*Keeper]struct{}
	closed  bool
}

type endpoint struct {
	addr   string
	target string
	conn   *grpc.ClientConn
	stub   leasev1.LeaseServiceClient
}

// Dial makes a client of the instances at addrs ("host:port",
// "http://host:port" or "https://host:port"), tried in order: a unary call
// that finds an instance unavailable goes on to the next (an idempotent one
// then tries each once more), and the KeepAlive stream reconnects to the
// next one. Connections are made lazily; ctx only
// bounds Dial itself.
func Dial(ctx context.Context, addrs []string, opts ...Option) (*Client, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if len(addrs) == 0 {
		return nil, errors.New("leasehold: Dial needs at least one address")
	}
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	c := &Client{cfg: cfg, clock: realClock{}, addrs: append([]string(nil), addrs...), leases: map[*Lease]struct{}{}, keepers: map[*Keeper]struct{}{}}
	for _, addr := range addrs {
		ep, err := c.newEndpoint(addr)
		if err != nil {
			c.closeEndpoints()
			return nil, err
		}
		c.endpoints = append(c.endpoints, ep)
	}
	c.keepAlive = newKeepAliveChannel(c)
	return c, nil
}

// parseAddr splits an address into its gRPC target and whether it asks for TLS.
func parseAddr(addr string) (target string, tls bool, err error) {
	switch {
	case strings.HasPrefix(addr, "https://"):
		target, tls = strings.TrimPrefix(addr, "https://"), true
	case strings.HasPrefix(addr, "http://"):
		target = strings.TrimPrefix(addr, "http://")
	default:
		target = addr
	}
	target = strings.TrimSuffix(target, "/")
	if target == "" || strings.Contains(target, "/") {
		return "", false, fmt.Errorf("leasehold: address must be host:port, http://host:port or https://host:port, got %q", addr)
	}
	return target, tls, nil
}

// dial makes a connection to one address with the client's options.
func (c *Client) dial(addr string) (*grpc.ClientConn, string, error) {
	target, useTLS, err := parseAddr(addr)
	if err != nil {
		return nil, "", err
	}
	opts := append(c.cfg.transportOptions(useTLS),
		grpc.WithChainUnaryInterceptor(c.unaryMetadata),
		grpc.WithChainStreamInterceptor(c.streamMetadata),
	)
	opts = append(opts, c.cfg.dialOptions...)
	conn, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("leasehold: address %q: %w", addr, err)
	}
	return conn, target, nil
}

func (c *Client) newEndpoint(addr string) (*endpoint, error) {
	conn, target, err := c.dial(addr)
	if err != nil {
		return nil, err
	}
	return &endpoint{addr: addr, target: target, conn: conn, stub: leasev1.NewLeaseServiceClient(conn)}, nil
}

// withMetadata adds the bearer token and traceparent to a call's context.
// The token function runs here, for every call and every stream open.
func (c *Client) withMetadata(ctx context.Context) (context.Context, error) {
	var kv []string
	if c.cfg.token != nil {
		token, err := c.cfg.token(ctx)
		if err != nil {
			return nil, fmt.Errorf("leasehold: bearer token: %w", err)
		}
		if token != "" {
			kv = append(kv, "authorization", "Bearer "+token)
		}
	}
	if c.cfg.traceparent != nil {
		if tp := c.cfg.traceparent(ctx); tp != "" {
			kv = append(kv, "traceparent", tp)
		}
	}
	if len(kv) == 0 {
		return ctx, nil
	}
	return metadata.AppendToOutgoingContext(ctx, kv...), nil
}

func (c *Client) unaryMetadata(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	ctx, err := c.withMetadata(ctx)
	if err != nil {
		return err
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func (c *Client) streamMetadata(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	ctx, err := c.withMetadata(ctx)
	if err != nil {
		return nil, err
	}
	return streamer(ctx, desc, cc, method, opts...)
}

// debug reports whether debug records are wanted, so that a renewal builds
// none when they are not.
func (c *Client) debug() bool {
	return c.cfg.logger != nil && c.cfg.logger.Enabled(context.Background(), slog.LevelDebug)
}

func (c *Client) log(level slog.Level, msg string, args ...any) {
	if c.cfg.logger != nil {
		c.cfg.logger.Log(context.Background(), level, msg, args...)
	}
}

// AcquireOptions of Client.Acquire.
type AcquireOptions struct {
	// RunID is the run's id (a UUID); empty: the client makes one
	// (NewRunID), as the TypeScript and Python clients do, so that a call
	// whose connection is reset can be sent again and keep one grant.
	RunID string
	// TTL of the lease; 0 for the server's default.
	TTL time.Duration
	// Wait is how long the server may wait for the session to become free.
	Wait time.Duration
	// Holder labels this holder for others ("desktop", "worker-3").
	Holder string
}

func durationOrNil(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

// Acquire asks for a session's lease once. Not acquired is not an error:
// the response says Acquired=false and who holds it (Current). Hold is the
// usual way to take a lease: it also keeps it alive.
func (c *Client) Acquire(ctx context.Context, key SessionKey, o AcquireOptions) (*leasev1.AcquireResponse, error) {
	if o.RunID == "" {
		o.RunID = NewRunID()
	}
	req := &leasev1.AcquireRequest{Key: key.proto(), RunId: o.RunID, Ttl: durationOrNil(o.TTL), Wait: durationOrNil(o.Wait), Holder: o.Holder}
	if o.Wait > 0 {
		// The server may wait that long; the call needs room for it.
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, o.Wait+c.cfg.callTimeout)
			defer cancel()
		}
	}
	// Sent again with its run id: the same run id gets the same grant.
	return unaryAttempts(ctx, c, "Acquire", true, func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.AcquireResponse, error) {
		return s.Acquire(ctx, req)
	})
}

// Renew renews a run's lease once (ttl 0: the lease's own TTL). A run that
// does not hold the lease gets a *LeaseNotHeldError.
func (c *Client) Renew(ctx context.Context, key SessionKey, runID string, ttl time.Duration) (*leasev1.Lease, error) {
	return unary(ctx, c, "Renew", func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.Lease, error) {
		resp, err := s.Renew(ctx, &leasev1.RenewRequest{Key: key.proto(), RunId: runID, Ttl: durationOrNil(ttl)})
		return resp.GetLease(), err
	})
}

// Release ends a run's lease; false when it held none (S5: never another run's).
func (c *Client) Release(ctx context.Context, key SessionKey, runID string) (bool, error) {
	return unary(ctx, c, "Release", func(ctx context.Context, s leasev1.LeaseServiceClient) (bool, error) {
		resp, err := s.Release(ctx, &leasev1.ReleaseRequest{Key: key.proto(), RunId: runID})
		return resp.GetReleased(), err
	})
}

// Get returns the session's valid lease, or nil when none holds it.
func (c *Client) Get(ctx context.Context, key SessionKey) (*leasev1.Lease, error) {
	return unary(ctx, c, "Get", func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.Lease, error) {
		resp, err := s.Get(ctx, &leasev1.GetRequest{Key: key.proto()})
		if !resp.GetHeld() {
			return nil, err
		}
		return resp.GetLease(), err
	})
}

// Inspect returns Get's whole answer: held and the lease, or, when no
// lease holds the session but an expired keeper's lock-delay keeps it free
// of every run (K2), LockDelayUntil: the instant it ends.
func (c *Client) Inspect(ctx context.Context, key SessionKey) (*leasev1.GetResponse, error) {
	return unaryAttempts(ctx, c, "Get", true, func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.GetResponse, error) {
		return s.Get(ctx, &leasev1.GetRequest{Key: key.proto()})
	})
}

// RevokeKeeper ends a keeper of the account and every lease on it (admin
// scope), audited with reason: the keeper's holder learns it on its Keep
// stream (its leases' Contexts end at once). Revoked is false when it had
// ended already; leasesRevoked counts the leases it ended.
func (c *Client) RevokeKeeper(ctx context.Context, accountID, keeperID, reason string) (revoked bool, leasesRevoked int, err error) {
	resp, err := unaryAttempts(ctx, c, "RevokeKeeper", false, func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.RevokeKeeperResponse, error) {
		return s.RevokeKeeper(ctx, &leasev1.RevokeKeeperRequest{AccountId: accountID, KeeperId: keeperID, Reason: reason})
	})
	return resp.GetRevoked(), int(resp.GetLeasesRevoked()), err
}

// List returns one page of an account's valid leases and the next page's token ("" at the end).
func (c *Client) List(ctx context.Context, accountID string, pageSize int, pageToken string) ([]*leasev1.Lease, string, error) {
	resp, err := unary(ctx, c, "List", func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.ListResponse, error) {
		return s.List(ctx, &leasev1.ListRequest{AccountId: accountID, PageSize: int32(pageSize), PageToken: pageToken})
	})
	return resp.GetLeases(), resp.GetNextPageToken(), err
}

// RequestHandoff asks the session's holder to finish and release (it learns
// of it on its KeepAlive stream and in Watch). Delivered is false when no
// run holds the session; current is the lease asked.
func (c *Client) RequestHandoff(ctx context.Context, key SessionKey, requesterHolder, reason string) (delivered bool, current *leasev1.Lease, err error) {
	resp, err := unary(ctx, c, "RequestHandoff", func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.RequestHandoffResponse, error) {
		return s.RequestHandoff(ctx, &leasev1.RequestHandoffRequest{Key: key.proto(), RequesterHolder: requesterHolder, Reason: reason})
	})
	return resp.GetDelivered(), resp.GetCurrent(), err
}

// History returns one page of the session's audit trail and the next page's token.
func (c *Client) History(ctx context.Context, key SessionKey, pageSize int, pageToken string) ([]*leasev1.Event, string, error) {
	resp, err := unary(ctx, c, "History", func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.HistoryResponse, error) {
		return s.History(ctx, &leasev1.HistoryRequest{Key: key.proto(), PageSize: int32(pageSize), PageToken: pageToken})
	})
	return resp.GetEvents(), resp.GetNextPageToken(), err
}

// CheckFence says whether token is the session's valid lease's (current),
// and the highest token granted for the session.
func (c *Client) CheckFence(ctx context.Context, key SessionKey, token int64) (current bool, highest int64, err error) {
	resp, err := unary(ctx, c, "CheckFence", func(ctx context.Context, s leasev1.LeaseServiceClient) (*leasev1.CheckFenceResponse, error) {
		return s.CheckFence(ctx, &leasev1.CheckFenceRequest{Key: key.proto(), FencingToken: token})
	})
	return resp.GetCurrent(), resp.GetHighestToken(), err
}

// Revoke ends the session's valid lease (admin scope), audited with reason.
func (c *Client) Revoke(ctx context.Context, key SessionKey, reason string) (bool, error) {
	return unary(ctx, c, "Revoke", func(ctx context.Context, s leasev1.LeaseServiceClient) (bool, error) {
		resp, err := s.Revoke(ctx, &leasev1.RevokeRequest{Key: key.proto(), Reason: reason})
		return resp.GetRevoked(), err
	})
}

// WatchOptions of Client.Watch.
type WatchOptions struct {
	// IncludeRenewals adds an EVENT_TYPE_RENEWED event for every renewal.
	IncludeRenewals bool
}

// Watch streams the state of a session (key.SessionID empty: every session
// of the account): a snapshot first, then every change, until ctx ends or
// the stream fails. The stream goes to the preferred instance; a caller
// that wants to follow across instances watches again after an error
// (starting again from a snapshot).
func (c *Client) Watch(ctx context.Context, key SessionKey, o WatchOptions) iter.Seq2[*leasev1.WatchResponse, error] {
	return func(yield func(*leasev1.WatchResponse, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		ep := c.endpoints[int(c.preferred.Load())%len(c.endpoints)]
		stream, err := ep.stub.Watch(ctx, &leasev1.WatchRequest{Key: key.proto(), IncludeRenewals: o.IncludeRenewals})
		if err != nil {
			yield(nil, fromStatus(err))
			return
		}
		for {
			resp, err := stream.Recv()
			if err != nil {
				if ctx.Err() == nil {
					yield(nil, fromStatus(err))
				}
				return
			}
			if !yield(resp, nil) {
				return
			}
		}
	}
}

// KeepAlive opens a raw KeepAlive stream on the preferred instance, for
// callers who renew by hand; Hold does this for its leases on a shared stream.
func (c *Client) KeepAlive(ctx context.Context) (grpc.BidiStreamingClient[leasev1.KeepAliveRequest, leasev1.KeepAliveResponse], error) {
	ep := c.endpoints[int(c.preferred.Load())%len(c.endpoints)]
	s, err := ep.stub.KeepAlive(ctx)
	return s, fromStatus(err)
}

// Close closes every keeper the client still has open (Keeper.Close),
// releases every lease the client still holds (their Contexts end with
// ErrReleased), ends its KeepAlive streams and closes its connections.
// It returns the releases that failed, joined; those leases end at their
// deadlines on the server.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	held := make([]*Lease, 0, len(c.leases))
	for l := range c.leases {
		held = append(held, l)
	}
	keepers := make([]*Keeper, 0, len(c.keepers))
	for k := range c.keepers {
		keepers = append(keepers, k)
	}
	c.mu.Unlock()
	var errs []error
	var wg sync.WaitGroup
	var errMu sync.Mutex
	for _, k := range keepers {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.callTimeout, k.cfg.ttl))
			defer cancel()
			if err := k.Close(ctx); err != nil && !errors.Is(err, ErrKeeperLost) {
				errMu.Lock()
				errs = append(errs, err)
				errMu.Unlock()
			}
		})
	}
	for _, l := range held {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.callTimeout, l.timing.ttl))
			defer cancel()
			if err := l.Release(ctx); err != nil && !errors.Is(err, ErrLeaseLost) {
				errMu.Lock()
				errs = append(errs, fmt.Errorf("release %s run %s: %w", l.key, l.runID, err))
				errMu.Unlock()
			}
		})
	}
	wg.Wait()
	c.keepAlive.close()
	c.closeEndpoints()
	return errors.Join(errs...)
}

func (c *Client) closeEndpoints() {
	for _, ep := range c.endpoints {
		_ = ep.conn.Close()
	}
}

// isClosed says whether Close has begun.
func (c *Client) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// track counts l among the leases Close releases; false once Close has begun.
func (c *Client) track(l *Lease) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.leases[l] = struct{}{}
	return true
}

// trackKeeper counts k among the keepers Close closes; false once Close
// has begun.
func (c *Client) trackKeeper(k *Keeper) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.keepers[k] = struct{}{}
	return true
}

// forgetKeeper stops counting k among the keepers Close closes.
func (c *Client) forgetKeeper(k *Keeper) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.keepers, k)
}

// forget stops counting l among the leases Close releases.
func (c *Client) forget(l *Lease) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.leases, l)
}
