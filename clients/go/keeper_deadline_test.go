package leasehold

// A keeper's local deadline (DESIGN.md L2, K1) on a clock the test moves,
// as deadline_test.go does for a lease of its own: the keeper's stream is
// one the test answers by hand (dispatch), so nothing but the clock is
// made up. The stories against real servers are in keeper_test.go.

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

const (
	keeperTTL    = 3 * time.Second
	keeperMargin = keeperTTL / 10
)

// fakeKeeper is a keeper opened now with keeperTTL remaining, on a stream
// nobody reads: the test answers its requests (beat, answer).
func fakeKeeper(t *testing.T, clk *fakeClock) (*Keeper, *keeperStream) {
	t.Helper()
	c := &Client{cfg: config{maxLeasesPerStream: 1, callTimeout: time.Second}, clock: clk, leases: map[*Lease]struct{}{}, keepers: map[*Keeper]struct{}{}}
	cfg, err := newKeeperConfig([]KeeperOption{WithKeeperTTL(keeperTTL)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	k := &Keeper{c: c, cfg: cfg, accountID: "acct", ctx: ctx, cancel: cancel, leases: map[entryID]*Lease{}, opened: make(chan error, 1), stop: make(chan struct{})}
	s := &keeperStream{addr: "fake", calls: map[uint64]*keeperCall{}, wake: make(chan struct{}, 1)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	k.mu.Lock()
	k.stream = s
	k.nextID++
	s.openID, s.openSent = k.nextID, clk.Now()
	k.mu.Unlock()
	k.dispatch(s, &leasev1.KeepResponse{Id: s.openID, Result: &leasev1.KeepResponse_Keeper{Keeper: keeperLeft(keeperTTL)}})
	if err := <-k.opened; err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() {
		k.mu.Lock()
		defer k.mu.Unlock()
		k.endLocked()
	})
	return k, s
}

func keeperLeft(d time.Duration) *leasev1.Keeper {
	return &leasev1.Keeper{Remaining: durationpb.New(d)}
}

// beat sends a heartbeat at the clock's now, as heartbeatLoop does, and
// returns its id for answer.
func beat(k *Keeper) uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.nextID++
	k.beatID, k.beatSent = k.nextID, k.c.clock.Now()
	return k.beatID
}

func answerBeat(k *Keeper, s *keeperStream, id uint64, remaining time.Duration) {
	k.dispatch(s, &leasev1.KeepResponse{Id: id, Result: &leasev1.KeepResponse_Keeper{Keeper: keeperLeft(remaining)}})
}

func keeperLeases(t *testing.T, k *Keeper, n int) []*Lease {
	t.Helper()
	var leases []*Lease
	for i := range n {
		key := SessionKey{"acct", "s" + string(rune('a'+i))}
		l, err := k.keep(key, NewRunID(), &leasev1.Lease{Remaining: durationpb.New(keeperTTL)})
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, l)
	}
	return leases
}

func keeperDeadline(k *Keeper) time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.deadline
}

// keeperLoss asserts that every lease was lost with the keeper for reason:
// its Context ended with a *LeaseLostError wrapping the *KeeperLostError.
func keeperLoss(t *testing.T, k *Keeper, leases []*Lease, reason LossReason) {
	t.Helper()
	var klost *KeeperLostError
	if !errors.As(context.Cause(k.Context()), &klost) || klost.Reason != reason {
		t.Fatalf("keeper cause = %v, want a *KeeperLostError with reason %s", context.Cause(k.Context()), reason)
	}
	for i, l := range leases {
		select {
		case <-l.Context().Done():
		default:
			t.Fatalf("lease %d: Context not done, want done with the keeper", i)
		}
		var lost *LeaseLostError
		if !errors.As(context.Cause(l.Context()), &lost) || lost.Reason != reason || !errors.Is(lost, ErrKeeperLost) {
			t.Fatalf("lease %d: cause = %v, want a *LeaseLostError (%s) wrapping ErrKeeperLost", i, context.Cause(l.Context()), reason)
		}
	}
}

// L2: the keeper's local deadline is the heartbeat's send time + remaining
// − margin, read by every lease on it; an answer with less remaining never
// moves it earlier.
func TestKeeperDeadlineIsTheHeartbeatsSendTimePlusRemainingMinusMargin(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	k, s := fakeKeeper(t, clk)
	leases := keeperLeases(t, k, 3)
	if got, want := keeperDeadline(k), start.Add(keeperTTL-keeperMargin); !got.Equal(want) {
		t.Fatalf("deadline after the open = start+%s, want start+%s", got.Sub(start), want.Sub(start))
	}
	clk.Set(start.Add(time.Second))
	id := beat(k)
	clk.Set(start.Add(1500 * time.Millisecond)) // a slow answer extends nothing
	answerBeat(k, s, id, keeperTTL)
	want := start.Add(time.Second + keeperTTL - keeperMargin)
	if got := keeperDeadline(k); !got.Equal(want) {
		t.Fatalf("deadline after a heartbeat = start+%s, want start+%s (send time + remaining − margin)", got.Sub(start), want.Sub(start))
	}
	for i, l := range leases {
		if got := l.Remaining(); got != want.Sub(clk.Now()) {
			t.Fatalf("lease %d: Remaining() = %s, want the keeper's %s", i, got, want.Sub(clk.Now()))
		}
	}
	id = beat(k)
	answerBeat(k, s, id, 500*time.Millisecond)
	if got := keeperDeadline(k); !got.Equal(want) {
		t.Fatalf("deadline after a shorter answer = start+%s, want start+%s (never earlier)", got.Sub(start), want.Sub(start))
	}
}

