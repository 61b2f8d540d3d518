package leasehold

import (
	"context"
	"errors"
	"testing"

	"go.uber.org/goleak"
)

// Close releases every lease the client counts, and Hold counts a lease
// (track) before it keeps it alive (start): a Close between the two
// releases the lease first. Starting it then must keep nothing alive — no
// renewal goroutine (its stop channel is gone, so it would never end), no
// place on the KeepAlive stream — and the lease stays released.
func TestLeaseReleasedByCloseBeforeItStartsIsNotKeptAlive(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	clk := newFakeClock()
	c := &Client{cfg: config{maxLeasesPerStream: 1}, clock: clk, leases: map[*Lease]struct{}{}}
	c.keepAlive = newKeepAliveChannel(c)
	c.keepAlive.closed = true
	tm, err := leaseTiming(HoldOptions{TTL: fakeTTL, SafetyMargin: fakeMargin})
	if err != nil {
		t.Fatal(err)
	}
	g := grant{lease: remaining(fakeTTL), deadline: clk.Now().Add(fakeTTL - fakeMargin)}
	l := newLease(c, SessionKey{"acct", "closed-before-start"}, NewRunID(), tm, g)
	if !c.track(l) {
		t.Fatal("track = false on an open client, want true")
	}
	// What Close does with the lease it counts (its Release RPC has no
	// server to go to here, which changes nothing on the client's side).
	_ = l.Release(context.Background())
	l.start()
	if got := context.Cause(l.Context()); !errors.Is(got, ErrReleased) || l.Err() != nil {
		t.Fatalf("after start: cause %v, Err() %v; want ErrReleased, nil", got, l.Err())
	}
	if got := clk.pending(); len(got) != 0 {
		t.Fatalf("timers due at %v for a released lease, want none", got)
	}
}
