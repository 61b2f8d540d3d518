package leasehold

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// Messages of the client's debug log records (WithLogger), for handlers
// that act on them: a confirmed renewal, and a waited grant that arrived
// past its local deadline being confirmed by a second Acquire.
const (
	MsgRenewed    = "leasehold: lease renewed"
	MsgConfirming = "leasehold: waited grant arrived past its local deadline; confirming it with the same run id"
)

// HoldOptions of Client.Hold.
type HoldOptions struct {
	// TTL of the lease; default 10s.
	TTL time.Duration
	// Wait is how long to wait for a held session to become free; default
	// 0: fail at once with *NotAcquiredError.
	Wait time.Duration
	// Holder labels this holder for others ("desktop", "worker-3").
	Holder string
	// RunID is the run's id (a UUID); default a new random one. Reuse one
	// only to retry the same run: its grant is then the same lease, same token.
	RunID string
	// SafetyMargin is taken off every local deadline; default TTL/10.
	SafetyMargin time.Duration
	// RenewInterval is the time between renewals; default a third of
	// TTL − SafetyMargin. At most half of it, so one slow answer does not
	// end the run.
	RenewInterval time.Duration
}

// HandoffRequest is someone asking the holder to finish and release, e.g.
// "continue on this device".
type HandoffRequest struct {
	RequesterHolder string
	Reason          string
	RequestedAt     time.Time
}

type timing struct {
	ttl, margin, renewEvery time.Duration
}

func leaseTiming(o HoldOptions) (timing, error) {
	t := timing{ttl: o.TTL, margin: o.SafetyMargin, renewEvery: o.RenewInterval}
	if t.ttl == 0 {
		t.ttl = 10 * time.Second
	}
	if t.ttl < 0 {
		return t, fmt.Errorf("leasehold: TTL must be positive, got %s", t.ttl)
	}
	if t.margin == 0 {
		t.margin = t.ttl / 10
	}
	if t.margin < 0 || t.margin >= t.ttl {
		return t, fmt.Errorf("leasehold: SafetyMargin must be at least 0 and below TTL (%s), got %s", t.ttl, t.margin)
	}
	usable := t.ttl - t.margin
	if t.renewEvery == 0 {
		t.renewEvery = usable / 3
	}
	if t.renewEvery <= 0 || t.renewEvery > usable/2 {
		return t, fmt.Errorf("leasehold: RenewInterval must be above 0 and at most half of TTL − SafetyMargin (%s), got %s", usable/2, t.renewEvery)
	}
	return t, nil
}

// NewRunID returns a random (version 4) UUID for a run.
func NewRunID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// Lease is a lease this client holds and keeps alive. Its Context ends
// when the lease is lost or released.
type Lease struct {
	client *Client
	key    SessionKey
	runID  string
	token  int64
	timing timing

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu       sync.Mutex
	last     *leasev1.Lease
	deadline time.Time // monotonic: from time.Now()
	lost     *LeaseLostError
	released bool
	timer    *time.Timer
	stop     chan struct{}
	reg      *registration
	handoffs chan HandoffRequest
}

// Context is cancelled the moment the lease is lost (the server says so, a
// renewal is refused, or the local deadline passes without a confirmed
// renewal) or released. context.Cause gives the *LeaseLostError, or
// ErrReleased after Release. Do the lease's work under it.
func (l *Lease) Context() context.Context { return l.ctx }

// Err is the *LeaseLostError once the lease is lost, else nil (also after a
// Release: a run that ended its own lease lost nothing).
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost == nil {
		return nil
	}
	return l.lost
}

// Key is the session held.
func (l *Lease) Key() SessionKey { return l.key }

// RunID is this run's id.
func (l *Lease) RunID() string { return l.runID }

// FencingToken is the lease's token: present it with every write.
func (l *Lease) FencingToken() int64 { return l.token }

// Lease is the lease as last confirmed by the server.
func (l *Lease) Lease() *leasev1.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last
}

// Remaining is the time left before the local deadline, on the monotonic
// clock; 0 once it has passed or the lease has ended.
func (l *Lease) Remaining() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost != nil || l.released {
		return 0
	}
	return max(0, time.Until(l.deadline))
}

