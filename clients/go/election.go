package leasehold

// Leader election (DESIGN E1) on a session key: an election is the session
// SessionKey{AccountID, SessionID: election} of the account, so it shares
// the data model, quotas, ACLs, audit history and web page of every other
// session. The leader is the run that holds the session's lease; its term
// is the grant's fencing token (S6: strictly increasing per election,
// accepted by every fence); its value is the lease's holder label.
//
// Campaign is Hold (or Keeper.Hold) in a loop: the grant, the late-grant
// refusal, the keep-alive, the local deadline (L2) and the release are
// Hold's, unchanged. What this file adds is the waiting loop (a waiting
// Acquire is bounded by the server's --max-wait), the one-call-per-term
// callbacks, Proclaim, and Observe's gap-free change stream over Watch and
// History.

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// MaxElectionValueLength is the longest value a candidate may advertise, in
// characters: the value is the lease's holder label, and that is the
// server's holder limit.
const MaxElectionValueLength = 64

// MsgCampaignAgain is the message of the warning RunElection logs
// (WithLogger) when a campaign's waiting call was lost and it campaigns
// again after a backoff.
const MsgCampaignAgain = "leasehold: the campaign's waiting call was lost; campaigning again"

// defaultWaitChunk bounds one waiting Acquire of a campaign, below the
// server's default --max-wait (5 minutes).
const defaultWaitChunk = 60 * time.Second

// Leader is the leader of an election, as the server last reported it.
type Leader struct {
	// Value is the advertised value (the lease's holder label).
	Value string
	// Term is the grant's fencing token.
	Term int64
	// RunID is the leader's run id.
	RunID string
	// ExpiresAt is when its lease ends unless renewed, on the database
	// clock; zero when unknown (a term read back from History).
	ExpiresAt time.Time
}

func leaderOf(l *leasev1.Lease) *Leader {
	ld := &Leader{Value: l.GetHolder(), Term: l.GetFencingToken(), RunID: l.GetRunId()}
	if l.GetExpiresAt() != nil {
		ld.ExpiresAt = l.GetExpiresAt().AsTime()
	}
	return ld
}

// StopKind says how a term ended.
type StopKind string

// How a term ends.
const (
	// StopResigned: Resign, RunElection's lead returned, or the lease was
	// released (Client.Close, Keeper.Close).
	StopResigned StopKind = "resigned"
	// StopLost: the lease was lost (StopReason.Err is the *LeaseLostError:
	// revoked, expired, taken over, the local deadline passed, renewals
	// failed, the keeper lost).
	StopLost StopKind = "lost"
	// StopCancelled: RunElection's ctx ended while leading (StopReason.Err
	// is its cause); the lease was released.
	StopCancelled StopKind = "cancelled"
)

// StopReason is why a term ended.
type StopReason struct {
	Kind StopKind
	// Err is the *LeaseLostError for StopLost, the context's cause for
	// StopCancelled, nil for StopResigned.
	Err error
}

// CampaignOptions of Client.Campaign.
type CampaignOptions struct {
	// TTL, SafetyMargin and RenewInterval of the leader's lease, as in
	// HoldOptions (default TTL 10s). Leave them 0 on a keeper: its own apply.
	TTL, SafetyMargin, RenewInterval time.Duration
	// Timeout gives up campaigning after this long with a *NotAcquiredError
	// naming the leader; 0: never.
	Timeout time.Duration
	// WaitChunk is the longest single waiting Acquire: the campaign asks
	// again when it runs out. Keep it at or below the server's --max-wait
	// (default 5m). Default 60s.
	WaitChunk time.Duration
	// Keeper campaigns on this keeper (Client.NewKeeper): the waiting
	// Acquire and the leader's lease ride its Keep stream, its heartbeat
	// keeps the lease, and its TTL, margin and lock-delay apply. The keeper
	// lost while waiting ends the campaign with its *KeeperLostError; lost
	// while leading, it ends the term (StopLost).
	Keeper *Keeper
	// OnStartedLeading is called with the term when this candidate becomes
	// leader, before Campaign returns.
	OnStartedLeading func(term int64)
	// OnStoppedLeading is called exactly once per term that
	// OnStartedLeading began, whatever ended it, as soon as the
	// Leadership's Context ends (before a successor can be granted, L2,
	// unless an operator revoked the term: fences refuse the old term).
	// It must not wait for Resign, which waits for it.
	OnStoppedLeading func(term int64, reason StopReason)
}

