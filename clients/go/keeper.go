package leasehold

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// A keeper is a process's unit of liveness (etcd's session, Consul's and
// Chubby's session; docs/keepers.md): any number of leases are held on it
// and one heartbeat, on one Keep stream, keeps them all. Its loss ends
// every one of them at once.

type keeperConfig struct {
	ttl, lockDelay, margin, beatEvery time.Duration
	holder, id                        string
}

// KeeperOption configures Client.NewKeeper.
type KeeperOption func(*keeperConfig)

// WithKeeperTTL sets the keeper's TTL; default 10s. Heartbeats go every
// third of it, and the local deadline keeps a tenth of it as its margin.
func WithKeeperTTL(d time.Duration) KeeperOption { return func(c *keeperConfig) { c.ttl = d } }

// WithLockDelay sets how long the keeper's keys stay free of any other run
// after the keeper *expires* (K2; not after a Close or a revoke); default 0,
// at most the server's --max-lock-delay (60s by default).
func WithLockDelay(d time.Duration) KeeperOption { return func(c *keeperConfig) { c.lockDelay = d } }

// WithKeeperHolder labels the keeper ("worker-7"), as a lease's holder.
func WithKeeperHolder(holder string) KeeperOption {
	return func(c *keeperConfig) { c.holder = holder }
}

// WithKeeperID sets the keeper's id (a UUID); default a new random one.
// The same id on a keeper still valid re-attaches to it, keeping its leases
// (another process taking over the keeper of one that restarted).
func WithKeeperID(id string) KeeperOption { return func(c *keeperConfig) { c.id = id } }

func newKeeperConfig(opts []KeeperOption) (keeperConfig, error) {
	var cfg keeperConfig
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.ttl == 0 {
		cfg.ttl = 10 * time.Second
	}
	if cfg.ttl < 0 {
		return cfg, fmt.Errorf("leasehold: keeper TTL must be positive, got %s", cfg.ttl)
	}
	if cfg.lockDelay < 0 {
		return cfg, fmt.Errorf("leasehold: lock delay must not be negative, got %s", cfg.lockDelay)
	}
	if cfg.id == "" {
		// Chosen here, not by the server: an open whose answer is lost is
		// retried with the same id, and a re-attach needs it.
		cfg.id = NewRunID()
	}
	cfg.id = strings.ToLower(cfg.id)
	cfg.margin = cfg.ttl / 10
	cfg.beatEvery = cfg.ttl / 3
	return cfg, nil
}

// Keeper is a keeper this client holds open on one Keep stream. Its
// methods are safe for concurrent use.
type Keeper struct {
	c         *Client
	cfg       keeperConfig
	accountID string

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu        sync.Mutex
	state     *leasev1.Keeper
	deadline  time.Time // monotonic, from clock.Now(); zero before the open's answer
	timer     timer
	lost      *KeeperLostError
	closing   bool
	ended     bool // closed or lost: nothing more is sent
	leases    map[entryID]*Lease
	stream    *keeperStream
	nextID    uint64
	queue     []*keeperCall // calls waiting for the stream to (re)attach
	beatID    uint64        // the heartbeat on the way, 0 for none
	beatSent  time.Time
	addrIndex int
	failures  int
	tried     []streamFailure
	reconnect timer
	opened    chan error // the first open's outcome, for NewKeeper
	stop      chan struct{}
	wg        sync.WaitGroup
}

// keeperStream is one Keep stream of a keeper over a connection of its own.
type keeperStream struct {
	addr     string
	ctx      context.Context
	cancel   context.CancelFunc
	openID   uint64
	openSent time.Time
	attached bool
	calls    map[uint64]*keeperCall // sent on this stream, not yet answered
	out      []*leasev1.KeepRequest
	wake     chan struct{}
}

// keeperCall is one request of the keeper's (acquire, release, get,
// close): answered on the stream it was sent on, or sent again on the next
// one after a cut (each is idempotent: an acquire by its run id, a release
// by run id, S5).
type keeperCall struct {
	req       *leasev1.KeepRequest
	done      chan struct{}
	resp      *leasev1.KeepResponse
	err       error
	abandoned bool // an acquire whose caller left: its grant is released
	// A waiting acquire's wait and when it was first sent (client clock):
	// sent again after a cut, it waits only what is left.
	wait   time.Duration
	sentAt time.Time
}

func (call *keeperCall) finish(resp *leasev1.KeepResponse, err error) {
	call.resp, call.err = resp, err
	close(call.done)
}

