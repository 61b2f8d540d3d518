package leasehold

// The local deadline (DESIGN.md L2) on a clock the test moves: the one
// thing here that cannot be real (the Python core's test_core.py does the
// same). The stories against real servers, where the deadline passes on
// the real clock, are in stories_test.go and failover_test.go.

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

const (
	fakeTTL    = 3 * time.Second
	fakeMargin = time.Second
)

// fakeHeld is a lease granted now with fakeTTL remaining, kept alive on clk
// by a client with no server: its KeepAlive channel is closed, so no
// renewal is sent and the test hands the lease its answers (renewed).
func fakeHeld(t *testing.T, clk *fakeClock) *Lease {
	t.Helper()
	c := &Client{cfg: config{maxLeasesPerStream: 1}, clock: clk, leases: map[*Lease]struct{}{}}
	c.keepAlive = newKeepAliveChannel(c)
	c.keepAlive.closed = true
	tm, err := leaseTiming(HoldOptions{TTL: fakeTTL, SafetyMargin: fakeMargin})
	if err != nil {
		t.Fatal(err)
	}
	g := grant{lease: remaining(fakeTTL), deadline: clk.Now().Add(fakeTTL - fakeMargin)}
	l := newLease(c, SessionKey{"acct", "fake-clock"}, NewRunID(), tm, g)
	if !c.track(l) {
		t.Fatal("track = false on an open client, want true")
	}
	l.start()
	t.Cleanup(func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.stopLocked()
	})
	return l
}

func remaining(d time.Duration) *leasev1.Lease {
	return &leasev1.Lease{Remaining: durationpb.New(d)}
}

func (c *fakeClock) advanceTo(at time.Time) { c.Advance(at.Sub(c.Now())) }

func deadlineOf(l *Lease) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deadline
}

// lostAtDeadline asserts that l was lost at its local deadline with
// message, its Context ended with that loss.
func lostAtDeadline(t *testing.T, l *Lease, message string) {
	t.Helper()
	var lost *LeaseLostError
	if !errors.As(l.Err(), &lost) {
		t.Fatalf("Err() = %v, want a *LeaseLostError", l.Err())
	}
	if lost.Reason != LossDeadline || lost.Message != message {
		t.Fatalf("loss = %s %q, want %s %q", lost.Reason, lost.Message, LossDeadline, message)
	}
	if got := context.Cause(l.Context()); got != lost {
		t.Fatalf("context.Cause(Context()) = %v, want the loss %v", got, lost)
	}
}

// L2: renewals move the local deadline later without arming a timer each;
// the one timer, due at the first deadline, finds the deadline moved and
// waits for the new one; passing that one loses the lease.
func TestDeadlineTimerIsArmedOnceAndFollowsTheDeadlineWhenItFires(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	l := fakeHeld(t, clk)
	for i := 1; i <= 10; i++ {
		clk.Set(start.Add(time.Duration(i) * 100 * time.Millisecond))
		l.renewed(remaining(fakeTTL), clk.Now())
	}
	first, moved := start.Add(fakeTTL-fakeMargin), start.Add(time.Second+fakeTTL-fakeMargin)
	if got := deadlineOf(l); !got.Equal(moved) {
		t.Fatalf("deadline after ten renewals = start+%s, want start+%s", got.Sub(start), moved.Sub(start))
	}
	if got, want := clk.pending(), []time.Time{first}; !slices.Equal(got, want) {
		t.Fatalf("timers due at %v, want %v", got, want)
	}

	clk.advanceTo(first)
	if err := l.Err(); err != nil {
		t.Fatalf("Err() at the first deadline = %v, want nil (renewals moved it)", err)
	}
	if got, want := clk.pending(), []time.Time{moved}; !slices.Equal(got, want) {
		t.Fatalf("timers due at %v after the first fired, want %v", got, want)
	}

	clk.advanceTo(moved)
	lostAtDeadline(t, l, "the local deadline passed without a confirmed renewal")
	if got := clk.pending(); len(got) != 0 {
		t.Fatalf("timers due at %v after the loss, want none", got)
	}
	if clk.afterFuncs != 1 {
		t.Fatalf("%d timers armed, want 1", clk.afterFuncs)
	}
}

// L2: a renewal's answer that arrives once the local deadline has passed
// (its timer not yet fired) cannot revive the run: the lease may have
// expired and been taken meanwhile.
func TestRenewalConfirmedAfterTheLocalDeadlineDoesNotReviveTheLease(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	l := fakeHeld(t, clk)
	clk.Set(start.Add(fakeTTL - fakeMargin))
	l.renewed(remaining(fakeTTL), start.Add(time.Second))
	lostAtDeadline(t, l, "the local deadline passed before a renewal was confirmed")
	clk.Advance(0)
	lostAtDeadline(t, l, "the local deadline passed before a renewal was confirmed")
}

// L2: the local deadline counts from the renewal request's send time, so a
// slow answer does not extend it.
func TestLocalDeadlineCountsFromTheRenewalsSendTime(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	l := fakeHeld(t, clk)
	renewal := remaining(fakeTTL)
	clk.Set(start.Add(1500 * time.Millisecond))
	l.renewed(renewal, start.Add(500*time.Millisecond))
	if got, want := deadlineOf(l), start.Add(500*time.Millisecond+fakeTTL-fakeMargin); !got.Equal(want) {
		t.Fatalf("deadline = start+%s, want start+%s (send time + remaining − margin)", got.Sub(start), want.Sub(start))
	}
	if got, want := l.Remaining(), time.Second; got != want {
		t.Fatalf("Remaining() = %s, want %s", got, want)
	}
	if got := l.Lease(); got != renewal {
		t.Fatalf("Lease() = %v, want the renewal's %v", got, renewal)
	}
}

// L2: an answer with less time remaining than the deadline already has
// never moves the deadline earlier.
func TestRenewalNeverMovesTheDeadlineEarlier(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	l := fakeHeld(t, clk)
	clk.Set(start.Add(500 * time.Millisecond))
	l.renewed(remaining(1200*time.Millisecond), clk.Now())
	if got, want := deadlineOf(l), start.Add(fakeTTL-fakeMargin); !got.Equal(want) {
		t.Fatalf("deadline = start+%s, want start+%s (unchanged)", got.Sub(start), want.Sub(start))
	}
}

// L2: once the local deadline has passed the lease stops presenting itself
// as held at once, before its timer fires: no fencing headers, no time left.
func TestPassedDeadlineRefusesFencingBeforeItsTimerFires(t *testing.T) {
	clk := newFakeClock()
	start := clk.Now()
	l := fakeHeld(t, clk)
	if md, err := FencingMetadata(l); err != nil || len(md) != 3 {
		t.Fatalf("FencingMetadata before the deadline = %v, %v; want 3 headers, nil", md, err)
	}
	clk.Set(start.Add(fakeTTL - fakeMargin))
	if got := l.Remaining(); got != 0 {
		t.Fatalf("Remaining() at the deadline = %s, want 0", got)
	}
	md, err := FencingMetadata(l)
	if md != nil {
		t.Fatalf("FencingMetadata at the deadline = %v, want no headers", md)
	}
	var lost *LeaseLostError
	if !errors.As(err, &lost) || lost.Reason != LossDeadline {
		t.Fatalf("FencingMetadata at the deadline: err = %v, want a *LeaseLostError with reason %s", err, LossDeadline)
	}
	lostAtDeadline(t, l, "the local deadline passed without a confirmed renewal")
}
