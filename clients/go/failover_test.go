package leasehold_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// The client's own retry after a dropped answer: the Acquire reached the
// server and was granted, its answer was swallowed and the connection cut;
// the client asks the next instance with the same run id and gets the same
// lease, same token (an idempotent retry, one grant in History).
func TestRetryAfterDroppedAnswerKeepsTheToken(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr, shared.Addr})
	direct := dial(t, []string{shared.Addr})
	// A first call through the proxy opens its connection (and makes it
	// the preferred instance) before the answers start to go missing.
	if _, err := c.Get(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	p.DropAnswers(true)
	runID := leasehold.NewRunID()
	var lease *leasehold.Lease
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		o := holdOptions
		o.RunID = runID
		lease, err = c.Hold(context.Background(), key, o)
	}()
	var granted *leasev1.Lease
	testenv.WaitFor(t, 10*time.Second, "the grant on the server", func() bool {
		granted, _ = direct.Get(context.Background(), key)
		return granted.GetRunId() == runID
	})
	if p.Dropped() == 0 {
		t.Fatal("the proxy swallowed 0 answers, want at least 1")
	}
	p.Cut()
	<-done
	if err != nil {
		t.Fatalf("Hold after the dropped answer = %v, want nil", err)
	}
	if lease.FencingToken() != granted.GetFencingToken() || lease.RunID() != runID {
		t.Fatalf("retry got token %d run %s, want the dropped grant's token %d run %s", lease.FencingToken(), lease.RunID(), granted.GetFencingToken(), runID)
	}
	if n := countEvents(history(t, direct, key), leasev1.EventType_EVENT_TYPE_ACQUIRED, runID); n != 1 {
		t.Fatalf("History shows %d grants of the run, want 1", n)
	}
	if err := lease.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// S5 (an idempotent Release): with a single address, the proxy resets the
// connection carrying the Release before the server sees it; the client
// sends it again, to the same address, and it releases. History shows the
// run released once.
func TestReleaseWhoseConnectionIsResetIsSentAgain(t *testing.T) {
	ctx := context.Background()
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr})
	granted, err := c.Acquire(ctx, key, leasehold.AcquireOptions{RunID: leasehold.NewRunID(), TTL: 30 * time.Second})
	if err != nil || !granted.GetAcquired() {
		t.Fatalf("Acquire = %v, %v; want acquired, nil", granted, err)
	}
	runID := granted.GetLease().GetRunId()
	p.DropNextRequest()
	released, err := c.Release(ctx, key, runID)
	if err != nil || !released {
		t.Fatalf("Release after a reset = %v, %v; want true, nil", released, err)
	}
	if n := p.DroppedRequests(); n != 1 {
		t.Fatalf("the proxy dropped %d requests, want 1", n)
	}
	direct := dial(t, []string{shared.Addr})
	if got := eventTypes(history(t, direct, key), runID); !slices.Equal(got, []leasev1.EventType{leasev1.EventType_EVENT_TYPE_ACQUIRED, leasev1.EventType_EVENT_TYPE_RELEASED}) {
		t.Fatalf("History of the run: %v, want ACQUIRED, RELEASED", got)
	}
	if held, err := direct.Get(ctx, key); err != nil || held != nil {
		t.Fatalf("Get after the Release = %v, %v; want nil, nil", held, err)
	}
}

// S2: an Acquire without a run id of the caller's goes out with one the
// client made, so a reset under it is sent again to the same address and
// granted once, as the TypeScript and Python clients' acquire is.
func TestAcquireWithoutRunIDWhoseConnectionIsResetIsSentAgain(t *testing.T) {
	ctx := context.Background()
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr})
	p.DropNextRequest()
	granted, err := c.Acquire(ctx, key, leasehold.AcquireOptions{TTL: 30 * time.Second})
	if err != nil || !granted.GetAcquired() {
		t.Fatalf("Acquire after a reset = %v, %v; want acquired, nil", granted, err)
	}
	if n := p.DroppedRequests(); n != 1 {
		t.Fatalf("the proxy dropped %d requests, want 1", n)
	}
	runID := granted.GetLease().GetRunId()
	direct := dial(t, []string{shared.Addr})
	if got := eventTypes(history(t, direct, key), runID); !slices.Equal(got, []leasev1.EventType{leasev1.EventType_EVENT_TYPE_ACQUIRED}) {
		t.Fatalf("History of the run: %v, want one ACQUIRED", got)
	}
	if _, err := c.Release(ctx, key, runID); err != nil {
		t.Fatal(err)
	}
}

