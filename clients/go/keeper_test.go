package leasehold_test

// Keepers against real servers (docs/keepers.md, K1, K2, L2): the stories of
// docs/clients.md's keeper rows. The deadline's rules on a clock the test
// moves are in keeper_deadline_test.go.

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// keeperTTL is short enough for a quick story and long enough that a
// loaded two-core machine keeps the heartbeats (every second) inside it.
const keeperTTL = 3 * time.Second

func newKeeper(t *testing.T, c *leasehold.Client, opts ...leasehold.KeeperOption) *leasehold.Keeper {
	t.Helper()
	opts = append([]leasehold.KeeperOption{leasehold.WithKeeperTTL(keeperTTL), leasehold.WithKeeperHolder("go-keeper-tests")}, opts...)
	k, err := c.NewKeeper(context.Background(), account, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k.Close(context.Background()) })
	return k
}

func holdOn(t *testing.T, k *leasehold.Keeper, n int) ([]leasehold.SessionKey, []*leasehold.Lease) {
	t.Helper()
	keys := make([]leasehold.SessionKey, n)
	leases := make([]*leasehold.Lease, n)
	for i := range n {
		keys[i] = freshKey(t)
		l, err := k.Hold(context.Background(), keys[i])
		if err != nil {
			t.Fatal(err)
		}
		if l.Lease().GetKeeperId() != k.ID() {
			t.Fatalf("lease %d: keeper_id %q, want the keeper's %q", i, l.Lease().GetKeeperId(), k.ID())
		}
		leases[i] = l
	}
	return keys, leases
}

// serverExpiry is the keeper's deadline on the database clock, as last
// confirmed.
func serverExpiry(k *leasehold.Keeper) time.Time { return k.State().GetExpiresAt().AsTime() }