// NewKeeper opens a keeper of accountID on one Keep stream (trying each
// address in turn) and keeps it alive until Close or its loss. ctx bounds
// the open only. Without a keeper nothing changes: Hold and RunExclusive of
// the Client keep a lease of their own, as before.
func (c *Client) NewKeeper(ctx context.Context, accountID string, opts ...KeeperOption) (*Keeper, error) {
	cfg, err := newKeeperConfig(opts)
	if err != nil {
		return nil, err
	}
	kctx, cancel := context.WithCancelCause(context.Background())
	k := &Keeper{
		c: c, cfg: cfg, accountID: accountID, ctx: kctx, cancel: cancel,
		leases: map[entryID]*Lease{}, opened: make(chan error, 1), stop: make(chan struct{}),
		addrIndex: int(c.preferred.Load()),
	}
	if !c.trackKeeper(k) {
		cancel(ErrClosed)
		return nil, ErrClosed
	}
	k.mu.Lock()
	k.open()
	k.mu.Unlock()
	select {
	case err = <-k.opened:
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		k.finish(err)
		c.forgetKeeper(k)
		return nil, err
	}
	k.wg.Add(1)
	go k.heartbeatLoop()
	return k, nil
}

// ID is the keeper's id: WithKeeperID's, or the one the client made.
func (k *Keeper) ID() string { return k.cfg.id }

// Context is cancelled the moment the keeper is lost (the server says it
// expired or was revoked, the re-attach is refused, or the local deadline
// passes without a confirmed heartbeat) or closed: context.Cause gives the
// *KeeperLostError, or ErrKeeperClosed after Close. Every lease on the
// keeper has ended by the time it is.
func (k *Keeper) Context() context.Context { return k.ctx }

// Done is closed when the keeper is lost or closed: Context().Done().
func (k *Keeper) Done() <-chan struct{} { return k.ctx.Done() }

// Err is the *KeeperLostError once the keeper is lost, else nil (also after
// Close).
func (k *Keeper) Err() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.lost == nil {
		return nil
	}
	return k.lost
}

// State is the keeper as last confirmed by the server (open, heartbeat).
func (k *Keeper) State() *leasev1.Keeper {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.state
}

// Remaining is the time left before the keeper's local deadline, on the
// monotonic clock; 0 once it has passed or the keeper has ended.
func (k *Keeper) Remaining() time.Duration {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended {
		return 0
	}
	return max(0, k.deadline.Sub(k.c.clock.Now()))
}

// localDeadline is the keeper's local deadline (the zero time once it has
// ended, which every clock reading is past).
func (k *Keeper) localDeadline() time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended {
		return time.Time{}
	}
	return k.deadline
}

// KeeperHoldOption configures Keeper.Hold.
type KeeperHoldOption func(*keeperHold)

type keeperHold struct {
	wait   time.Duration
	holder string
	runID  string
}

// WithWait waits up to d for a held session to become free; default 0:
// fail at once with *NotAcquiredError.
func WithWait(d time.Duration) KeeperHoldOption { return func(h *keeperHold) { h.wait = d } }

// WithHolder labels this lease's holder for others; default the keeper's.
func WithHolder(holder string) KeeperHoldOption {
	return func(h *keeperHold) { h.holder = holder }
}

// WithRunID sets the run's id (a UUID); default a new random one.
func WithRunID(runID string) KeeperHoldOption { return func(h *keeperHold) { h.runID = runID } }

