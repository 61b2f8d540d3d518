package leasehold_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// messages is a slog handler that keeps the messages of the records it gets.
type messages struct {
	mu   sync.Mutex
	msgs []string
}

func (m *messages) Enabled(context.Context, slog.Level) bool { return true }
func (m *messages) WithAttrs([]slog.Attr) slog.Handler       { return m }
func (m *messages) WithGroup(string) slog.Handler            { return m }
func (m *messages) Handle(_ context.Context, r slog.Record) error {
	m.mu.Lock()
	m.msgs = append(m.msgs, r.Message)
	m.mu.Unlock()
	return nil
}

func (m *messages) count(msg string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, s := range m.msgs {
		if s == msg {
			n++
		}
	}
	return n
}

// L2, S6: a grant after a long wait is confirmed by an idempotent
// re-acquire before work starts. The wait outlasts the waited grant's own
// local deadline (counted from when the Acquire was sent), so its answer
// is late by construction; the client asks again with the same run id and
// gets the same grant (same token, no second grant in History) with a
// deadline counted from the second request, and the work runs on it. As
// test/run-exclusive.test.ts does for the TypeScript client.
func TestLateWaitedGrantIsConfirmedByAnIdempotentReacquire(t *testing.T) {
	ctx := context.Background()
	key := freshKey(t)
	log := &messages{}
	c := dial(t, []string{shared.Addr}, leasehold.WithLogger(slog.New(log)))
	desktop := dial(t, []string{shared.Addr})
	// Held without renewals for 2.5s: the waiting run is granted as it
	// expires, past the 1.35s local deadline of a 1.5s grant counted from
	// its request; the confirmation then has 1.35s to come back.
	first, err := desktop.Acquire(ctx, key, leasehold.AcquireOptions{TTL: 2500 * time.Millisecond, Holder: "desktop"})
	if err != nil || !first.GetAcquired() {
		t.Fatalf("the first holder's Acquire = %v, %v; want acquired, nil", first, err)
	}
	type outcome struct {
		token, stored    int64
		runID, storedRun string
		left             time.Duration
	}
	var got outcome
	err = c.RunExclusive(ctx, key, leasehold.HoldOptions{TTL: 1500 * time.Millisecond, Wait: 10 * time.Second},
		func(ctx context.Context, lease *leasehold.Lease) error {
			got.token, got.runID, got.left = lease.FencingToken(), lease.RunID(), lease.Remaining()
			row, err := c.Get(ctx, key)
			if err != nil {
				return err
			}
			got.stored, got.storedRun = row.GetFencingToken(), row.GetRunId()
			return nil
		})
	if err != nil {
		t.Fatalf("RunExclusive after the wait = %v, want nil", err)
	}
	if n := log.count(leasehold.MsgConfirming); n != 1 {
		t.Fatalf("the waited grant was confirmed %d times, want once (it arrived past its local deadline)", n)
	}
	if got.token <= first.GetLease().GetFencingToken() {
		t.Errorf("the waited run's token %d, want above the first holder's %d (S6)", got.token, first.GetLease().GetFencingToken())
	}
	if got.left <= 0 {
		t.Errorf("the work started with %s left to its local deadline, want some", got.left)
	}
	if got.stored != got.token || got.storedRun != got.runID {
		t.Errorf("the server's lease is token %d of run %s, want the work's token %d of run %s", got.stored, got.storedRun, got.token, got.runID)
	}
	// The confirmation was the same grant asked again, not a second one.
	if n := countEvents(history(t, c, key), leasev1.EventType_EVENT_TYPE_ACQUIRED, got.runID); n != 1 {
		t.Errorf("History shows %d grants of the waited run, want 1", n)
	}
}