// checkElectionValue refuses a value the server would refuse as a holder
// label, before any call.
func checkElectionValue(value string) error {
	if n := utf8.RuneCountInString(value); n > MaxElectionValueLength {
		rule := fmt.Sprintf("must be at most %d characters (it is the lease's holder label), got %d", MaxElectionValueLength, n)
		return &InvalidArgumentError{serverError{status.New(codes.InvalidArgument, "value "+rule)}, "value", rule}
	}
	return nil
}

func (o CampaignOptions) check() error {
	if o.Keeper != nil && (o.TTL != 0 || o.SafetyMargin != 0 || o.RenewInterval != 0) {
		return errors.New("leasehold: TTL, SafetyMargin and RenewInterval are the keeper's when campaigning on one (CampaignOptions.Keeper): leave them 0")
	}
	if o.Keeper == nil {
		if _, err := leaseTiming(HoldOptions{TTL: o.TTL, SafetyMargin: o.SafetyMargin, RenewInterval: o.RenewInterval}); err != nil {
			return err
		}
	}
	if o.Timeout < 0 {
		return fmt.Errorf("leasehold: Timeout must not be negative, got %s", o.Timeout)
	}
	if o.WaitChunk < 0 {
		return fmt.Errorf("leasehold: WaitChunk must not be negative, got %s", o.WaitChunk)
	}
	return nil
}

// Campaign waits until this candidate leads the election key (its
// SessionID is the election's name), advertising value, and returns its
// Leadership (E1).
//
// The wait is the server's waiting Acquire, served in arrival order on one
// instance; it is asked again, with the same run id, whenever one wait
// (WaitChunk) runs out. A grant whose answer arrives after its own local
// deadline is released (or, found ended by the re-acquire that would
// confirm it, dropped) and the campaign goes on with a new run: a run
// whose lease ended never holds the session again (S4). ctx bounds the campaign
// only, as Hold's bounds the acquire: the term ends with Resign or its
// loss. Campaign returns — leaving no lease and no waiter on the server —
// context.Cause(ctx) when ctx ends, the waiting call's error when it fails
// (its connection lost: the server drops the waiter with the call, and the
// client releases by run id in case a grant raced the failure), the
// *KeeperLostError when its keeper is lost, or a *NotAcquiredError naming
// the leader when Timeout passes. It never returns a Leadership without a
// live grant.
func (c *Client) Campaign(ctx context.Context, key SessionKey, value string, o CampaignOptions) (*Leadership, error) {
	if err := checkElectionValue(value); err != nil {
		return nil, err
	}
	if err := o.check(); err != nil {
		return nil, err
	}
	chunk := o.WaitChunk
	if chunk == 0 {
		chunk = defaultWaitChunk
	}
	var giveUp time.Time
	if o.Timeout > 0 {
		giveUp = time.Now().Add(o.Timeout)
	}
	runID := NewRunID()
	var lastSeen *leasev1.Lease
	for {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		wait := chunk
		if !giveUp.IsZero() {
			// The last wait ends at the timeout, so the server's own
			// answer then names the leader.
			wait = max(0, min(wait, time.Until(giveUp)))
		}
		lease, err := c.campaignOnce(ctx, key, value, o, runID, wait)
		if err == nil {
			if ctx.Err() != nil {
				// Cancelled as the grant arrived: released, no term reported.
				c.releaseUnused(lease)
				return nil, context.Cause(ctx)
			}
			if lease.Context().Err() != nil {
				// Lost between the grant and here: not a term. Its run is
				// over; the next attempt is a new run.
				runID = NewRunID()
				continue
			}
			return c.startTerm(lease, value, o), nil
		}
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		if errors.Is(err, ErrLateGrant) || errors.Is(err, ErrLeaseNotHeld) {
			// A late grant, released; or one whose confirming re-acquire
			// found it ended (its answer came after the lease's own
			// deadline). That run never holds the session again (S4): a
			// new run asks again.
			runID = NewRunID()
			continue
		}
		var na *NotAcquiredError
		if errors.As(err, &na) {
			if na.Current != nil {
				lastSeen = na.Current
			}
			if giveUp.IsZero() || time.Now().Before(giveUp) {
				continue
			}
			return nil, &NotAcquiredError{Current: lastSeen, LockDelayUntil: na.LockDelayUntil}
		}
		return nil, err
	}
}