// Hold acquires the session's lease on the keeper (waiting up to WithWait
// for it). The lease has the Lease API of Client.Hold: its Context is
// cancelled when the keeper is lost or its heartbeats stall past the local
// deadline, when the server says this lease was revoked, or by Release. ctx
// bounds the acquire (ending it while the server waits gives the wait up
// there, and releases a grant that raced it); the keeper's loss while it
// waits ends it too, with the *KeeperLostError. A session held by another
// run is *NotAcquiredError (with LockDelayUntil when an expired keeper's
// lock-delay refused it).
func (k *Keeper) Hold(ctx context.Context, key SessionKey, opts ...KeeperHoldOption) (*Lease, error) {
	o := keeperHold{holder: k.cfg.holder}
	for _, opt := range opts {
		opt(&o)
	}
	if o.wait < 0 {
		return nil, fmt.Errorf("leasehold: Wait must not be negative, got %s", o.wait)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if o.runID == "" {
		o.runID = NewRunID()
	}
	runID := strings.ToLower(o.runID)
	call, err := k.send(&leasev1.KeepRequest{Op: &leasev1.KeepRequest_Acquire{Acquire: &leasev1.AcquireRequest{
		Key: key.proto(), RunId: runID, Wait: durationOrNil(o.wait), Holder: o.holder,
	}}})
	if err != nil {
		return nil, err
	}
	resp, err := k.await(ctx, call)
	if err != nil {
		return nil, err
	}
	r := resp.GetAcquire()
	if !r.GetAcquired() || r.GetLease() == nil {
		return nil, notAcquired(r)
	}
	return k.keep(key, runID, r.GetLease())
}

// keep makes a grant on the keeper a Lease of the keeper's: lost with the
// keeper, its local deadline the keeper's.
func (k *Keeper) keep(key SessionKey, runID string, granted *leasev1.Lease) (*Lease, error) {
	l := newLease(k.c, key, runID, timing{ttl: k.cfg.ttl, margin: k.cfg.margin, renewEvery: k.cfg.beatEvery}, grant{lease: granted})
	l.keeper = k
	l.stop = nil
	k.mu.Lock()
	if k.ended {
		lost := k.lost
		k.mu.Unlock()
		if lost == nil {
			// Closed meanwhile: the close released the grant with the rest.
			l.cancel(ErrKeeperClosed)
			return nil, ErrKeeperClosed
		}
		l.lose(lost.Reason, "the keeper was lost: "+lost.Message, lost)
		return nil, l.Err()
	}
	k.leases[entryID{key.AccountID, key.SessionID, runID}] = l
	k.mu.Unlock()
	// L2: a grant whose keeper's local deadline passed while it was on the
	// way is not used (the keeper, and the lease with it, is lost).
	if err := l.check(); err != nil {
		return nil, err
	}
	return l, nil
}

// RunExclusive holds the session's lease on the keeper while fn runs, fn's
// context cancelled the moment the lease or its keeper is lost (or ctx
// ends), and releases it when fn returns (never after a loss). It returns
// fn's error, joined with the *LeaseLostError when the lease was lost first.
func (k *Keeper) RunExclusive(ctx context.Context, key SessionKey, fn func(ctx context.Context, lease *Lease) error, opts ...KeeperHoldOption) error {
	lease, err := k.Hold(ctx, key, opts...)
	if err != nil {
		return err
	}
	return runHeld(ctx, k.c, lease, fn)
}

// Get returns the session's authoritative state over the keeper's stream:
// held and the lease, or LockDelayUntil when an expired keeper's lock-delay
// keeps it free of every run.
func (k *Keeper) Get(ctx context.Context, key SessionKey) (*leasev1.GetResponse, error) {
	call, err := k.send(&leasev1.KeepRequest{Op: &leasev1.KeepRequest_Get{Get: &leasev1.GetRequest{Key: key.proto()}}})
	if err != nil {
		return nil, err
	}
	resp, err := k.await(ctx, call)
	return resp.GetGet(), err
}

// Close releases every lease on the keeper and ends it (no lock-delay), then
// ends its stream; every lease's Context ends with ErrReleased and the
// keeper's with ErrKeeperClosed. ctx bounds the wait for the server's
// answer: without one (ctx ended, or the keeper lost first) the leases end
// at the keeper's deadline on the server, and Close returns why. Closing
// twice is a no-op.
func (k *Keeper) Close(ctx context.Context) error {
	k.mu.Lock()
	if k.ended || k.closing {
		lost := k.lost
		k.mu.Unlock()
		if lost != nil {
			// Lost: nothing to release; its goroutines are ending.
			k.wg.Wait()
			k.c.forgetKeeper(k)
			return lost
		}
		return nil
	}
	k.closing = true
	call := k.enqueueLocked(&leasev1.KeepRequest{Op: &leasev1.KeepRequest_Close{Close: &leasev1.CloseKeeper{}}})
	k.mu.Unlock()
	_, err := k.await(ctx, call)
	k.finish(ErrKeeperClosed)
	k.c.forgetKeeper(k)
	if errors.Is(err, ErrKeeperLost) {
		return err
	}
	if err != nil {
		return fmt.Errorf("leasehold: close keeper %s: %w", k.cfg.id, err)
	}
	return nil
}

// finish ends the keeper locally with cause (ErrKeeperClosed, or the
// error of a failed open): no more requests, every lease ended as released,
// the stream cut and every goroutine gone. A lost keeper stays lost.
func (k *Keeper) finish(cause error) {
	k.mu.Lock()
	leases, calls := k.endLocked()
	k.mu.Unlock()
	for _, l := range leases {
		if l.markReleasedByKeeper() {
			l.cancel(ErrReleased)
		}
	}
	for _, call := range calls {
		call.finish(nil, cause)
	}
	k.cancel(cause)
	k.wg.Wait()
}

// endLocked stops everything the keeper runs and hands back its leases and
// unanswered calls. k.mu is held.
func (k *Keeper) endLocked() ([]*Lease, []*keeperCall) {
	if k.ended {
		return nil, nil
	}
	k.ended = true
	if k.timer != nil {
		k.timer.Stop()
	}
	if k.reconnect != nil {
		k.reconnect.Stop()
		k.reconnect = nil
	}
	close(k.stop)
	calls := k.queue
	k.queue = nil
	if s := k.stream; s != nil {
		for _, call := range s.calls {
			calls = append(calls, call)
		}
		s.cancel()
		k.stream = nil
	}
	leases := make([]*Lease, 0, len(k.leases))
	for _, l := range k.leases {
		leases = append(leases, l)
	}
	clear(k.leases)
	return leases, calls
}

// lose ends the keeper as lost, once: every lease on it is lost at once
// with a *LeaseLostError wrapping the *KeeperLostError, and every call
// waiting on it (a Hold's wait included) returns that error. Nothing more is
// sent: the server ends the leases at the keeper's deadline (or already
// has).
func (k *Keeper) lose(reason LossReason, message string, cause error) {
	k.mu.Lock()
	if k.ended {
		k.mu.Unlock()
		return
	}
	lost := &KeeperLostError{KeeperID: k.cfg.id, Reason: reason, Message: message, Err: cause}
	k.lost = lost
	leases, calls := k.endLocked()
	k.mu.Unlock()
	// Every lease first, then the keeper: whoever sees Done() closed finds
	// every lease's Context ended too.
	for _, l := range leases {
		l.lose(reason, "the keeper was lost: "+message, lost)
	}
	k.cancel(lost)
	for _, call := range calls {
		call.finish(nil, lost)
	}
	k.settleOpen(lost)
	k.c.log(slog.LevelWarn, "leasehold: keeper lost", "keeper_id", k.cfg.id, "reason", string(reason), "message", message, "leases", len(leases))
}

// send queues a request, sent at once when the stream is attached, else
// once it (re)attaches.
func (k *Keeper) send(req *leasev1.KeepRequest) (*keeperCall, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.lost != nil {
		return nil, k.lost
	}
	if k.ended || k.closing {
		return nil, ErrKeeperClosed
	}
	return k.enqueueLocked(req), nil
}

// enqueueLocked sends req now on the attached stream, or keeps it for the
// next one. k.mu is held.
func (k *Keeper) enqueueLocked(req *leasev1.KeepRequest) *keeperCall {
	call := &keeperCall{req: req, done: make(chan struct{})}
	if a := req.GetAcquire(); a != nil {
		call.wait, call.sentAt = a.GetWait().AsDuration(), k.c.clock.Now()
	}
	if s := k.stream; s != nil && s.attached {
		k.sendLocked(s, call)
	} else {
		k.queue = append(k.queue, call)
	}
	return call
}

// sendLocked gives call a fresh id on s and hands it to s's sender. k.mu
// is held.
func (k *Keeper) sendLocked(s *keeperStream, call *keeperCall) {
	k.nextID++
	call.req.Id = k.nextID
	s.calls[k.nextID] = call
	k.pushLocked(s, call.req)
}

func (k *Keeper) pushLocked(s *keeperStream, req *leasev1.KeepRequest) {
	s.out = append(s.out, req)
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// await waits for call's answer, ctx's end or the keeper's loss (which
// finishes every call), and maps a refusal to this package's errors. An
// acquire left by its caller is marked so that its grant, if one comes, is
// released, and a waiting one is given up on the server (giveUpLocked).
func (k *Keeper) await(ctx context.Context, call *keeperCall) (*leasev1.KeepResponse, error) {
	select {
	case <-call.done:
	case <-ctx.Done():
		k.mu.Lock()
		select {
		case <-call.done:
			k.mu.Unlock()
			if call.err == nil && call.resp.GetAcquire().GetAcquired() {
				k.releaseRun(call.req.GetAcquire())
			}
		default:
			call.abandoned = true
			k.giveUpLocked(call)
			k.mu.Unlock()
		}
		return nil, ctx.Err()
	}
	if call.err != nil {
		return nil, call.err
	}
	if st := call.resp.GetError(); st != nil {
		return nil, fromStatus(status.FromProto(st).Err())
	}
	return call.resp, nil
}

// giveUpLocked sends a release of a waiting acquire's run after it, on the
// stream it waits on: the server keeps a waiting acquire queued until its
// wait runs out, and a release of its run on the same stream gives it up
// there (answered CANCELLED, no waiter left, a grant that raced the
// release ended), so the next candidate is granted at once. An acquire
// not sent yet needs none: attached sends its release instead. k.mu is
// held.
func (k *Keeper) giveUpLocked(call *keeperCall) {
	a := call.req.GetAcquire()
	if a == nil || a.GetWait().AsDuration() <= 0 || k.lost != nil || k.ended || k.closing {
		return
	}
	if s := k.stream; s != nil && s.calls[call.req.GetId()] == call {
		k.sendLocked(s, &keeperCall{
			req:  &leasev1.KeepRequest{Op: &leasev1.KeepRequest_Release{Release: &leasev1.ReleaseRequest{Key: a.GetKey(), RunId: a.GetRunId()}}},
			done: make(chan struct{}),
		})
	}
}

// releaseRun releases, over the stream, the grant of an acquire nobody
// waits for any more (S5: by run id, so it ends that grant only).
func (k *Keeper) releaseRun(a *leasev1.AcquireRequest) {
	_, _ = k.send(&leasev1.KeepRequest{Op: &leasev1.KeepRequest_Release{Release: &leasev1.ReleaseRequest{Key: a.GetKey(), RunId: a.GetRunId()}}})
}

// release is a keeper lease's Release: it ends the lease locally at once
// (its Context ends with ErrReleased) and on the server over the stream.
func (k *Keeper) release(ctx context.Context, l *Lease) error {
	l.mu.Lock()
	if ended, err := l.endedLocked(); ended {
		l.mu.Unlock()
		return err
	}
	l.released = true
	l.stopLocked()
	l.mu.Unlock()
	l.cancel(ErrReleased)
	k.mu.Lock()
	delete(k.leases, entryID{l.key.AccountID, l.key.SessionID, l.runID})
	k.mu.Unlock()
	call, err := k.send(&leasev1.KeepRequest{Op: &leasev1.KeepRequest_Release{Release: &leasev1.ReleaseRequest{Key: l.key.proto(), RunId: l.runID}}})
	if errors.Is(err, ErrKeeperClosed) {
		return nil // the keeper's close releases it
	}
	if err != nil {
		return err
	}
	_, err = k.await(ctx, call)
	return err
}

// markReleasedByKeeper ends a keeper's lease as released by the keeper's
// Close; false when it had ended already.
func (l *Lease) markReleasedByKeeper() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ended, _ := l.endedLocked(); ended {
		return false
	}
	l.released = true
	l.stopLocked()
	return true
}

// open starts a stream over a fresh connection to the keeper's current
// address and sends the open (a re-attach after the first): the queued
// calls follow its answer. k.mu is held.
func (k *Keeper) open() {
	c := k.c
	k.reconnect = nil
	addr := c.addrs[k.addrIndex%len(c.addrs)]
	s := &keeperStream{addr: addr, calls: map[uint64]*keeperCall{}, wake: make(chan struct{}, 1)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	k.stream = s
	k.beatID = 0
	k.nextID++
	s.openID, s.openSent = k.nextID, c.clock.Now()
	k.pushLocked(s, &leasev1.KeepRequest{Id: s.openID, Op: &leasev1.KeepRequest_Open{Open: &leasev1.OpenKeeper{
		AccountId: k.accountID, KeeperId: k.cfg.id, Holder: k.cfg.holder,
		Ttl: durationpb.New(k.cfg.ttl), LockDelay: durationpb.New(k.cfg.lockDelay),
	}}})
	conn, _, err := c.dial(addr)
	if err != nil {
		// Only a malformed address fails here, and Dial checked them all.
		s.cancel()
		go k.failed(s, status.Error(codes.InvalidArgument, err.Error()))
		return
	}
	k.wg.Add(1)
	go k.run(s, conn)
}

// run drives one stream: opens it (the token function runs here), sends
// what is queued, and reads answers until the stream ends.
func (k *Keeper) run(s *keeperStream, conn *grpc.ClientConn) {
	defer k.wg.Done()
	defer func() {
		s.cancel()
		_ = conn.Close()
	}()
	stream, err := leasev1.NewLeaseServiceClient(conn).Keep(s.ctx)
	if err != nil {
		k.failed(s, err)
		return
	}
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		k.sendLoop(s, stream)
	}()
	defer func() { <-sent }()
	for {
		resp, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = status.Error(codes.Unavailable, "the server ended the Keep stream")
			}
			s.cancel()
			k.failed(s, err)
			return
		}
		k.dispatch(s, resp)
	}
}

