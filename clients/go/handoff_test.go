package leasehold_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// A handoff request reaches the holder on its KeepAlive stream; it
// finishes and releases, and the requester's waiting Hold gets the session
// with a larger token (S3: the request itself overwrote nothing).
func TestHandoffDelivered(t *testing.T) {
	key := freshKey(t)
	holder, requester := dial(t, []string{shared.Addr}), dial(t, []string{shared.Addr})
	o := holdOptions
	o.Holder = "desktop"
	lease, err := holder.Hold(context.Background(), key, o)
	if err != nil {
		t.Fatal(err)
	}
	granted := lease.Lease()
	// The server watches a run for handoffs once its stream has named it.
	deadline := time.Now().Add(10 * time.Second)
	for lease.Lease() == granted && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	listed, _, err := requester.List(context.Background(), key.AccountID, 1000, "")
	found := false
	for _, l := range listed {
		found = found || l.GetRunId() == lease.RunID()
	}
	if err != nil || !found {
		t.Fatalf("List = %d leases, err %v; want run %s among them, nil", len(listed), err, lease.RunID())
	}
	delivered, current, err := requester.RequestHandoff(context.Background(), key, "browser", "continue here")
	if err != nil || !delivered || current.GetRunId() != lease.RunID() {
		t.Fatalf("RequestHandoff = delivered %v, current %v, err %v; want true, run %s, nil", delivered, current, err, lease.RunID())
	}
	select {
	case h := <-lease.HandoffRequests():
		if h.RequesterHolder != "browser" || h.Reason != "continue here" {
			t.Fatalf("handoff %+v, want from browser, reason \"continue here\"", h)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no handoff request delivered within 10s, want one")
	}
	if err := lease.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	o.Holder, o.Wait = "browser", 10*time.Second
	next, err := requester.Hold(context.Background(), key, o)
	if err != nil {
		t.Fatal(err)
	}
	if next.FencingToken() <= lease.FencingToken() {
		t.Fatalf("token %d after handoff, want above %d", next.FencingToken(), lease.FencingToken())
	}
	if lease.Err() != nil {
		t.Fatalf("Err() after its own Release = %v, want nil (not a loss)", lease.Err())
	}
	events := history(t, requester, key)
	if countEvents(events, leasev1.EventType_EVENT_TYPE_HANDOFF_REQUESTED, lease.RunID()) != 1 || countEvents(events, leasev1.EventType_EVENT_TYPE_RELEASED, lease.RunID()) != 1 {
		t.Fatalf("History %v, want one HANDOFF_REQUESTED and one RELEASED of run %s", events, lease.RunID())
	}
	_ = next.Release(context.Background())
}

// RunExclusive: fn's context ends the moment the lease is revoked, and the
// error is fn's joined with the *LeaseLostError; no release follows.
// A fn that returns normally has its lease released.
func TestRunExclusive(t *testing.T) {
	key := freshKey(t)
	c := dial(t, []string{shared.Addr})
	adm := admin(t, shared)
	var runID string
	workErr := errors.New("work stopped")
	err := c.RunExclusive(context.Background(), key, holdOptions, func(ctx context.Context, l *leasehold.Lease) error {
		runID = l.RunID()
		granted := l.Lease()
		for l.Lease() == granted {
			time.Sleep(20 * time.Millisecond)
		}
		if revoked, err := adm.Revoke(context.Background(), key, "test"); err != nil || !revoked {
			t.Errorf("Revoke = %v, %v; want true, nil", revoked, err)
		}
		<-ctx.Done()
		return workErr
	})
	var lost *leasehold.LeaseLostError
	if !errors.Is(err, workErr) || !errors.As(err, &lost) || lost.Reason != leasehold.LossRevoked {
		t.Fatalf("RunExclusive = %v, want fn's error joined with a revoked *LeaseLostError", err)
	}
	if n := countEvents(history(t, c, key), leasev1.EventType_EVENT_TYPE_RELEASED, runID); n != 0 {
		t.Fatalf("History shows %d releases after the loss, want 0", n)
	}
	err = c.RunExclusive(context.Background(), key, holdOptions, func(ctx context.Context, l *leasehold.Lease) error {
		runID = l.RunID()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := countEvents(history(t, c, key), leasev1.EventType_EVENT_TYPE_RELEASED, runID); n != 1 {
		t.Fatalf("%d releases after RunExclusive returned, want 1", n)
	}
}

// RunExclusive: work that returns its context's cause, as the README
// suggests, gets the *LeaseLostError back once, not joined with itself.
func TestRunExclusiveReturnsTheLossOnceWhenTheWorkReturnsItsCause(t *testing.T) {
	key := freshKey(t)
	c := dial(t, []string{shared.Addr})
	adm := admin(t, shared)
	err := c.RunExclusive(context.Background(), key, holdOptions, func(ctx context.Context, l *leasehold.Lease) error {
		if revoked, err := adm.Revoke(context.Background(), key, "test"); err != nil || !revoked {
			t.Errorf("Revoke = %v, %v; want true, nil", revoked, err)
		}
		<-ctx.Done()
		return fmt.Errorf("work stopped: %w", context.Cause(ctx))
	})
	var lost *leasehold.LeaseLostError
	if !errors.As(err, &lost) || lost.Reason != leasehold.LossRevoked {
		t.Fatalf("RunExclusive = %v, want a revoked *LeaseLostError", err)
	}
	if got := strings.Count(err.Error(), lost.Error()); got != 1 {
		t.Fatalf("RunExclusive = %q: the loss appears %d times, want 1", err, got)
	}
}

// Watch: a snapshot, then the changes.
func TestWatch(t *testing.T) {
	key := freshKey(t)
	c := dial(t, []string{shared.Addr})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var lease *leasehold.Lease
	var seen []leasev1.EventType
	for resp, err := range c.Watch(ctx, key, leasehold.WatchOptions{}) {
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetSnapshot() != nil {
			if lease, err = c.Hold(ctx, key, holdOptions); err != nil {
				t.Fatal(err)
			}
			continue
		}
		e := resp.GetEvent()
		seen = append(seen, e.GetType())
		if e.GetType() == leasev1.EventType_EVENT_TYPE_ACQUIRED && e.GetRunId() == lease.RunID() {
			if err := lease.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if e.GetType() == leasev1.EventType_EVENT_TYPE_RELEASED && e.GetRunId() == lease.RunID() {
			break
		}
	}
	if len(seen) != 2 {
		t.Fatalf("events %v, want ACQUIRED then RELEASED", seen)
	}
}