// campaignOnce is one waiting Hold of the campaign, on the keeper or on
// the client's shared KeepAlive stream.
func (c *Client) campaignOnce(ctx context.Context, key SessionKey, value string, o CampaignOptions, runID string, wait time.Duration) (*Lease, error) {
	if o.Keeper != nil {
		return o.Keeper.Hold(ctx, key, WithWait(wait), WithHolder(value), WithRunID(runID))
	}
	return c.Hold(ctx, key, HoldOptions{TTL: o.TTL, SafetyMargin: o.SafetyMargin, RenewInterval: o.RenewInterval, Wait: wait, Holder: value, RunID: runID})
}

// releaseUnused releases a grant no term was made of.
func (c *Client) releaseUnused(lease *Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.callTimeout, lease.timing.ttl))
	defer cancel()
	if err := lease.Release(ctx); err != nil && !errors.Is(err, ErrLeaseLost) {
		c.log(slog.LevelWarn, "leasehold: release of an unused election grant failed", "key", lease.key.String(), "run_id", lease.runID, "err", err)
	}
}

// Leadership is a term of leadership, from Campaign. Do the leader's work
// under Context, and present Lease to fences (WithLease, FencingMetadata).
type Leadership struct {
	c      *Client
	lease  *Lease
	keeper *Keeper
	term   int64

	ctx    context.Context
	cancel context.CancelCauseFunc
	ended  chan struct{}

	onStopped func(term int64, reason StopReason)

	mu     sync.Mutex
	value  string
	reason StopReason
}

// startTerm makes the grant a term: OnStartedLeading, then
// OnStoppedLeading once when the term's Context ends.
func (c *Client) startTerm(lease *Lease, value string, o CampaignOptions) *Leadership {
	ctx, cancel := context.WithCancelCause(lease.Context())
	l := &Leadership{
		c: c, lease: lease, keeper: o.Keeper, term: lease.FencingToken(),
		ctx: ctx, cancel: cancel, ended: make(chan struct{}),
		onStopped: o.OnStoppedLeading, value: value,
	}
	if o.OnStartedLeading != nil {
		o.OnStartedLeading(l.term)
	}
	// Registered after OnStartedLeading: a term lost before it (or in it)
	// still gets its one OnStoppedLeading, after it.
	context.AfterFunc(ctx, l.stopped)
	return l
}

// stopped runs once, when the term's Context ends: it settles why and
// calls OnStoppedLeading.
func (l *Leadership) stopped() {
	cause := context.Cause(l.ctx)
	var lost *LeaseLostError
	var why StopReason
	switch {
	case errors.Is(cause, ErrResigned), errors.Is(cause, ErrReleased):
		why = StopReason{Kind: StopResigned}
	case errors.As(cause, &lost) && lost.Reason == LossReleased:
		why = StopReason{Kind: StopResigned}
	case lost != nil:
		why = StopReason{Kind: StopLost, Err: lost}
	default:
		why = StopReason{Kind: StopCancelled, Err: cause}
	}
	l.mu.Lock()
	l.reason = why
	l.mu.Unlock()
	defer close(l.ended)
	if l.onStopped != nil {
		l.onStopped(l.term, why)
	}
}