func (k *Keeper) sendLoop(s *keeperStream, stream leasev1.LeaseService_KeepClient) {
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-s.wake:
		}
		k.mu.Lock()
		out := s.out
		s.out = nil
		k.mu.Unlock()
		for _, req := range out {
			if stream.Send(req) != nil {
				// Broken: Recv reports why.
				return
			}
		}
	}
}

// dispatch hands one answer to whom it belongs.
func (k *Keeper) dispatch(s *keeperStream, resp *leasev1.KeepResponse) {
	k.mu.Lock()
	if k.stream != s || k.ended {
		k.mu.Unlock()
		return
	}
	switch id := resp.GetId(); {
	case id == 0 || resp.GetLost() != nil:
		// Unasked, or the keeper's loss answering the heartbeat (or any
		// request) that found it: the server ends the stream after it.
		k.mu.Unlock()
		k.unasked(resp)
	case id == s.openID:
		k.attached(s, resp)
	case id == k.beatID:
		k.beatID = 0
		if st := resp.GetError(); st != nil {
			k.mu.Unlock()
			k.refused(s, status.FromProto(st).Err())
			return
		}
		cb := k.renewedLocked(resp.GetKeeper(), k.beatSent)
		k.mu.Unlock()
		cb()
	default:
		call := s.calls[id]
		delete(s.calls, id)
		var release *leasev1.AcquireRequest
		if call != nil {
			if call.abandoned && resp.GetAcquire().GetAcquired() {
				release = call.req.GetAcquire()
			}
			// Under k.mu, where await decides between an answer and
			// abandoning the call: a grant is either seen by its caller
			// or released here, never neither.
			call.finish(resp, nil)
		}
		k.mu.Unlock()
		if release != nil {
			k.releaseRun(release)
		}
	}
}

