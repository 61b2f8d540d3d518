package leasehold_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// Short enough for a quick story, long enough that a loaded two-core
// machine keeps the renewals (about every 670ms) well inside the window;
// the margin is what L2 is checked against.
const (
	ttl    = 3 * time.Second
	margin = time.Second
)

var holdOptions = leasehold.HoldOptions{TTL: ttl, SafetyMargin: margin}

func TestRaceExactlyOneWins(t *testing.T) {
	// S1, S2: two clients on their own connections ask at once.
	key := freshKey(t)
	a, b := dial(t, []string{shared.Addr}), dial(t, []string{shared.Addr})
	var wg sync.WaitGroup
	leases := make([]*leasehold.Lease, 2)
	errs := make([]error, 2)
	for i, c := range []*leasehold.Client{a, b} {
		wg.Go(func() {
			o := holdOptions
			o.Holder = fmt.Sprintf("racer-%d", i)
			leases[i], errs[i] = c.Hold(context.Background(), key, o)
		})
	}
	wg.Wait()
	won, lost := 0, 1
	if errs[0] != nil {
		won, lost = 1, 0
	}
	if errs[won] != nil || errs[lost] == nil {
		t.Fatalf("want exactly one winner, got errors %v and %v", errs[0], errs[1])
	}
	var na *leasehold.NotAcquiredError
	if !errors.As(errs[lost], &na) || !errors.Is(errs[lost], leasehold.ErrNotAcquired) {
		t.Fatalf("loser's error %v, want a *NotAcquiredError", errs[lost])
	}
	winner := leases[won]
	if na.Current.GetRunId() != winner.RunID() || na.Current.GetFencingToken() != winner.FencingToken() || na.Current.GetHolder() != fmt.Sprintf("racer-%d", won) {
		t.Fatalf("the refusal names %v, want the winner (run %s, token %d)", na.Current, winner.RunID(), winner.FencingToken())
	}
	if err := winner.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(context.Cause(winner.Context()), leasehold.ErrReleased) || winner.Err() != nil {
		t.Fatalf("after Release: cause %v, Err %v; want ErrReleased and no loss", context.Cause(winner.Context()), winner.Err())
	}
}

// TestStalledRoutes is the L2 story: every route of the holder stalls; its
// lease's Context ends before the database deadline; a waiting client takes
// over with a larger token (S6); the old run's late write is refused by the
// guarded store (S7); and the old run never sent a release (asserted from
// History).
func TestStalledRoutesStopBeforeTheDatabaseDeadline(t *testing.T) {
	key := freshKey(t)
	p1, p2 := testenv.StartProxy(t, shared.Addr), testenv.StartProxy(t, shared.Addr)
	holder := dial(t, []string{p1.Addr, p2.Addr})
	direct := admin(t, shared)
	o := holdOptions
	o.Holder = "stalled"
	lease, err := holder.Hold(context.Background(), key, o)
	if err != nil {
		t.Fatal(err)
	}
	docs := guardedStore(t, store.Addr)
	t1 := lease.FencingToken()
	if _, err := docs.Put(bearer(lease.Context()), &guardedv1.PutRequest{Key: &leasev1.SessionKey{AccountId: key.AccountID, SessionId: key.SessionID}, Name: "doc", Value: []byte("first"), FencingToken: t1}); err != nil {
		t.Fatal(err)
	}

	stalledAt := time.Now()
	p1.Stall()
	p2.Stall()
	waitDone(t, lease.Context(), 3*ttl, "lease context after the stall")
	state, err := direct.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	// L2: asked right after, the database still counts the lease valid.
	if state.GetRunId() != lease.RunID() || state.GetRemaining().AsDuration() <= 0 {
		t.Fatalf("Get right after the stop = %v, want run %s still valid in the database", state, lease.RunID())
	}
	if lost := lostCause(t, lease); lost.Reason != leasehold.LossDeadline {
		t.Fatalf("loss reason %q, want deadline", lost.Reason)
	}
	t.Logf("stall to stop %s, database time left at stop %s", time.Since(stalledAt).Round(time.Millisecond), state.GetRemaining().AsDuration().Round(time.Millisecond))
	if lease.Remaining() != 0 {
		t.Fatalf("Remaining() = %s after loss, want 0", lease.Remaining())
	}
	// No release after loss: Release returns the loss and sends nothing.
	if err := lease.Release(context.Background()); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("Release after loss = %v, want the *LeaseLostError", err)
	}

	// S6: a waiting client gets the session once the database deadline passed.
	taker := dial(t, []string{shared.Addr})
	o.Holder, o.Wait = "taker", 30*time.Second
	newer, err := taker.Hold(context.Background(), key, o)
	if err != nil {
		t.Fatal(err)
	}
	t2 := newer.FencingToken()
	if t2 <= t1 {
		t.Fatalf("takeover token %d, want larger than %d", t2, t1)
	}
	if _, err := docs.Put(bearer(context.Background()), &guardedv1.PutRequest{Key: key2proto(key), Name: "doc", Value: []byte("newer"), FencingToken: t2}); err != nil {
		t.Fatal(err)
	}
	// S7: the old run's late write, with its old token, is refused.
	_, err = docs.Put(bearer(context.Background()), &guardedv1.PutRequest{Key: key2proto(key), Name: "doc", Value: []byte("late"), FencingToken: t1})
	var stale *leasehold.StaleFencingTokenError
	if !errors.As(leasehold.FromError(err), &stale) || stale.Presented != t1 || stale.Highest != t2 || status.Code(err) != codes.Aborted {
		t.Fatalf("late write: %v, want ABORTED STALE_FENCING_TOKEN presented %d highest %d", err, t1, t2)
	}

	// The server's History: the old run was never released (it expired and
	// was taken over), the new one was acquired.
	events := history(t, direct, key)
	if n := countEvents(events, leasev1.EventType_EVENT_TYPE_RELEASED, lease.RunID()); n != 0 {
		t.Fatalf("History shows %d release(s) of the lost run, want 0: %v", n, events)
	}
	if n := countEvents(events, leasev1.EventType_EVENT_TYPE_ACQUIRED, newer.RunID()); n != 1 {
		t.Fatalf("History shows %d grants of the new run, want 1: %v", n, events)
	}
	if err := newer.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func key2proto(k leasehold.SessionKey) *leasev1.SessionKey {
	return &leasev1.SessionKey{AccountId: k.AccountID, SessionId: k.SessionID}
}

// A cut connection alone (the peer learns at once) reconnects and keeps
// the lease past the deadline its last renewal before the cut gave.
func TestCutStreamReconnectsAndKeepsTheLease(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr})
	lease, err := c.Hold(context.Background(), key, holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	granted := lease.Lease()
	testenv.WaitFor(t, 10*time.Second, "a first renewal", func() bool { return lease.Lease() != granted })
	before := p.Accepted()
	cutAt := time.Now()
	p.Cut()
	// Held past a whole TTL after the cut: only renewals on a new
	// connection can have kept it.
	testenv.WaitFor(t, 3*ttl, "a TTL after the cut", func() bool { return time.Since(cutAt) > ttl })
	if err := lease.Err(); err != nil {
		t.Fatalf("Err() after a cut = %v, want nil", err)
	}
	if p.Accepted() <= before {
		t.Fatalf("no new connection after the cut, want one")
	}
	if got, err := dial(t, []string{shared.Addr}).Get(context.Background(), key); err != nil || got.GetRunId() != lease.RunID() {
		t.Fatalf("server says %v (%v), want run %s", got, err, lease.RunID())
	}
	if err := lease.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}