// L2, K1: heartbeats that stop being answered (a stalled instance) stop
// every lease on the keeper at the local deadline, before the database
// deadline (the last confirmed send time + remaining), with one timer.
func TestStalledKeeperHeartbeatStopsEveryLeaseBeforeTheDatabaseDeadline(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	k, s := fakeKeeper(t, clk)
	leases := keeperLeases(t, k, 5)
	clk.Set(start.Add(time.Second))
	id := beat(k)
	answerBeat(k, s, id, keeperTTL)
	databaseDeadline := start.Add(time.Second + keeperTTL)
	local := databaseDeadline.Add(-keeperMargin)
	beat(k) // never answered
	clk.advanceTo(local.Add(-time.Millisecond))
	if err := k.Err(); err != nil {
		t.Fatalf("keeper lost before its local deadline: %v", err)
	}
	clk.advanceTo(local)
	keeperLoss(t, k, leases, LossDeadline)
	if !clk.Now().Before(databaseDeadline) {
		t.Fatalf("lost at start+%s, want before the database deadline start+%s", clk.Now().Sub(start), databaseDeadline.Sub(start))
	}
	if got := clk.pending(); len(got) != 0 {
		t.Fatalf("timers due at %v after the loss, want none", got)
	}
	if clk.afterFuncs != 1 {
		t.Fatalf("%d timers armed for the keeper and its 5 leases, want 1", clk.afterFuncs)
	}
}

// L2: a heartbeat's answer that arrives once the local deadline has passed
// (its timer not yet fired) cannot revive the keeper or its leases.
func TestLateHeartbeatAnswerDoesNotReviveTheKeeper(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	k, s := fakeKeeper(t, clk)
	leases := keeperLeases(t, k, 2)
	id := beat(k)
	clk.Set(start.Add(keeperTTL - keeperMargin))
	answerBeat(k, s, id, keeperTTL)
	keeperLoss(t, k, leases, LossDeadline)
}

// L2: once the keeper's local deadline has passed, a lease on it stops
// presenting itself as held at once, before the timer fires.
func TestPassedKeeperDeadlineRefusesFencingBeforeItsTimerFires(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	k, _ := fakeKeeper(t, clk)
	leases := keeperLeases(t, k, 2)
	if _, err := FencingMetadata(leases[0]); err != nil {
		t.Fatalf("FencingMetadata before the deadline: %v", err)
	}
	clk.Set(start.Add(keeperTTL - keeperMargin))
	if md, err := FencingMetadata(leases[0]); md != nil || !errors.Is(err, ErrKeeperLost) {
		t.Fatalf("FencingMetadata at the keeper's deadline = %v, %v; want no headers and ErrKeeperLost", md, err)
	}
	keeperLoss(t, k, leases, LossDeadline)
}

// K1: the server's lease_lost ends only that lease; its keeper lost
// (revoked) ends every other one at once.
func TestLeaseLostEndsOneLeaseAndKeeperLostEndsThemAll(t *testing.T) {
	clk := newFakeClock()
	k, s := fakeKeeper(t, clk)
	leases := keeperLeases(t, k, 3)
	one := leases[0]
	k.dispatch(s, &leasev1.KeepResponse{Result: &leasev1.KeepResponse_LeaseLost{LeaseLost: &leasev1.KeeperLeaseLost{
		Key: one.Key().proto(), RunId: one.RunID(), Reason: leasev1.LossReason_LOSS_REASON_REVOKED,
	}}})
	var lost *LeaseLostError
	if !errors.As(one.Err(), &lost) || lost.Reason != LossRevoked || errors.Is(lost, ErrKeeperLost) {
		t.Fatalf("revoked lease: Err() = %v, want a *LeaseLostError (revoked) not of the keeper", one.Err())
	}
	for i, l := range leases[1:] {
		if l.Err() != nil || l.Context().Err() != nil {
			t.Fatalf("lease %d ended with the revoke of another: %v", i+1, l.Err())
		}
	}
	k.dispatch(s, &leasev1.KeepResponse{Result: &leasev1.KeepResponse_Lost{Lost: &leasev1.KeeperLost{
		Reason: leasev1.LossReason_LOSS_REASON_REVOKED, Detail: "maintenance",
	}}})
	keeperLoss(t, k, leases[1:], LossRevoked)
	if err, want := k.Err(), "leasehold: keeper "+k.ID()+" lost: the server reports the keeper lost (revoked): maintenance"; err == nil || err.Error() != want {
		t.Fatalf("keeper Err() = %v, want the revoke with its reason", err)
	}
}

// Better than etcd's Mutex.Lock, which goes on waiting after its session
// is gone: a Hold waiting on the keeper returns the keeper's loss at once.
func TestKeeperLostWhileHoldWaitsEndsTheWait(t *testing.T) {
	clk := newFakeClock()
	k, s := fakeKeeper(t, clk)
	done := make(chan error, 1)
	go func() {
		_, err := k.Hold(context.Background(), SessionKey{"acct", "busy"}, WithWait(time.Hour))
		done <- err
	}()
	// The acquire is on the stream, unanswered, when the keeper is lost.
	select {
	case <-s.wake:
	case err := <-done:
		t.Fatalf("Hold returned %v before its acquire was sent", err)
	}
	k.dispatch(s, &leasev1.KeepResponse{Result: &leasev1.KeepResponse_Lost{Lost: &leasev1.KeeperLost{Reason: leasev1.LossReason_LOSS_REASON_EXPIRED}}})
	select {
	case err := <-done:
		var lost *KeeperLostError
		if !errors.As(err, &lost) || lost.Reason != LossExpired {
			t.Fatalf("Hold = %v, want the *KeeperLostError (expired)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Hold still waiting 10s after its keeper was lost")
	}
}