// attached is the answer to a stream's open: the keeper's state, and the
// queued calls go out; or the server's refusal. k.mu is held; attached
// releases it.
func (k *Keeper) attached(s *keeperStream, resp *leasev1.KeepResponse) {
	if st := resp.GetError(); st != nil {
		k.mu.Unlock()
		k.refused(s, status.FromProto(st).Err())
		return
	}
	first := k.deadline.IsZero()
	s.attached = true
	k.failures, k.tried = 0, nil
	if k.state != nil && k.state.GetKeeperId() != "" {
		k.c.log(slog.LevelInfo, "leasehold: keeper re-attached", "keeper_id", k.cfg.id, "addr", s.addr, "leases", len(k.leases))
	}
	cb := k.renewedLocked(resp.GetKeeper(), s.openSent)
	queue := k.queue
	k.queue = nil
	for _, call := range queue {
		if a := call.req.GetAcquire(); a != nil && call.abandoned {
			// Its caller left: release whatever it was granted instead.
			call.req = &leasev1.KeepRequest{Op: &leasev1.KeepRequest_Release{Release: &leasev1.ReleaseRequest{Key: a.GetKey(), RunId: a.GetRunId()}}}
		} else if a != nil && call.wait > 0 {
			// Sent again: it waits what is left of the first wait, so
			// a caller's bound on it (Campaign's Timeout) holds across
			// the cut. A new request: the old one may still be on its
			// way out of the cut stream's sender.
			again := proto.Clone(a).(*leasev1.AcquireRequest)
			again.Wait = durationOrNil(max(0, call.wait-k.c.clock.Now().Sub(call.sentAt)))
			call.req = &leasev1.KeepRequest{Op: &leasev1.KeepRequest_Acquire{Acquire: again}}
		}
		k.sendLocked(s, call)
	}
	if first {
		k.timer = k.c.clock.AfterFunc(k.deadline.Sub(k.c.clock.Now()), k.checkDeadline)
	}
	k.mu.Unlock()
	cb()
	if first {
		k.settleOpen(nil)
	}
}