// check is nil while the lease may still be presented as held: else the
// *LeaseLostError (the local deadline is read from the clock now, so a
// deadline timer that has not fired yet does not let a call out), or
// ErrReleased.
func (l *Lease) check() error {
	l.mu.Lock()
	switch {
	case l.lost != nil:
		err := l.lost
		l.mu.Unlock()
		return err
	case l.released:
		l.mu.Unlock()
		return ErrReleased
	case !time.Now().Before(l.deadline):
		reg := l.reg
		l.mu.Unlock()
		msg, cause := reg.deadlineLoss()
		l.lose(LossDeadline, msg, cause)
		if err := l.Err(); err != nil {
			return err
		}
		return ErrReleased // released meanwhile
	}
	l.mu.Unlock()
	return nil
}

// HandoffRequests delivers the requests to finish and release. Buffered;
// requests beyond its room are dropped (the first one is what matters).
func (l *Lease) HandoffRequests() <-chan HandoffRequest { return l.handoffs }

// Release ends the lease on the server and cancels its Context with
// ErrReleased. It first waits for the answer to a renewal still on the way
// (bounded by the renewal interval's stall watch, the local deadline and
// half of what ctx leaves, the other half being the Release's): released before that renewal arrives, the lease would be refused
// to it as "released", which the server counts as a lost lease though the
// run ended it itself. After a loss it sends nothing (the run no longer
// holds the lease, and a late release must not be mistaken for a current
// one) and returns the *LeaseLostError. Releasing twice is a no-op.
func (l *Lease) Release(ctx context.Context) error {
	l.mu.Lock()
	if ended, err := l.endedLocked(); ended {
		l.mu.Unlock()
		return err
	}
	// No new renewal from here on; the one on the way is waited for.
	if l.stop != nil {
		close(l.stop)
		l.stop = nil
	}
	reg := l.reg
	l.mu.Unlock()
	if reg != nil {
		// The wait takes at most half of what ctx leaves, so that the
		// Release itself still has the other half.
		wait := ctx
		if deadline, ok := ctx.Deadline(); ok {
			var cancel context.CancelFunc
			wait, cancel = context.WithTimeout(ctx, time.Until(deadline)/2)
			defer cancel()
		}
		select {
		case <-reg.settled():
		case <-l.ctx.Done():
		case <-wait.Done():
		}
	}
	// Cancelled by the caller while waiting: nothing was sent, and the
	// lease is still the caller's to release, so it is renewed again.
	if err := ctx.Err(); err != nil {
		l.mu.Lock()
		if l.lost == nil && !l.released && l.stop == nil && l.reg != nil {
			l.stop = make(chan struct{})
			stop, reg := l.stop, l.reg
			l.mu.Unlock()
			go l.renewLoop(stop, reg)
		} else {
			l.mu.Unlock()
		}
		return err
	}

	l.mu.Lock()
	if ended, err := l.endedLocked(); ended {
		l.mu.Unlock()
		return err
	}
	l.released = true
	l.stopLocked()
	l.mu.Unlock()
	l.cancel(ErrReleased)
	l.client.forget(l)
	_, err := l.client.Release(ctx, l.key, l.runID)
	if err != nil {
		l.client.log(slog.LevelWarn, "leasehold: release failed", "key", l.key.String(), "run_id", l.runID, "err", err)
	}
	return err
}

// endedLocked says whether the lease has ended: lost (with its
// *LeaseLostError) or released (nil), where Release has nothing to do.
// l.mu is held.
func (l *Lease) endedLocked() (bool, error) {
	if l.lost != nil {
		return true, l.lost
	}
	return l.released, nil
}

// stopLocked stops renewing and watching the deadline. l.mu is held.
func (l *Lease) stopLocked() {
	if l.timer != nil {
		l.timer.Stop()
	}
	if l.stop != nil {
		close(l.stop)
		l.stop = nil
	}
	if l.reg != nil {
		l.reg.remove()
	}
}