// Term is the term: this grant's fencing token. Present it to fences.
func (l *Leadership) Term() int64 { return l.term }

// Key is the election's session key.
func (l *Leadership) Key() SessionKey { return l.lease.key }

// RunID is this candidate's run id.
func (l *Leadership) RunID() string { return l.lease.runID }

// Value is the value advertised now.
func (l *Leadership) Value() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.value
}

// Lease is the leader's lease: WithLease(ctx, l.Lease()) for fenced calls
// (the fencing interceptors refuse to send them once the term is over),
// FencingMetadata(l.Lease()) for the headers.
func (l *Leadership) Lease() *Lease { return l.lease }

// Context is cancelled before the database deadline when leadership can no
// longer be vouched for (lost, revoked, taken over, the local deadline
// passed: context.Cause is the *LeaseLostError), and when the term ends
// any other way (ErrResigned after Resign; RunElection's ctx's cause).
// Stop acting as leader when it ends.
func (l *Leadership) Context() context.Context { return l.ctx }

// Remaining is the time left before the local deadline; 0 once it has
// passed or the term has ended.
func (l *Leadership) Remaining() time.Duration {
	if l.ctx.Err() != nil {
		return 0
	}
	return l.lease.Remaining()
}

// Ended is closed once the term is over and OnStoppedLeading has returned.
func (l *Leadership) Ended() <-chan struct{} { return l.ended }

// StopReason is why the term ended; the zero StopReason until Ended is closed.
func (l *Leadership) StopReason() StopReason {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.reason
}

// check is nil while the term may still act: else why it ended (the
// local deadline read from the clock now, as the fencing interceptors do).
func (l *Leadership) check() error {
	if l.ctx.Err() != nil {
		return context.Cause(l.ctx)
	}
	return l.lease.check()
}

// Proclaim advertises value instead, keeping the term: an idempotent
// Acquire by the same run id (on the keeper when campaigning on one), which
// keeps the token and changes the label. Refused once the term is over
// (the error is why it ended: the *LeaseLostError, ErrResigned, …), and by
// the server when the lease is no longer this run's (S4): a
// *NotAcquiredError naming the holder, the value unchanged.
func (l *Leadership) Proclaim(ctx context.Context, value string) error {
	if err := checkElectionValue(value); err != nil {
		return err
	}
	if err := l.check(); err != nil {
		return err
	}
	// A proclaim still on its way when the term ends is abandoned.
	pctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(l.ctx, func() { cancel(context.Cause(l.ctx)) })
	defer stop()
	key, runID := l.lease.key, l.lease.runID
	var resp *leasev1.AcquireResponse
	var err error
	if l.keeper != nil {
		// A plain Acquire names no keeper: the server would refuse it the
		// lease held on one.
		resp, err = l.keeper.reacquire(pctx, key, runID, value)
	} else {
		resp, err = l.c.Acquire(pctx, key, AcquireOptions{RunID: runID, TTL: l.lease.timing.ttl, Holder: value})
	}
	if err := l.check(); err != nil {
		return err
	}
	if err != nil {
		return err
	}
	if !resp.GetAcquired() || resp.GetLease().GetFencingToken() != l.term {
		return &NotAcquiredError{Current: resp.GetCurrent()}
	}
	l.mu.Lock()
	l.value = value
	l.mu.Unlock()
	return nil
}