// renewedLocked is a confirmation of the keeper (open or heartbeat) sent at
// sentAt: the local deadline becomes sentAt + remaining − margin, never
// earlier than it was; one arriving after the deadline cannot revive it
// (the keeper may have expired and its keys been taken). k.mu is held; the
// returned function runs after it is released.
func (k *Keeper) renewedLocked(state *leasev1.Keeper, sentAt time.Time) func() {
	now := k.c.clock.Now()
	if !k.deadline.IsZero() && !now.Before(k.deadline) {
		return func() { k.lose(LossDeadline, "the local deadline passed before a heartbeat was confirmed", nil) }
	}
	k.state = state
	if next := sentAt.Add(state.GetRemaining().AsDuration() - k.cfg.margin); next.After(k.deadline) {
		k.deadline = next
	}
	if k.c.debug() {
		left := k.deadline.Sub(now)
		return func() {
			k.c.log(slog.LevelDebug, MsgKeeperRenewed, "keeper_id", k.cfg.id, "remaining", state.GetRemaining().AsDuration(), "deadline_in", left)
		}
	}
	return func() {}
}

// MsgKeeperRenewed is the debug record (WithLogger) of a confirmed heartbeat.
const MsgKeeperRenewed = "leasehold: keeper renewed"

// unasked is what the server says without a request: one lease revoked,
// a handoff asked of one lease, or the keeper lost.
func (k *Keeper) unasked(resp *leasev1.KeepResponse) {
	switch r := resp.GetResult().(type) {
	case *leasev1.KeepResponse_LeaseLost:
		id := entryID{r.LeaseLost.GetKey().GetAccountId(), r.LeaseLost.GetKey().GetSessionId(), r.LeaseLost.GetRunId()}
		k.mu.Lock()
		l := k.leases[id]
		delete(k.leases, id)
		k.mu.Unlock()
		if l != nil {
			reason := lossReason(r.LeaseLost.GetReason())
			l.lose(reason, fmt.Sprintf("the server reports the lease lost (%s)", reason), nil)
		}
	case *leasev1.KeepResponse_HandoffRequested:
		id := entryID{r.HandoffRequested.GetKey().GetAccountId(), r.HandoffRequested.GetKey().GetSessionId(), r.HandoffRequested.GetRunId()}
		k.mu.Lock()
		l := k.leases[id]
		k.mu.Unlock()
		if l != nil {
			l.handoff(r.HandoffRequested.GetRequest())
		}
	case *leasev1.KeepResponse_Lost:
		reason := lossReason(r.Lost.GetReason())
		msg := fmt.Sprintf("the server reports the keeper lost (%s)", reason)
		if d := r.Lost.GetDetail(); d != "" {
			msg += ": " + d
		}
		k.lose(reason, msg, nil)
	}
}

