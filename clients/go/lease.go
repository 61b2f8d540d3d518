package leasehold

import (
	"context"
	"log/slog"
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

// HandoffRequest is someone asking the holder to finish and release, e.g.
// "continue on this device".
type HandoffRequest struct {
	RequesterHolder string
	Reason          string
	RequestedAt     time.Time
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
	deadline time.Time // monotonic: from clock.Now()
	lost     *LeaseLostError
	released bool
	timer    timer
	stop     chan struct{}
	reg      *registration
	handoffs chan HandoffRequest

	// keeper is the keeper the lease was acquired on (Keeper.Hold), nil
	// for a lease of its own. A keeper's lease has no renewals, timer or
	// registration: its local deadline is the keeper's.
	keeper *Keeper
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
	return max(0, l.deadlineLocked().Sub(l.client.clock.Now()))
}

// deadlineLocked is the local deadline: the keeper's for a lease on a
// keeper (l.mu, then the keeper's lock: the keeper never takes a lease's
// lock while holding its own). l.mu is held.
func (l *Lease) deadlineLocked() time.Time {
	if l.keeper != nil {
		return l.keeper.localDeadline()
	}
	return l.deadline
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
	case !l.client.clock.Now().Before(l.deadlineLocked()):
		reg, k := l.reg, l.keeper
		l.mu.Unlock()
		if k != nil {
			// The keeper's deadline: every lease on it is lost with it.
			k.checkDeadline()
		} else {
			msg, cause := reg.deadlineLoss()
			l.lose(LossDeadline, msg, cause)
		}
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
	if l.keeper != nil {
		return l.keeper.release(ctx, l)
	}
	reg, ended, err := l.stopRenewing()
	if ended {
		return err
	}
	if reg != nil {
		l.awaitRenewal(ctx, reg)
	}
	// Cancelled by the caller while waiting: nothing was sent, and the
	// lease is still the caller's to release, so it is renewed again.
	if err := ctx.Err(); err != nil {
		l.resumeRenewing()
		return err
	}
	if ended, err := l.markReleased(); ended {
		return err
	}
	l.cancel(ErrReleased)
	l.client.forget(l)
	_, err = l.client.Release(ctx, l.key, l.runID)
	if err != nil {
		l.client.log(slog.LevelWarn, "leasehold: release failed", "key", l.key.String(), "run_id", l.runID, "err", err)
	}
	return err
}

// stopRenewing sends no new renewal from here on (the one on the way is
// awaited) and returns the lease's registration, unless the lease has ended
// already (ended, with the *LeaseLostError or nil after a Release).
func (l *Lease) stopRenewing() (reg *registration, ended bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ended, err := l.endedLocked(); ended {
		return nil, true, err
	}
	if l.stop != nil {
		close(l.stop)
		l.stop = nil
	}
	return l.reg, false, nil
}

// awaitRenewal waits until no renewal of the lease is on the way, taking
// at most half of what ctx leaves, so that the Release itself still has the
// other half.
func (l *Lease) awaitRenewal(ctx context.Context, reg *registration) {
	wait := ctx
	if deadline, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		// ctx's deadline is on the real clock, not the client's.
		wait, cancel = context.WithTimeout(ctx, time.Until(deadline)/2)
		defer cancel()
	}
	select {
	case <-reg.settled():
	case <-l.ctx.Done():
	case <-wait.Done():
	}
}

// resumeRenewing renews again a lease whose Release was cancelled before
// it sent anything.
func (l *Lease) resumeRenewing() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost == nil && !l.released && l.stop == nil && l.reg != nil {
		l.stop = make(chan struct{})
		go l.renewLoop(l.stop, l.reg)
	}
}

// markReleased marks the lease released and stops keeping it alive, unless
// it ended meanwhile (ended, as stopRenewing says).
func (l *Lease) markReleased() (ended bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ended, err := l.endedLocked(); ended {
		return true, err
	}
	l.released = true
	l.stopLocked()
	return false, nil
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
	if !l.client.clock.Now().Before(l.deadline) {
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
	left := l.deadline.Sub(l.client.clock.Now())
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
	left := l.deadline.Sub(l.client.clock.Now())
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
	ticker := l.client.clock.NewTicker(l.timing.renewEvery)
	defer ticker.Stop()
	for {
		select {
		case <-stop:
			return
		case <-ticker.C():
			reg.renew()
		}
	}
}

// newLease is the Lease of a grant, not yet kept alive (start).
func newLease(c *Client, key SessionKey, runID string, t timing, g grant) *Lease {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &Lease{
		client:   c,
		key:      key,
		runID:    runID,
		token:    g.lease.GetFencingToken(),
		timing:   t,
		ctx:      ctx,
		cancel:   cancel,
		last:     g.lease,
		deadline: g.deadline,
		stop:     make(chan struct{}),
		handoffs: make(chan HandoffRequest, 8),
	}
}

// start keeps the lease alive: the deadline timer, its place on the shared
// KeepAlive stream and the renewal ticker. The client counts the lease
// before it starts (Client.track), so a Close in between may have released
// it already: it is then not kept alive. A Release under way (l.stop nil)
// either ends it (stopLocked) or, cancelled, starts the ticker
// (resumeRenewing).
func (l *Lease) start() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost != nil || l.released {
		return
	}
	l.timer = l.client.clock.AfterFunc(l.deadline.Sub(l.client.clock.Now()), l.checkDeadline)
	l.reg = l.client.keepAlive.register(l)
	if l.stop != nil {
		go l.renewLoop(l.stop, l.reg)
	}
}