// Revoke is not idempotent (sent again, it could end a lease granted in
// between): a reset under it is an *UnavailableError naming the one attempt,
// and the call is not sent again; the lease is still held.
func TestRevokeWhoseConnectionIsResetIsNotSentAgain(t *testing.T) {
	ctx := context.Background()
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr}, leasehold.WithToken(token(time.Hour, "leasehold:admin")))
	granted, err := c.Acquire(ctx, key, leasehold.AcquireOptions{RunID: leasehold.NewRunID(), TTL: 30 * time.Second})
	if err != nil || !granted.GetAcquired() {
		t.Fatalf("Acquire = %v, %v; want acquired, nil", granted, err)
	}
	runID := granted.GetLease().GetRunId()
	p.DropNextRequest()
	_, err = c.Revoke(ctx, key, "test")
	var unavailable *leasehold.UnavailableError
	if !errors.As(err, &unavailable) {
		t.Fatalf("Revoke after a reset: %v, want an *UnavailableError", err)
	}
	if len(unavailable.Tried) != 1 || !strings.HasPrefix(unavailable.Tried[0], p.Addr+": ") {
		t.Fatalf("attempts %q, want one, to %s", unavailable.Tried, p.Addr)
	}
	if n := p.DroppedRequests(); n != 1 {
		t.Fatalf("the proxy dropped %d requests, want 1", n)
	}
	held, err := c.Get(ctx, key)
	if err != nil || held.GetRunId() != runID {
		t.Fatalf("after the reset Revoke the session shows %v (%v), want run %s", held, err, runID)
	}
	if n := countEvents(history(t, c, key), leasev1.EventType_EVENT_TYPE_REVOKED, runID); n != 0 {
		t.Fatalf("History shows %d revocations, want none", n)
	}
}

// eventTypes is the run's events in History (newest first), oldest first.
func eventTypes(events []*leasev1.Event, runID string) []leasev1.EventType {
	var types []leasev1.EventType
	for _, e := range slices.Backward(events) {
		if e.GetRunId() == runID {
			types = append(types, e.GetType())
		}
	}
	return types
}