// refused is a refusal of the keeper itself (its open or heartbeat),
// decided as the stream's failure with that error: an ended keeper is lost.
func (k *Keeper) refused(s *keeperStream, err error) {
	s.cancel()
	k.failed(s, err)
}

// failed ends stream s and decides what follows: the first open tries the
// next address (each once) and else fails NewKeeper; an attached keeper
// re-attaches after a backoff to the next address, resending what had no
// answer; a refusal retrying cannot help loses the keeper.
func (k *Keeper) failed(s *keeperStream, err error) {
	k.mu.Lock()
	if k.stream != s || k.ended {
		k.mu.Unlock()
		return
	}
	c := k.c
	k.stream = nil
	k.beatID = 0
	s.cancel()
	// What had no answer goes out again on the next stream, in order.
	ids := slices.Sorted(maps.Keys(s.calls))
	resend := make([]*keeperCall, 0, len(ids))
	for _, id := range ids {
		resend = append(resend, s.calls[id])
	}
	k.queue = append(resend, k.queue...)
	if k.closing && len(s.calls) == 0 && len(k.queue) == 0 {
		// The close was answered: the server ends the stream after it.
		k.mu.Unlock()
		return
	}
	msg := status.Convert(err).Message()
	k.tried = append(k.tried, streamFailure{s.addr, msg})
	lerr := fromStatus(err)
	code := status.Code(err)
	first := k.deadline.IsZero()
	k.addrIndex++
	var gone *KeeperNotHeldError
	if errors.As(lerr, &gone) {
		// A refused open (re-attach): the keeper has ended.
		k.mu.Unlock()
		reason := gone.Cause
		if reason == "" {
			reason = LossNotFound
		}
		k.failOpen(first, lerr, reason, "the server says the keeper has ended ("+string(reason)+")")
		return
	}
	if code == codes.Unauthenticated && (c.cfg.token == nil || c.cfg.staticToken) && !c.cfg.reopensOnExpiry() {
		k.mu.Unlock()
		k.failOpen(first, lerr, LossTokenExpired, "the server refused the bearer token ("+authCause(err)+"); a static token cannot be refreshed: use WithTokenFunc")
		return
	}
	if definitive[code] || (first && code == codes.Unauthenticated) {
		k.mu.Unlock()
		k.failOpen(first, lerr, LossRenewalFailed, "the Keep stream failed: "+lerr.Error())
		return
	}
	if first && len(k.tried) >= len(c.addrs) {
		tried := k.triedLocked()
		k.mu.Unlock()
		k.settleOpen(&UnavailableError{serverError{status.New(codes.Unavailable, strings.Join(tried, "; "))}, tried})
		return
	}
	if first {
		k.open()
		k.mu.Unlock()
		return
	}
	bound := min(c.cfg.backoffMax, c.cfg.backoffInitial<<min(k.failures, 20))
	delay := time.Duration(rand.Int64N(int64(bound) + 1))
	k.failures++
	k.reconnect = c.clock.AfterFunc(delay, func() {
		k.mu.Lock()
		defer k.mu.Unlock()
		if k.reconnect != nil && !k.ended {
			k.open()
		}
	})
	k.mu.Unlock()
	c.log(slog.LevelWarn, "leasehold: keep stream failed; re-attaching", "keeper_id", k.cfg.id, "addr", s.addr, "err", lerr, "retry_in", delay)
}