// K1: one heartbeat keeps every lease on the keeper past the deadline the
// open gave them (each still valid in the database, same run and token,
// on the keeper); Close releases them all (each Context ends with
// ErrReleased, the database holds none) and leaves no goroutine behind.
func TestKeeperOneHeartbeatKeepsEveryLeaseAndCloseReleasesThemAll(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	c, err := leasehold.Dial(context.Background(), []string{shared.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	k, err := c.NewKeeper(context.Background(), account, leasehold.WithKeeperTTL(keeperTTL))
	if err != nil {
		t.Fatal(err)
	}
	keys, leases := holdOn(t, k, 20)
	opened := serverExpiry(k)
	testenv.WaitFor(t, 4*keeperTTL, "heartbeats moving the keeper's deadline a TTL past the open's", func() bool {
		return serverExpiry(k).After(opened.Add(keeperTTL))
	})
	for i, key := range keys {
		got, err := c.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if got.GetRunId() != leases[i].RunID() || got.GetFencingToken() != leases[i].FencingToken() || got.GetKeeperId() != k.ID() {
			t.Fatalf("lease %d past the open's deadline: Get = %v, want run %s token %d on keeper %s", i, got, leases[i].RunID(), leases[i].FencingToken(), k.ID())
		}
		if !got.GetExpiresAt().AsTime().After(opened) || leases[i].Err() != nil {
			t.Fatalf("lease %d: expires %v (open's deadline %v), Err %v; want kept by the heartbeats", i, got.GetExpiresAt().AsTime(), opened, leases[i].Err())
		}
	}
	if err := k.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := context.Cause(k.Context()); !errors.Is(got, leasehold.ErrKeeperClosed) || k.Err() != nil {
		t.Fatalf("keeper after Close: cause %v, Err %v; want ErrKeeperClosed and no loss", got, k.Err())
	}
	for i, l := range leases {
		if got := context.Cause(l.Context()); !errors.Is(got, leasehold.ErrReleased) || l.Err() != nil {
			t.Fatalf("lease %d after Close: cause %v, Err %v; want ErrReleased and no loss", i, got, l.Err())
		}
		if got, err := c.Get(context.Background(), keys[i]); err != nil || got != nil {
			t.Fatalf("lease %d after Close: Get = %v, %v; want not held", i, got, err)
		}
		if n := countEvents(history(t, c, keys[i]), leasev1.EventType_EVENT_TYPE_RELEASED, l.RunID()); n != 1 {
			t.Fatalf("lease %d: %d RELEASED events, want 1", i, n)
		}
	}
	if _, err := k.Hold(context.Background(), freshKey(t)); !errors.Is(err, leasehold.ErrKeeperClosed) {
		t.Fatalf("Hold after Close = %v, want ErrKeeperClosed", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}

// L2, K1: every route of the keeper stalls; every lease on it ends at the
// keeper's local deadline, all at once, while the database still counts
// each valid; nothing is released after the loss.
func TestKeeperStalledHeartbeatStopsEveryLeaseBeforeTheDatabaseDeadline(t *testing.T) {
	p := testenv.StartProxy(t, shared.Addr)
	k := newKeeper(t, dial(t, []string{p.Addr}))
	direct := dial(t, []string{shared.Addr})
	keys, leases := holdOn(t, k, 5)
	stalledAt := time.Now()
	p.Stall()
	waitDone(t, k.Context(), 3*keeperTTL, "keeper context after the stall")
	for i, l := range leases {
		select {
		case <-l.Context().Done():
		default:
			t.Fatalf("lease %d: Context not done with its keeper's loss", i)
		}
		if lost := lostCause(t, l); lost.Reason != leasehold.LossDeadline || !errors.Is(lost, leasehold.ErrKeeperLost) {
			t.Fatalf("lease %d: loss %v, want reason deadline wrapping ErrKeeperLost", i, lost)
		}
	}
	for i, key := range keys {
		got, err := direct.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if got.GetRunId() != leases[i].RunID() || got.GetRemaining().AsDuration() <= 0 {
			t.Fatalf("lease %d: Get right after the stop = %v, want it still valid in the database", i, got)
		}
	}
	var lost *leasehold.KeeperLostError
	if !errors.As(k.Err(), &lost) || lost.Reason != leasehold.LossDeadline {
		t.Fatalf("keeper Err() = %v, want a *KeeperLostError (deadline)", k.Err())
	}
	t.Logf("stall to stop %s", time.Since(stalledAt).Round(time.Millisecond))
	if err := leases[0].Release(context.Background()); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("Release after the keeper's loss = %v, want the *LeaseLostError", err)
	}
	p.Resume()
	if n := countEvents(history(t, direct, keys[0]), leasev1.EventType_EVENT_TYPE_RELEASED, leases[0].RunID()); n != 0 {
		t.Fatalf("%d RELEASED events after the loss, want none", n)
	}
}

// K1: the instance carrying the keeper's stream stops; the keeper
// re-attaches (same id) to the other instance and keeps every lease:
// heartbeats through it carry each past the deadline it had, same run and
// token, and the keeper takes a new lease there.
func TestKeeperReattachesOnAnotherInstanceKeepingEveryLease(t *testing.T) {
	a, b := testenv.StartServer(t), testenv.StartServer(t)
	c := dial(t, []string{a.Addr, b.Addr})
	k := newKeeper(t, c)
	direct := dial(t, []string{b.Addr})
	keys, leases := holdOn(t, k, 5)
	a.Stop()
	stoppedAt := serverExpiry(k)
	testenv.WaitFor(t, 4*keeperTTL, "heartbeats through the other instance moving the keeper's deadline a TTL on", func() bool {
		return serverExpiry(k).After(stoppedAt.Add(keeperTTL))
	})
	if err := k.Err(); err != nil {
		t.Fatalf("keeper lost across the re-attach: %v", err)
	}
	for i, key := range keys {
		got, err := direct.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if got.GetRunId() != leases[i].RunID() || got.GetFencingToken() != leases[i].FencingToken() || got.GetKeeperId() != k.ID() || !got.GetExpiresAt().AsTime().After(stoppedAt) {
			t.Fatalf("lease %d after the re-attach: Get = %v, want run %s token %d on keeper %s past %v", i, got, leases[i].RunID(), leases[i].FencingToken(), k.ID(), stoppedAt)
		}
		if leases[i].Err() != nil || leases[i].Context().Err() != nil {
			t.Fatalf("lease %d ended across the re-attach: %v", i, leases[i].Err())
		}
	}
	if _, err := k.Hold(context.Background(), freshKey(t)); err != nil {
		t.Fatalf("Hold after the re-attach = %v, want a lease", err)
	}
}

// K1: the keeper's stream is cut under it (its connection closed); it
// re-attaches over a new one and keeps every lease.
func TestKeeperReattachesAfterACutStreamKeepingEveryLease(t *testing.T) {
	p := testenv.StartProxy(t, shared.Addr)
	k := newKeeper(t, dial(t, []string{p.Addr}))
	direct := dial(t, []string{shared.Addr})
	keys, leases := holdOn(t, k, 3)
	accepted := p.Accepted()
	p.Cut()
	cutAt := serverExpiry(k)
	testenv.WaitFor(t, 4*keeperTTL, "a new connection and heartbeats on it moving the keeper's deadline a TTL on", func() bool {
		return p.Accepted() > accepted && serverExpiry(k).After(cutAt.Add(keeperTTL))
	})
	for i, key := range keys {
		got, err := direct.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if got.GetRunId() != leases[i].RunID() || got.GetFencingToken() != leases[i].FencingToken() || leases[i].Err() != nil {
			t.Fatalf("lease %d after the cut: Get = %v, Err %v; want run %s token %d kept", i, got, leases[i].Err(), leases[i].RunID(), leases[i].FencingToken())
		}
	}
}

// K2: a keeper with a lock-delay expires (its client stalled); once the
// database deadline has passed, its key is held by no lease, and a refused
// acquire and Get say until when, on another keeper's stream and unary; a
// waiting Hold is granted no earlier.
func TestKeeperLockDelayIsVisible(t *testing.T) {
	const delay = 4 * time.Second
	p := testenv.StartProxy(t, shared.Addr)
	k := newKeeper(t, dial(t, []string{p.Addr}), leasehold.WithLockDelay(delay))
	keys, _ := holdOn(t, k, 1)
	key := keys[0]
	other := newKeeper(t, dial(t, []string{shared.Addr}))
	p.Stall()
	waitDone(t, k.Context(), 3*keeperTTL, "keeper context after the stall")
	var until time.Time
	testenv.WaitFor(t, 3*keeperTTL, "the database deadline to pass, Get naming the lock-delay", func() bool {
		resp, err := other.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetHeld() || resp.GetLockDelayUntil() == nil {
			return false
		}
		until = resp.GetLockDelayUntil().AsTime()
		return true
	})
	_, err := other.Hold(context.Background(), key)
	var na *leasehold.NotAcquiredError
	if !errors.As(err, &na) || na.Current != nil || !na.LockDelayUntil.Equal(until) {
		t.Fatalf("keeper Hold in the lock-delay = %v, want a *NotAcquiredError with LockDelayUntil %v and no current lease", err, until)
	}
	direct := dial(t, []string{shared.Addr})
	_, err = direct.Hold(context.Background(), key, holdOptions)
	if !errors.As(err, &na) || na.Current != nil || !na.LockDelayUntil.Equal(until) {
		t.Fatalf("Client.Hold in the lock-delay = %v, want a *NotAcquiredError with LockDelayUntil %v and no current lease", err, until)
	}
	if got, err := direct.Inspect(context.Background(), key); err != nil || got.GetHeld() || !got.GetLockDelayUntil().AsTime().Equal(until) {
		t.Fatalf("Inspect in the lock-delay = %v, %v; want not held, lock_delay_until %v", got, err, until)
	}
	l, err := other.Hold(context.Background(), key, leasehold.WithWait(3*delay))
	if err != nil {
		t.Fatal(err)
	}
	if acquired := l.Lease().GetAcquiredAt().AsTime(); acquired.Before(until) {
		t.Fatalf("granted at %v, want no earlier than the lock-delay's end %v", acquired, until)
	}
	t.Logf("lock-delay until %v, granted at %v", until, l.Lease().GetAcquiredAt().AsTime())
}

// K1: an admin's Revoke of one lease on the keeper ends only that lease
// (lease_lost); a RevokeKeeper ends every other lease on it at once, and the
// keeper, with reason revoked.
func TestKeeperRevokedEndsEveryLeaseAndALeaseRevokeOnlyThatOne(t *testing.T) {
	k := newKeeper(t, dial(t, []string{shared.Addr}))
	adm := admin(t, shared)
	keys, leases := holdOn(t, k, 4)
	if revoked, err := adm.Revoke(context.Background(), keys[0], "one lease"); err != nil || !revoked {
		t.Fatalf("Revoke = %v, %v; want revoked", revoked, err)
	}
	waitDone(t, leases[0].Context(), 2*keeperTTL, "the revoked lease's context")
	if lost := lostCause(t, leases[0]); lost.Reason != leasehold.LossRevoked || errors.Is(lost, leasehold.ErrKeeperLost) {
		t.Fatalf("revoked lease: loss %v, want revoked, not the keeper's", lost)
	}
	for i, l := range leases[1:] {
		if l.Err() != nil || l.Context().Err() != nil {
			t.Fatalf("lease %d ended with the revoke of another: %v", i+1, l.Err())
		}
	}
	if k.Err() != nil {
		t.Fatalf("keeper ended with the revoke of one lease: %v", k.Err())
	}
	revoked, n, err := adm.RevokeKeeper(context.Background(), account, k.ID(), "maintenance")
	if err != nil || !revoked || n != 3 {
		t.Fatalf("RevokeKeeper = %v, %d, %v; want revoked, 3 leases", revoked, n, err)
	}
	waitDone(t, k.Context(), 2*keeperTTL, "the revoked keeper's context")
	var klost *leasehold.KeeperLostError
	if !errors.As(k.Err(), &klost) || klost.Reason != leasehold.LossRevoked {
		t.Fatalf("keeper Err() = %v, want a *KeeperLostError (revoked)", k.Err())
	}
	for i, l := range leases[1:] {
		select {
		case <-l.Context().Done():
		default:
			t.Fatalf("lease %d: Context not done when its keeper's is", i+1)
		}
		if lost := lostCause(t, l); lost.Reason != leasehold.LossRevoked || !errors.Is(lost, leasehold.ErrKeeperLost) {
			t.Fatalf("lease %d: loss %v, want revoked wrapping ErrKeeperLost", i+1, lost)
		}
	}
}

// S5 on a keeper: a Hold whose ctx ends while the server still waits for
// the session gives that wait up (a release of its run follows the acquire
// on the stream): the run is never granted the session once it is free,
// and the next candidate is. Bad input in one request is that request's
// error, and the keeper goes on.
func TestKeeperHoldLeftWhileWaitingGivesTheWaitUp(t *testing.T) {
	k := newKeeper(t, dial(t, []string{shared.Addr}))
	other := newKeeper(t, dial(t, []string{shared.Addr}))
	direct := dial(t, []string{shared.Addr})
	keys, leases := holdOn(t, other, 1)
	key := keys[0]

	_, err := k.Hold(context.Background(), leasehold.SessionKey{AccountID: account, SessionID: ""})
	var bad *leasehold.InvalidArgumentError
	if !errors.As(err, &bad) || bad.Field == "" {
		t.Fatalf("Hold with an empty session id = %v, want an *InvalidArgumentError naming the field", err)
	}

	runID := leasehold.NewRunID()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := k.Hold(ctx, key, leasehold.WithWait(time.Minute), leasehold.WithRunID(runID)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Hold past its ctx's deadline = %v, want context.DeadlineExceeded", err)
	}
	// Answered after the release that gave the wait up, sent before it on
	// the same stream.
	if _, err := k.Get(context.Background(), key); err != nil {
		t.Fatalf("Get on the keeper after the abandoned Hold = %v", err)
	}
	if err := leases[0].Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	next, err := k.Hold(context.Background(), key, leasehold.WithWait(10*time.Second))
	if err != nil {
		t.Fatalf("Hold of the released session = %v, want a lease", err)
	}
	if n := countEvents(history(t, direct, key), leasev1.EventType_EVENT_TYPE_ACQUIRED, runID); n != 0 {
		t.Fatalf("the abandoned run was granted the session %d times, want never (its wait given up)", n)
	}
	if err := k.Err(); err != nil {
		t.Fatalf("keeper lost: %v", err)
	}
	if err := next.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A handoff request for a lease on the keeper reaches that lease.
func TestKeeperLeaseReceivesHandoffRequests(t *testing.T) {
	k := newKeeper(t, dial(t, []string{shared.Addr}))
	keys, leases := holdOn(t, k, 2)
	direct := dial(t, []string{shared.Addr})
	delivered, _, err := direct.RequestHandoff(context.Background(), keys[1], "browser", "continue here")
	if err != nil || !delivered {
		t.Fatalf("RequestHandoff = %v, %v; want delivered", delivered, err)
	}
	select {
	case h := <-leases[1].HandoffRequests():
		if h.RequesterHolder != "browser" || h.Reason != "continue here" {
			t.Fatalf("handoff = %+v, want the browser's request", h)
		}
	case <-time.After(2 * keeperTTL):
		t.Fatal("no handoff request within two TTLs")
	}
	select {
	case h := <-leases[0].HandoffRequests():
		t.Fatalf("the other lease got %+v, want nothing", h)
	default:
	}
}