// lose ends the lease as lost, once; a released lease stays released.
func (l *Lease) lose(reason LossReason, message string, cause error) {
	l.mu.Lock()
	if l.lost != nil || l.released {
		l.mu.Unlock()
		return
	}
	l.lost = &LeaseLostError{Reason: reason, Message: message, Err: cause}
	l.stopLocked()
	lost := l.lost
	l.mu.Unlock()
	l.cancel(lost)
	l.client.forget(l)
	l.client.log(slog.LevelWarn, "leasehold: lease lost", "key", l.key.String(), "run_id", l.runID, "reason", string(reason), "message", message)
}

// renewed is a confirmed renewal of the request sent at sentAt (zero for
// an answer nobody asked for).
func (l *Lease) renewed(lease *leasev1.Lease, sentAt time.Time) {
	l.mu.Lock()
	if l.lost != nil || l.released {
		l.mu.Unlock()
		return
	}
	// L2: a confirmation arriving after the local deadline cannot revive
	// the run: the lease may have expired and been taken meanwhile.
	if !time.Now().Before(l.deadline) {
		l.mu.Unlock()
		l.lose(LossDeadline, "the local deadline passed before a renewal was confirmed", nil)
		return
	}
	l.last = lease
	if !sentAt.IsZero() {
		if next := sentAt.Add(lease.GetRemaining().AsDuration() - l.timing.margin); next.After(l.deadline) {
			l.deadline = next
		}
	}
	left := time.Until(l.deadline)
	l.mu.Unlock()
	if c := l.client; c.debug() {
		c.log(slog.LevelDebug, MsgRenewed, "key", l.key.String(), "run_id", l.runID, "token", lease.GetFencingToken(), "remaining", lease.GetRemaining().AsDuration(), "deadline_in", left)
	}
}

func (l *Lease) handoff(h *leasev1.HandoffRequested) {
	select {
	case l.handoffs <- HandoffRequest{RequesterHolder: h.GetRequesterHolder(), Reason: h.GetReason(), RequestedAt: h.GetRequestedAt().AsTime()}:
	default:
	}
}

// checkDeadline runs when the deadline timer fires: the lease is lost if
// the deadline has passed, else the timer waits for the (later) deadline.
func (l *Lease) checkDeadline() {
	l.mu.Lock()
	if l.lost != nil || l.released {
		l.mu.Unlock()
		return
	}
	left := time.Until(l.deadline)
	if left > 0 {
		l.timer.Reset(left)
		l.mu.Unlock()
		return
	}
	reg := l.reg
	l.mu.Unlock()
	msg, cause := reg.deadlineLoss()
	l.lose(LossDeadline, msg, cause)
}

func (l *Lease) renewLoop(stop <-chan struct{}, reg *registration) {
	ticker := time.NewTicker(l.timing.renewEvery)
	defer ticker.Stop()
	for {
		select {
		case <-stop:
			return
		case <-ticker.C:
			reg.renew()
		}
	}
}

type grant struct {
	lease    *leasev1.Lease
	deadline time.Time
	late     bool
	elapsed  time.Duration
}