// failOpen fails NewKeeper with err on the first open, else loses the keeper.
func (k *Keeper) failOpen(first bool, err error, reason LossReason, message string) {
	if first {
		k.settleOpen(err)
		return
	}
	k.lose(reason, message, err)
}

// settleOpen tells NewKeeper how its open ended, once (later outcomes of
// a keeper NewKeeper has returned find the channel full and are dropped).
func (k *Keeper) settleOpen(err error) {
	select {
	case k.opened <- err:
	default:
	}
}

// triedLocked lists each address the stream tried since it was last
// attached and what it last did there. k.mu is held.
func (k *Keeper) triedLocked() []string {
	tried := make([]string, 0, len(k.tried))
	for _, f := range k.tried {
		tried = append(tried, f.addr+": "+f.what)
	}
	return tried
}

// heartbeatLoop sends a heartbeat every beat interval. One still unanswered
// when the next is due (a stalled route or instance) ends the stream, which
// re-attaches elsewhere; the local deadline stops the leases if nothing
// answers before it.
func (k *Keeper) heartbeatLoop() {
	defer k.wg.Done()
	ticker := k.c.clock.NewTicker(k.cfg.beatEvery)
	defer ticker.Stop()
	for {
		select {
		case <-k.stop:
			return
		case <-ticker.C():
		}
		k.mu.Lock()
		s := k.stream
		if k.ended || s == nil || !s.attached {
			k.mu.Unlock()
			continue
		}
		if k.beatID != 0 {
			k.mu.Unlock()
			k.c.log(slog.LevelWarn, "leasehold: keeper heartbeat unanswered for a beat interval; re-attaching", "keeper_id", k.cfg.id, "addr", s.addr)
			k.failed(s, status.Error(codes.Unavailable, "a heartbeat was left unanswered for a beat interval"))
			continue
		}
		k.nextID++
		k.beatID, k.beatSent = k.nextID, k.c.clock.Now()
		k.pushLocked(s, &leasev1.KeepRequest{Id: k.beatID, Op: &leasev1.KeepRequest_Heartbeat{Heartbeat: &leasev1.Heartbeat{}}})
		k.mu.Unlock()
	}
}

// checkDeadline runs when the deadline timer fires (and when a lease on
// the keeper finds the deadline passed first): the keeper, with every lease
// on it, is lost once its local deadline has passed; else the timer waits
// for the (later) deadline.
func (k *Keeper) checkDeadline() {
	k.mu.Lock()
	if k.ended {
		k.mu.Unlock()
		return
	}
	if left := k.deadline.Sub(k.c.clock.Now()); left > 0 {
		k.timer.Reset(left)
		k.mu.Unlock()
		return
	}
	msg := "the local deadline passed without a confirmed heartbeat"
	var cause error
	if tried := k.triedLocked(); len(tried) > 0 && k.stream == nil {
		msg += " (the Keep stream tried " + strings.Join(tried, "; ") + ")"
		cause = &UnavailableError{serverError{status.New(codes.Unavailable, strings.Join(tried, "; "))}, tried}
	}
	k.mu.Unlock()
	k.lose(LossDeadline, msg, cause)
}