// An instance stopped mid-hold (SIGTERM: its streams end UNAVAILABLE): the
// KeepAlive stream moves to the other instance and the lease is kept past
// the deadline the stopped instance last confirmed.
func TestInstanceStoppedMidHold(t *testing.T) {
	key := freshKey(t)
	a, b := testenv.StartServer(t), testenv.StartServer(t)
	c := dial(t, []string{a.Addr, b.Addr})
	lease, err := c.Hold(context.Background(), key, holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	granted := lease.Lease()
	testenv.WaitFor(t, 10*time.Second, "a renewal through the first instance", func() bool { return lease.Lease() != granted })
	stoppedAt := time.Now()
	a.Stop()
	testenv.WaitFor(t, 3*ttl, "a TTL after the stop", func() bool { return time.Since(stoppedAt) > ttl })
	if err := lease.Err(); err != nil {
		t.Fatalf("Err() with one instance stopped = %v, want nil", err)
	}
	if renewed := b.Metric(t, "leasehold_lease_renewals_total", nil); renewed == 0 {
		t.Fatal("the other instance renewed 0 leases, want at least 1")
	}
	if err := lease.Release(context.Background()); err != nil {
		t.Fatalf("Release through the other instance = %v, want nil", err)
	}
}

// L2: the only instance is killed (SIGKILL) mid-hold. The stream keeps
// reconnecting and every attempt is refused; the lease is lost at its local
// deadline, not before, with reason deadline, and the loss names the
// instance and what it did (connection refused), in its message and in its
// cause, an *UnavailableError. Nothing is released after the loss.
func TestOnlyInstanceGoneMidHold(t *testing.T) {
	ctx := context.Background()
	key := freshKey(t)
	s := testenv.StartServer(t)
	// Reconnects at most 200ms apart: many refused attempts before the deadline.
	c := dial(t, []string{s.Addr}, leasehold.WithReconnectBackoff(20*time.Millisecond, 200*time.Millisecond))
	lease, err := c.Hold(ctx, key, holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	granted := lease.Lease()
	testenv.WaitFor(t, 10*time.Second, "a renewal on the stream", func() bool { return lease.Lease() != granted })
	s.Kill()
	killed := time.Now()
	// No renewal can be confirmed from here on: this is the deadline.
	remaining := lease.Remaining()
	if remaining <= 0 {
		t.Fatalf("Remaining() = 0 right after the kill (Err() %v), want the time to the local deadline", lease.Err())
	}
	waitDone(t, lease.Context(), remaining+2*time.Second, "the loss at the local deadline")
	if held := time.Since(killed); held < remaining {
		t.Fatalf("lost %s after the kill, want at least %s (its local deadline)", held, remaining)
	}
	lost := lostCause(t, lease)
	t.Logf("lost: %v", lost)
	if lost.Reason != leasehold.LossDeadline {
		t.Fatalf("loss reason %q, want deadline: %s", lost.Reason, lost.Message)
	}
	if !strings.Contains(lost.Message, s.Addr) || !strings.Contains(lost.Message, "connection refused") {
		t.Fatalf("loss message %q, want it to name %s and \"connection refused\"", lost.Message, s.Addr)
	}
	var unavailable *leasehold.UnavailableError
	if !errors.As(lost, &unavailable) || !errors.Is(lost, leasehold.ErrUnavailable) {
		t.Fatalf("the loss's cause is %v, want an *UnavailableError", errors.Unwrap(lost))
	}
	if len(unavailable.Tried) != 1 || !strings.HasPrefix(unavailable.Tried[0], s.Addr+": ") || !strings.Contains(unavailable.Tried[0], "connection refused") {
		t.Fatalf("the cause names %q, want the one instance, refusing", unavailable.Tried)
	}
	if lease.Remaining() != 0 {
		t.Fatalf("Remaining %s after the loss, want 0", lease.Remaining())
	}
	if err := lease.Release(ctx); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("Release after the loss: %v, want the *LeaseLostError", err)
	}
	// The killed instance's database is the shared server's.
	if n := countEvents(history(t, dial(t, []string{shared.Addr}), key), leasev1.EventType_EVENT_TYPE_RELEASED, lease.RunID()); n != 0 {
		t.Fatalf("History shows %d releases of the lost run, want none", n)
	}
}

func keepAliveStreams(t *testing.T, s *testenv.Server, code string) float64 {
	labels := map[string]string{"method": "leasehold.v1.LeaseService/KeepAlive"}
	if code != "" {
		labels["code"] = code
	}
	return s.Metric(t, "leasehold_rpc_duration_seconds_count", labels)
}

// holdMany holds n leases of fresh keys on c, 32 acquires at a time.
func holdMany(t *testing.T, c *leasehold.Client, n int, o leasehold.HoldOptions) []*leasehold.Lease {
	t.Helper()
	leases := make([]*leasehold.Lease, n)
	errs := make([]error, n)
	sem := make(chan struct{}, 32)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			leases[i], errs[i] = c.Hold(context.Background(), freshKey(t), o)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return leases
}

// renewedAll waits until every lease has had a renewal confirmed.
func renewedAll(t *testing.T, leases []*leasehold.Lease, within time.Duration) {
	t.Helper()
	granted := make([]*leasev1.Lease, len(leases))
	for i, l := range leases {
		granted[i] = l.Lease()
	}
	testenv.WaitFor(t, within, "a renewal of every lease", func() bool {
		for i, l := range leases {
			if l.Err() != nil {
				t.Fatalf("lease %d: Err() = %v, want nil", i, l.Err())
			}
			if l.Lease() == granted[i] {
				return false
			}
		}
		return true
	})
}

// 1,000 leases share one KeepAlive stream: the server counts one stream
// (its KeepAlive calls, counted when they end, after Close).
func TestThousandLeasesOnOneStream(t *testing.T) {
	s := testenv.StartServer(t)
	c, err := leasehold.Dial(context.Background(), []string{s.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	leases := holdMany(t, c, 1000, leasehold.HoldOptions{TTL: 20 * time.Second})
	renewedAll(t, leases, 30*time.Second)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the stream's end on the server", func() bool { return keepAliveStreams(t, s, "") >= 1 })
	if n := keepAliveStreams(t, s, ""); n != 1 {
		t.Fatalf("the server saw %v KeepAlive streams for 1,000 leases, want 1", n)
	}
	if released := s.Metric(t, "leasehold_lease_releases_total", nil); released != 1000 {
		t.Fatalf("Close released %v leases, want 1,000", released)
	}
}

// A server bounding streams to 2 leases refuses the client's one stream of
// 5 (LIMIT_EXCEEDED, max 2); the client lowers its bound and moves the
// leases beyond it to more streams: all five are kept past their first
// deadline, on three streams besides the refused one.
func TestSecondStreamPastTheServersBound(t *testing.T) {
	s := testenv.StartServer(t, "--max-leases-per-stream", "2")
	c, err := leasehold.Dial(context.Background(), []string{s.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	heldAt := time.Now()
	leases := holdMany(t, c, 5, holdOptions)
	renewedAll(t, leases, 10*time.Second)
	testenv.WaitFor(t, 3*ttl, "past the first deadline", func() bool { return time.Since(heldAt) >= ttl })
	renewedAll(t, leases, 2*ttl)
	refused := keepAliveStreams(t, s, "resource_exhausted")
	if refused < 1 {
		t.Fatalf("the server refused %v streams for its bound, want at least 1", refused)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "every stream's end", func() bool { return keepAliveStreams(t, s, "") >= refused+3 })
	// With the bound known up front, no stream is refused.
	c2 := dial(t, []string{s.Addr}, leasehold.WithMaxLeasesPerStream(2))
	before := keepAliveStreams(t, s, "")
	leases = holdMany(t, c2, 5, holdOptions)
	renewedAll(t, leases, 10*time.Second)
	if err := c2.Close(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "three more streams' end", func() bool { return keepAliveStreams(t, s, "") >= before+3 })
	if n := keepAliveStreams(t, s, "") - before; n != 3 {
		t.Fatalf("%v streams for 5 leases at 2 per stream, want 3", n)
	}
	if keepAliveStreams(t, s, "resource_exhausted") != refused {
		t.Fatalf("refused streams %v, want %v: none more once the client knew the bound", keepAliveStreams(t, s, "resource_exhausted"), refused)
	}
}
