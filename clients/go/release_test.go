package leasehold_test

import (
	"context"
	"errors"
	"testing"
	"time"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/internal/testenv"
)

// L2: a lease its own run released is not a lost lease. A run whose work
// ends at once releases while its first KeepAlive renewal (sent as the
// stream opens) is still on the way; released first, the lease was refused
// to that renewal as "released", and the server counted
// leasehold_lease_losses_total{reason="released"}. The run now waits for
// its renewal's answer before its Release. Made deterministic with a TCP
// proxy that delays every answer to the client: the new stream's
// connection, and so its renewal, is late for every run. As
// test/release-not-loss.test.ts does for the TypeScript client.
func TestReleaseAfterItsRenewalIsAnsweredIsNoLoss(t *testing.T) {
	s := testenv.StartServer(t)
	p := testenv.StartProxy(t, s.Addr)
	c := dial(t, []string{p.Addr})
	losses := func() float64 {
		return s.Metric(t, "leasehold_lease_losses_total", map[string]string{"reason": "released"})
	}
	releases := func() float64 { return s.Metric(t, "leasehold_lease_releases_total", nil) }
	renewals := func() float64 { return s.Metric(t, "leasehold_lease_renewals_total", nil) }
	lossesBefore, releasesBefore, renewalsBefore := losses(), releases(), renewals()
	p.Delay(300 * time.Millisecond)
	// Renewals every 9s: each run is over long before its second renewal,
	// even on a loaded machine, so each sends exactly one.
	o := leasehold.HoldOptions{TTL: 30 * time.Second}
	ctx := context.Background()

	const each = 3
	// Hold, then Release at once.
	for range each {
		lease, err := c.Hold(ctx, freshKey(t), o)
		if err != nil {
			t.Fatal(err)
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatalf("Release = %v, want nil", err)
		}
		if cause := context.Cause(lease.Context()); !errors.Is(cause, leasehold.ErrReleased) || lease.Err() != nil {
			t.Fatalf("after Release: Context's cause %v, Err() %v; want ErrReleased and nil", cause, lease.Err())
		}
	}
	// RunExclusive whose work ends at once.
	for range each {
		var work context.Context
		err := c.RunExclusive(ctx, freshKey(t), o, func(ctx context.Context, _ *leasehold.Lease) error {
			work = ctx
			return nil
		})
		if err != nil {
			t.Fatalf("RunExclusive = %v, want nil", err)
		}
		// The work's context ends naming the run's own release, never a loss.
		if cause := context.Cause(work); !errors.Is(cause, leasehold.ErrReleased) {
			t.Fatalf("the work's context ended with %v, want ErrReleased", cause)
		}
	}

	const runs = 2 * each
	// Every run's first renewal reaches the server, answered or refused;
	// wait for all of them before reading the losses.
	testenv.WaitFor(t, 20*time.Second, "every run's renewal at the server", func() bool {
		return renewals()-renewalsBefore+losses()-lossesBefore >= runs
	})
	if n := losses() - lossesBefore; n != 0 {
		t.Errorf("leasehold_lease_losses_total{reason=\"released\"} grew by %v, want 0: a run's own release was counted as a loss", n)
	}
	if n := releases() - releasesBefore; n != runs {
		t.Errorf("leasehold_lease_releases_total grew by %v, want %d", n, runs)
	}
	// Each run's renewal reached the server while its lease was held.
	if n := renewals() - renewalsBefore; n != runs {
		t.Errorf("leasehold_lease_renewals_total grew by %v, want %d", n, runs)
	}
}

// S5, L2: Release's wait for a renewal on the way takes at most half of its
// ctx, so the Release itself is still sent in time. The KeepAlive route
// answers 3 s late and unary calls go straight to the server (the proxy
// resets the Acquire, so the client prefers the other address); Release
// with a 2 s ctx ends the lease on the server, where a wait spending the
// whole ctx sent the Release on a dead one and left the lease held.
func TestReleaseWaitLeavesTheReleaseHalfItsContext(t *testing.T) {
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr, shared.Addr})
	direct := dial(t, []string{shared.Addr})
	p.Delay(3 * time.Second)
	p.DropNextRequest()
	key := freshKey(t)
	lease, err := c.Hold(context.Background(), key, leasehold.HoldOptions{TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := lease.Release(ctx); err != nil {
		t.Fatalf("Release with a 2 s ctx while the renewal is 3 s late = %v, want nil", err)
	}
	if held, err := direct.Get(context.Background(), key); err != nil || held != nil {
		t.Fatalf("after Release the session shows %v (%v), want free", held, err)
	}
	if !errors.Is(context.Cause(lease.Context()), leasehold.ErrReleased) {
		t.Fatalf("the lease's Context ended with %v, want ErrReleased", context.Cause(lease.Context()))
	}
}

// L2: a Release whose ctx is cancelled before it sends anything returns
// ctx's error and leaves the lease held and renewed (its renewals had
// stopped for the wait): the server's deadline moves on twice after it (a
// renewal already on the way could move it once), and a later Release ends
// it.
func TestReleaseCancelledBeforeSendingLeavesTheLeaseRenewed(t *testing.T) {
	ctx := context.Background()
	c := dial(t, []string{shared.Addr})
	key := freshKey(t)
	lease, err := c.Hold(ctx, key, leasehold.HoldOptions{TTL: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// The server's deadline once it is later than `after`.
	movedPast := func(after time.Time) time.Time {
		t.Helper()
		until := time.Now().Add(15 * time.Second)
		for {
			got, err := c.Get(ctx, key)
			if err != nil || got.GetRunId() != lease.RunID() {
				t.Fatalf("the session shows %v (%v), want the lease still held", got, err)
			}
			if at := got.GetExpiresAt().AsTime(); at.After(after) {
				return at
			}
			if time.Now().After(until) {
				t.Fatalf("the lease's deadline stayed at %v, want it moved later by a renewal", after)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	granted, err := c.Get(ctx, key)
	if err != nil || granted == nil {
		t.Fatalf("Get = %v, %v; want the lease, nil", granted, err)
	}
	renewed := movedPast(granted.GetExpiresAt().AsTime()) // the renewal sent as the stream opened
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := lease.Release(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("Release with a cancelled ctx: %v, want context.Canceled", err)
	}
	movedPast(movedPast(renewed))
	if err := lease.Err(); err != nil {
		t.Fatalf("Err() = %v, want nil (the lease renewed again)", err)
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if held, err := c.Get(ctx, key); err != nil || held != nil {
		t.Fatalf("after Release the session shows %v (%v), want free", held, err)
	}
}