// Resign ends the term at once — Context ends with ErrResigned — and, once
// OnStoppedLeading has returned (or ctx ends), releases the lease, so the
// next waiting candidate is granted at once and only after this leader has
// stopped (L2). After a loss it sends nothing and returns nil: the term is
// over either way (StopReason says how). Resigning twice is a no-op. A
// release that ctx cut short is finished in the background: the term has
// ended, and its lease must not stay renewed with nobody leading.
func (l *Leadership) Resign(ctx context.Context) error {
	l.cancel(ErrResigned)
	select {
	case <-l.ended:
	case <-ctx.Done():
	}
	err := l.lease.Release(ctx)
	if err != nil && !errors.Is(err, ErrLeaseLost) && l.lease.Context().Err() == nil {
		go l.c.releaseUnused(l.lease)
	}
	if errors.Is(err, ErrLeaseLost) {
		return nil
	}
	return err
}

// reacquire sends the held lease's run again on the keeper's stream with
// another holder label (Proclaim). Unlike Hold's acquire, a reacquire left
// by its caller is never released when its answer comes: the lease is the
// held one.
func (k *Keeper) reacquire(ctx context.Context, key SessionKey, runID, holder string) (*leasev1.AcquireResponse, error) {
	call, err := k.send(&leasev1.KeepRequest{Op: &leasev1.KeepRequest_Acquire{Acquire: &leasev1.AcquireRequest{
		Key: key.proto(), RunId: runID, Holder: holder,
	}}})
	if err != nil {
		return nil, err
	}
	select {
	case <-call.done:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	if call.err != nil {
		return nil, call.err
	}
	if st := call.resp.GetError(); st != nil {
		return nil, fromStatus(status.FromProto(st).Err())
	}
	return call.resp.GetAcquire(), nil
}

// Leader answers the current leader of the election key, or nil when
// nobody leads.
func (c *Client) Leader(ctx context.Context, key SessionKey) (*Leader, error) {
	lease, err := c.Get(ctx, key)
	if err != nil || lease == nil {
		return nil, err
	}
	return leaderOf(lease), nil
}

// ChangeType says what an ElectionChange is.
type ChangeType string

// The changes Observe yields.
const (
	// ChangeCurrent is the first change: the leader as of when observing
	// began (Leader nil: nobody leads).
	ChangeCurrent ChangeType = "current"
	// ChangeElected: a new term began.
	ChangeElected ChangeType = "elected"
	// ChangeProclaimed: the leader advertised another value in the same term.
	ChangeProclaimed ChangeType = "proclaimed"
	// ChangeEnded: the term ended and nobody leads now; How says how
	// ("resigned", "expired", "revoked"). A term taken over at its expiry
	// shows as the next ChangeElected instead.
	ChangeEnded ChangeType = "ended"
)

// ElectionChange is one change of an election, as Observe yields it.
type ElectionChange struct {
	Type ChangeType
	// Leader is the leader after the change; nil for ChangeEnded, and for
	// ChangeCurrent when nobody leads.
	Leader *Leader
	// Term is the term the change is about (Leader.Term, or the term that
	// ended); 0 for a ChangeCurrent with nobody leading.
	Term int64
	// How a term ended (ChangeEnded): "resigned", "expired" or "revoked".
	How string
}

var endings = map[leasev1.EventType]string{
	leasev1.EventType_EVENT_TYPE_RELEASED: "resigned",
	leasev1.EventType_EVENT_TYPE_EXPIRED:  "expired",
	leasev1.EventType_EVENT_TYPE_REVOKED:  "revoked",
}

// observer is one Observe's view: the leader reported last and the highest
// term seen, by which changes are deduplicated.
type observer struct {
	c       *Client
	key     SessionKey
	current *Leader
	highest int64
	started bool
}

// apply is one event's change, if it is one.
func (o *observer) apply(e *leasev1.Event) (ElectionChange, bool) {
	switch {
	case e.GetType() == leasev1.EventType_EVENT_TYPE_ACQUIRED:
		if e.GetFencingToken() <= o.highest {
			return ElectionChange{}, false
		}
		o.highest = e.GetFencingToken()
		if e.GetLease() != nil {
			o.current = leaderOf(e.GetLease())
		} else {
			// History's events carry no lease: the leader from the event's fields.
			o.current = &Leader{Value: e.GetHolder(), Term: e.GetFencingToken(), RunID: e.GetRunId()}
		}
		return ElectionChange{Type: ChangeElected, Leader: o.current, Term: o.current.Term}, true
	case e.GetType() == leasev1.EventType_EVENT_TYPE_RENEWED && e.GetLease() != nil:
		if o.current == nil || o.current.Term != e.GetFencingToken() || e.GetLease().GetHolder() == o.current.Value {
			return ElectionChange{}, false
		}
		o.current = leaderOf(e.GetLease())
		return ElectionChange{Type: ChangeProclaimed, Leader: o.current, Term: o.current.Term}, true
	}
	how, ok := endings[e.GetType()]
	if !ok || o.current == nil || o.current.Term != e.GetFencingToken() {
		return ElectionChange{}, false
	}
	o.current = nil
	return ElectionChange{Type: ChangeEnded, Term: e.GetFencingToken(), How: how}, true
}

// missed is the events recorded after the last term seen, oldest first.
func (o *observer) missed(ctx context.Context) ([]*leasev1.Event, error) {
	var found []*leasev1.Event
	page := ""
	for {
		events, next, err := o.c.History(ctx, o.key, 100, page)
		if err != nil {
			return nil, err
		}
		for _, e := range events {
			// Newest first: stop at the grant of the last term seen (its
			// end, recorded after it, is kept) or anything older.
			if e.GetFencingToken() < o.highest || (e.GetFencingToken() == o.highest && e.GetType() == leasev1.EventType_EVENT_TYPE_ACQUIRED) {
				next = ""
				break
			}
			found = append(found, e)
		}
		if next == "" {
			break
		}
		page = next
	}
	for i, j := 0, len(found)-1; i < j; i, j = i+1, j-1 {
		found[i], found[j] = found[j], found[i]
	}
	return found, nil
}

// resync reconciles a snapshot: History first, when it may hide a change.
// With an error, the changes already made are returned too, to be yielded.
func (o *observer) resync(ctx context.Context, leases []*leasev1.Lease) ([]ElectionChange, error) {
	var lease *leasev1.Lease
	for _, l := range leases {
		if l.GetKey().GetSessionId() == o.key.SessionID {
			lease = l
		}
	}
	if !o.started {
		o.started = true
		o.current = nil
		if lease != nil {
			o.current = leaderOf(lease)
			o.highest = max(o.highest, lease.GetFencingToken())
		}
		ch := ElectionChange{Type: ChangeCurrent, Leader: o.current}
		if o.current != nil {
			ch.Term = o.current.Term
		}
		return []ElectionChange{ch}, nil
	}
	events, err := o.missed(ctx)
	if err != nil {
		return nil, err
	}
	var changes []ElectionChange
	for _, e := range events {
		if ch, ok := o.apply(e); ok {
			changes = append(changes, ch)
		}
	}
	// What History could not show (trimmed by age): said from the snapshot.
	switch {
	case lease != nil && lease.GetFencingToken() > o.highest:
		o.highest = lease.GetFencingToken()
		o.current = leaderOf(lease)
		changes = append(changes, ElectionChange{Type: ChangeElected, Leader: o.current, Term: o.current.Term})
	case lease == nil && o.current != nil:
		// The snapshot shows nobody, but History (read after it) may show
		// a term granted since: that one still leads, and its end comes on
		// the stream. Only a term that Get also finds over has ended.
		now, err := o.c.Get(ctx, o.key)
		if err != nil {
			// History's changes are made: they are yielded, and the term
			// stays current until a later snapshot settles it.
			return changes, err
		}
		if now.GetFencingToken() != o.current.Term {
			term := o.current.Term
			o.current = nil
			changes = append(changes, ElectionChange{Type: ChangeEnded, Term: term, How: "expired"})
		}
	case lease != nil && o.current != nil && o.current.Term == lease.GetFencingToken() && lease.GetHolder() != o.current.Value:
		o.current = leaderOf(lease)
		changes = append(changes, ElectionChange{Type: ChangeProclaimed, Leader: o.current, Term: o.current.Term})
	}
	return changes, nil
}

// permanent says whether opening the Watch again cannot succeed.
func permanent(err error) bool {
	return errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrPermissionDenied) ||
		errors.Is(err, ErrUnauthenticated) || status.Code(err) == codes.Unimplemented
}

