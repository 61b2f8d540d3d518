package leasehold

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
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

// grant is an Acquire's answer that granted the lease, with the local
// deadline counted from the request's send time.
type grant struct {
	lease    *leasev1.Lease
	deadline time.Time
	late     bool
	elapsed  time.Duration
}

// acquisition is one Hold taking its lease: the run, its timing, and the
// steps from the first Acquire to a lease kept alive.
type acquisition struct {
	c      *Client
	key    SessionKey
	runID  string
	timing timing
	holder string
}

// Hold acquires the session's lease (waiting up to o.Wait for it) and keeps
// it alive on the client's shared KeepAlive stream until Release or loss.
// ctx bounds the acquire only. A session held by another run is
// *NotAcquiredError; a grant whose answer arrives after its own local
// deadline is released and returned as *LateGrantError.
func (c *Client) Hold(ctx context.Context, key SessionKey, o HoldOptions) (*Lease, error) {
	a, err := c.newAcquisition(key, o)
	if err != nil {
		return nil, err
	}
	g, err := a.tryAcquire(ctx, o.Wait)
	if err != nil {
		return nil, err
	}
	return a.keep(g)
}

// newAcquisition checks a Hold's options and that the client is open, and
// settles the run id.
func (c *Client) newAcquisition(key SessionKey, o HoldOptions) (*acquisition, error) {
	t, err := leaseTiming(o)
	if err != nil {
		return nil, err
	}
	if o.Wait < 0 {
		return nil, fmt.Errorf("leasehold: Wait must not be negative, got %s", o.Wait)
	}
	if c.isClosed() {
		return nil, ErrClosed
	}
	runID := o.RunID
	if runID == "" {
		runID = NewRunID()
	}
	return &acquisition{c: c, key: key, runID: strings.ToLower(runID), timing: t, holder: o.Holder}, nil
}

// tryAcquire takes the lease, waiting up to wait: a waited grant that
// arrived past its local deadline is confirmed, a late one released.
func (a *acquisition) tryAcquire(ctx context.Context, wait time.Duration) (grant, error) {
	g, err := a.acquire(ctx, wait)
	if err != nil {
		// The grant may have happened with its answer lost on the way
		// back; release by run id (a no-op when nothing was granted)
		// rather than leave a lease nobody renews blocking the session.
		var na *NotAcquiredError
		if !errors.As(err, &na) {
			go a.release()
		}
		return grant{}, err
	}
	if g.late && wait > 0 {
		// A waited grant is late by construction when the wait was long:
		// confirm it with the same run id (same token, deadline counted
		// from this request) instead of trusting the old answer.
		a.c.log(slog.LevelDebug, MsgConfirming, "key", a.key.String(), "run_id", a.runID, "elapsed", g.elapsed)
		if g, err = a.acquire(ctx, 0); err != nil {
			a.release()
			return grant{}, err
		}
	}
	if g.late {
		a.release()
		return grant{}, &LateGrantError{Lease: g.lease, Elapsed: g.elapsed}
	}
	return g, nil
}

// acquire sends one Acquire with the run id, and counts the grant's local
// deadline from the request's send time.
func (a *acquisition) acquire(ctx context.Context, wait time.Duration) (grant, error) {
	sentAt := a.c.clock.Now()
	resp, err := a.c.Acquire(ctx, a.key, AcquireOptions{RunID: a.runID, TTL: a.timing.ttl, Wait: wait, Holder: a.holder})
	if err != nil {
		return grant{}, err
	}
	arrived := a.c.clock.Now()
	if !resp.GetAcquired() || resp.GetLease() == nil {
		return grant{}, notAcquired(resp)
	}
	deadline := sentAt.Add(resp.GetLease().GetRemaining().AsDuration() - a.timing.margin)
	return grant{lease: resp.GetLease(), deadline: deadline, late: !arrived.Before(deadline), elapsed: arrived.Sub(sentAt)}, nil
}

// release ends whatever the run was granted (by run id: a no-op when
// nothing was), logging a failure: that grant then ends at its deadline.
func (a *acquisition) release() {
	rctx, cancel := context.WithTimeout(context.Background(), min(a.c.cfg.callTimeout, a.timing.ttl))
	defer cancel()
	if _, err := a.c.Release(rctx, a.key, a.runID); err != nil {
		a.c.log(slog.LevelWarn, "leasehold: release failed", "key", a.key.String(), "run_id", a.runID, "err", err)
	}
}

// keep makes the grant a Lease the client holds and keeps alive; a client
// closed meanwhile releases the grant instead.
func (a *acquisition) keep(g grant) (*Lease, error) {
	l := newLease(a.c, a.key, a.runID, a.timing, g)
	if !a.c.track(l) {
		l.cancel(ErrClosed)
		a.release()
		return nil, ErrClosed
	}
	l.start()
	return l, nil
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
	return runHeld(ctx, c, lease, fn)
}

// runHeld runs fn under the held lease's context (ended by the lease's loss
// or ctx), then releases the lease unless it was lost: RunExclusive's part
// after the acquire, shared by Client.RunExclusive and Keeper.RunExclusive.
func runHeld(ctx context.Context, c *Client, lease *Lease, fn func(ctx context.Context, lease *Lease) error) error {
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
		c.log(slog.LevelWarn, "leasehold: release after RunExclusive failed", "key", lease.key.String(), "run_id", lease.runID, "err", err)
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