// Hold acquires the session's lease (waiting up to o.Wait for it) and keeps
// it alive on the client's shared KeepAlive stream until Release or loss.
// ctx bounds the acquire only. A session held by another run is
// *NotAcquiredError; a grant whose answer arrives after its own local
// deadline is released and returned as *LateGrantError.
func (c *Client) Hold(ctx context.Context, key SessionKey, o HoldOptions) (*Lease, error) {
	t, err := leaseTiming(o)
	if err != nil {
		return nil, err
	}
	if o.Wait < 0 {
		return nil, fmt.Errorf("leasehold: Wait must not be negative, got %s", o.Wait)
	}
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	runID := o.RunID
	if runID == "" {
		runID = NewRunID()
	}
	runID = strings.ToLower(runID)

	attempt := func(wait time.Duration) (grant, error) {
		sentAt := time.Now()
		resp, err := c.Acquire(ctx, key, AcquireOptions{RunID: runID, TTL: t.ttl, Wait: wait, Holder: o.Holder})
		if err != nil {
			return grant{}, err
		}
		arrived := time.Now()
		if !resp.GetAcquired() || resp.GetLease() == nil {
			return grant{}, &NotAcquiredError{Current: resp.GetCurrent()}
		}
		deadline := sentAt.Add(resp.GetLease().GetRemaining().AsDuration() - t.margin)
		return grant{lease: resp.GetLease(), deadline: deadline, late: !arrived.Before(deadline), elapsed: arrived.Sub(sentAt)}, nil
	}
	release := func() {
		rctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.callTimeout, t.ttl))
		defer cancel()
		if _, err := c.Release(rctx, key, runID); err != nil {
			c.log(slog.LevelWarn, "leasehold: release failed", "key", key.String(), "run_id", runID, "err", err)
		}
	}

	g, err := attempt(o.Wait)
	if err != nil {
		// The grant may have happened with its answer lost on the way
		// back; release by run id (a no-op when nothing was granted)
		// rather than leave a lease nobody renews blocking the session.
		var na *NotAcquiredError
		if !errors.As(err, &na) {
			go release()
		}
		return nil, err
	}
	if g.late && o.Wait > 0 {
		// A waited grant is late by construction when the wait was long:
		// confirm it with the same run id (same token, deadline counted
		// from this request) instead of trusting the old answer.
		c.log(slog.LevelDebug, MsgConfirming, "key", key.String(), "run_id", runID, "elapsed", g.elapsed)
		if g, err = attempt(0); err != nil {
			release()
			return nil, err
		}
	}
	if g.late {
		release()
		return nil, &LateGrantError{Lease: g.lease, Elapsed: g.elapsed}
	}

	lctx, cancel := context.WithCancelCause(context.Background())
	l := &Lease{
		client:   c,
		key:      key,
		runID:    runID,
		token:    g.lease.GetFencingToken(),
		timing:   t,
		ctx:      lctx,
		cancel:   cancel,
		last:     g.lease,
		deadline: g.deadline,
		stop:     make(chan struct{}),
		handoffs: make(chan HandoffRequest, 8),
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		cancel(ErrClosed)
		release()
		return nil, ErrClosed
	}
	c.leases[l] = struct{}{}
	c.mu.Unlock()

	l.mu.Lock()
	l.timer = time.AfterFunc(time.Until(l.deadline), l.checkDeadline)
	l.reg = c.keepAlive.register(l)
	stop, reg := l.stop, l.reg
	l.mu.Unlock()
	go l.renewLoop(stop, reg)
	return l, nil
}

func (c *Client) forget(l *Lease) {
	c.mu.Lock()
	delete(c.leases, l)
	c.mu.Unlock()
}

// RunExclusive holds the session's lease while fn runs, with fn's context
// cancelled the moment the lease is lost (or ctx ends), and releases it
// when fn returns (never after a loss). It returns fn's error, joined with
// the *LeaseLostError when the lease was lost first (once: an error of fn's
// that already wraps it, such as context.Cause(ctx), is returned as it is).
func (c *Client) RunExclusive(ctx context.Context, key SessionKey, o HoldOptions, fn func(ctx context.Context, lease *Lease) error) error {
	lease, err := c.Hold(ctx, key, o)
	if err != nil {
		return err
	}
	// fn's context ends with the lease's or the caller's, whichever first.
	work, cancel := context.WithCancelCause(lease.Context())
	stop := context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })
	defer stop()
	defer cancel(nil)
	ferr := fn(work, lease)
	if lost := lease.Err(); lost != nil {
		return withLoss(ferr, lost)
	}
	rctx, rcancel := context.WithTimeout(context.Background(), min(c.cfg.callTimeout, lease.timing.ttl))
	defer rcancel()
	if err := lease.Release(rctx); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			return withLoss(ferr, err)
		}
		// The lease then ends at its deadline; S5 makes that harmless.
		c.log(slog.LevelWarn, "leasehold: release after RunExclusive failed", "key", key.String(), "run_id", lease.runID, "err", err)
	}
	return ferr
}

// withLoss is fn's error joined with the loss, unless it already wraps it
// (fn returned context.Cause of its context): the loss is said once.
func withLoss(ferr, lost error) error {
	if errors.Is(ferr, lost) {
		return ferr
	}
	return errors.Join(ferr, lost)
}