// Observe yields the election's current leader first (ChangeCurrent), then
// every change in order — a new term, a proclaimed value, a term that
// ended with nobody leading — until ctx ends (the iteration then ends) or
// an error that a new Watch cannot mend (bad input, refused credentials or
// permission, a server without Watch), yielded once as the last item. No
// instance answering, at the start as later, is waited out (a backoff of
// 100ms doubling to 2s, full jitter), not yielded.
//
// It rests on Watch with renewals (they carry proclaimed values). Across a
// reconnect (the stream ended or failed: one Get fails over first, and the
// Watch follows it to the instance that answered) and whenever the server
// sends a fresh snapshot mid-stream, the terms granted meanwhile are read
// from History before the snapshot is applied, so no term the server
// recorded is skipped; changes are deduplicated by term, so none is yielded
// twice. A term History shows that the snapshot does not may have begun
// after it: it is said to have ended only when a Get finds it no longer
// held. Terms granted before Observe began are not changes.
func (c *Client) Observe(ctx context.Context, key SessionKey) iter.Seq2[ElectionChange, error] {
	return func(yield func(ElectionChange, error) bool) {
		o := &observer{c: c, key: key}
		failures := 0
		// Every grant committed before this read has a token at most
		// this (S6), and every later one reaches the Watch opened after
		// it, or its snapshot. Asked again, as a Watch is, while no
		// instance answers.
		for {
			_, highest, err := c.CheckFence(ctx, key, 1)
			if err == nil {
				o.highest = highest
				break
			}
			if ctx.Err() != nil {
				return
			}
			if permanent(err) {
				yield(ElectionChange{}, err)
				return
			}
			failures++
			if !pause(ctx, reconnectDelay(failures)) {
				return
			}
		}
		failures = 0
		for reconnecting := false; ctx.Err() == nil; reconnecting = true {
			failure := o.watch(ctx, reconnecting, func(ch ElectionChange) bool {
				failures = 0
				return yield(ch, nil)
			})
			if failure == errStopped || ctx.Err() != nil {
				return
			}
			if failure != nil && permanent(failure) {
				yield(ElectionChange{}, failure)
				return
			}
			// The stream ended or failed: open it again after a short
			// backoff.
			failures++
			if !pause(ctx, reconnectDelay(failures)) {
				return
			}
		}
	}
}

// errStopped: the caller stopped iterating.
var errStopped = errors.New("leasehold: observe stopped by its caller")

// watch runs one Watch to its end, handing each change to emit; it returns
// why the Watch ended (errStopped when emit said stop).
func (o *observer) watch(ctx context.Context, reconnecting bool, emit func(ElectionChange) bool) error {
	if reconnecting {
		// The client's streams go to the instance that answered its last
		// unary call, and unary calls fail over: one Get moves the Watch
		// to an instance that answers.
		if _, err := o.c.Get(ctx, o.key); err != nil {
			return err
		}
	}
	for resp, err := range o.c.Watch(ctx, o.key, WatchOptions{IncludeRenewals: true}) {
		if err != nil {
			return err
		}
		var changes []ElectionChange
		if snap := resp.GetSnapshot(); snap != nil {
			changes, err = o.resync(ctx, snap.GetLeases())
		} else if e := resp.GetEvent(); e != nil && o.started {
			if ch, ok := o.apply(e); ok {
				changes = append(changes, ch)
			}
		}
		for _, ch := range changes {
			if !emit(ch) {
				return errStopped
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// reconnectDelay is the backoff before the nth attempt again in a row:
// 100ms doubling to 2s, full jitter.
func reconnectDelay(failures int) time.Duration {
	bound := min(2*time.Second, 100*time.Millisecond<<min(failures, 5))
	return time.Duration(rand.Int64N(int64(bound) + 1))
}

// pause waits d, or less when ctx ends first (false then).
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// ElectionOptions of Client.RunElection.
type ElectionOptions struct {
	CampaignOptions
	// OnNewLeader is called for every change of leader and of its value
	// (Observe's ChangeCurrent with a leader, ChangeElected and
	// ChangeProclaimed), this candidate's own terms included. It runs on a
	// goroutine of its own, in the order of the changes.
	OnNewLeader func(leader Leader)
	// Once stops after one term; default: campaign again after each.
	Once bool
}

// RunElection campaigns, runs lead while leading (its ctx is the
// Leadership's Context: stop when it ends), resigns when lead returns, and
// campaigns again (unless Once) until ctx ends; it then returns nil. ctx
// ending while leading ends the term (StopCancelled) and releases the
// lease. A campaign whose waiting call was lost (*UnavailableError,
// DEADLINE_EXCEEDED: an instance gone, a connection reset or stalled) is
// started again after a backoff (100ms doubling to 2s, full jitter); any
// other campaign error is returned, and so is an error of lead's, unless
// it is only the end of its term (ctx.Err() or context.Cause(ctx) of the
// term, returned after the term ended).
func (c *Client) RunElection(ctx context.Context, key SessionKey, value string, o ElectionOptions, lead func(ctx context.Context, l *Leadership) error) error {
	if err := checkElectionValue(value); err != nil {
		return err
	}
	if err := o.check(); err != nil {
		return err
	}
	watching, stopWatching := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stopWatching()
	if o.OnNewLeader != nil {
		wg.Go(func() {
			for ch, err := range c.Observe(watching, key) {
				if err != nil {
					c.log(slog.LevelWarn, "leasehold: observing the election failed", "key", key.String(), "err", err)
					return
				}
				if ch.Leader != nil {
					o.OnNewLeader(*ch.Leader)
				}
			}
		})
	}
	failures := 0
	for terms := 0; ctx.Err() == nil && (terms == 0 || !o.Once); {
		l, err := c.Campaign(ctx, key, value, o.CampaignOptions)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if !errors.Is(err, ErrUnavailable) && !errors.Is(err, context.DeadlineExceeded) {
				return err
			}
			// The waiting call's connection or instance went away:
			// campaign again, after a backoff with full jitter.
			failures++
			c.log(slog.LevelWarn, MsgCampaignAgain, "key", key.String(), "err", err, "attempt", failures)
			if !pause(ctx, reconnectDelay(failures)) {
				return nil
			}
			continue
		}
		failures = 0
		terms++
		if err := l.run(ctx, lead); err != nil {
			return err
		}
	}
	return nil
}

// run is one term of RunElection: lead under the term's Context, ended
// too by ctx (StopCancelled), then Resign.
func (l *Leadership) run(ctx context.Context, lead func(ctx context.Context, l *Leadership) error) error {
	stop := context.AfterFunc(ctx, func() { l.cancel(context.Cause(ctx)) })
	defer stop()
	err := lead(l.ctx, l)
	endedFirst := l.ctx.Err() != nil
	rctx, cancel := context.WithTimeout(context.Background(), min(l.c.cfg.callTimeout, l.lease.timing.ttl))
	defer cancel()
	if rerr := l.Resign(rctx); rerr != nil {
		l.c.log(slog.LevelWarn, "leasehold: resign after a term failed", "key", l.lease.key.String(), "run_id", l.lease.runID, "err", rerr)
	}
	if err != nil && endedFirst && (errors.Is(err, context.Canceled) || errors.Is(err, context.Cause(l.ctx))) {
		return nil
	}
	return err
}
