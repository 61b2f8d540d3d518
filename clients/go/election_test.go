package leasehold_test

// Leader election (E1) against real servers and PostgreSQL: Campaign,
// Resign, Proclaim, Observe, RunElection and the callbacks, through real
// sockets and a TCP proxy that stalls or refuses the leader's or a
// candidate's connection: the stories of docs/clients.md's "Election" rows.

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
	"google.golang.org/grpc"

	leasehold "leasehold.dev/go"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// queued counts the waiting Acquires of key that srv has queued so far
// (its debug log's "acquire waiting" records): a candidate is waiting in
// line once its own is among them. No answer shows a queued waiter.
func queued(srv *testenv.Server, key leasehold.SessionKey) int {
	n := 0
	for _, line := range strings.Split(srv.Log(), "\n") {
		if strings.Contains(line, `"acquire waiting"`) && strings.Contains(line, `"sessionId":"`+key.SessionID+`"`) {
			n++
		}
	}
	return n
}

// campaignResult is a Campaign's outcome, from a goroutine.
type campaignResult struct {
	l   *leasehold.Leadership
	err error
}

// campaignAsync campaigns on a goroutine; its outcome arrives on the channel.
func campaignAsync(ctx context.Context, c *leasehold.Client, key leasehold.SessionKey, value string, o leasehold.CampaignOptions) <-chan campaignResult {
	out := make(chan campaignResult, 1)
	go func() {
		l, err := c.Campaign(ctx, key, value, o)
		out <- campaignResult{l, err}
	}()
	return out
}

// outcome waits for a campaign's outcome.
func outcome(t *testing.T, ch <-chan campaignResult, within time.Duration, what string) campaignResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(within):
		t.Fatalf("%s: no outcome within %s", what, within)
		return campaignResult{}
	}
}

// leads waits for a campaign to lead.
func leads(t *testing.T, ch <-chan campaignResult, within time.Duration, what string) *leasehold.Leadership {
	t.Helper()
	r := outcome(t, ch, within, what)
	if r.err != nil {
		t.Fatalf("%s: Campaign = %v, want a leadership", what, r.err)
	}
	return r.l
}

func campaign(t *testing.T, c *leasehold.Client, key leasehold.SessionKey, value string, o leasehold.CampaignOptions) *leasehold.Leadership {
	t.Helper()
	l, err := c.Campaign(context.Background(), key, value, o)
	if err != nil {
		t.Fatalf("Campaign %q = %v, want a leadership", value, err)
	}
	return l
}

func resign(t *testing.T, l *leasehold.Leadership) {
	t.Helper()
	if err := l.Resign(context.Background()); err != nil {
		t.Fatalf("Resign = %v", err)
	}
}

func ended(t *testing.T, l *leasehold.Leadership, within time.Duration, what string) leasehold.StopReason {
	t.Helper()
	select {
	case <-l.Ended():
		return l.StopReason()
	case <-time.After(within):
		t.Fatalf("%s: term %d not ended within %s", what, l.Term(), within)
		return leasehold.StopReason{}
	}
}

// grantedTo is the holders the session was granted to, oldest first.
func grantedTo(t *testing.T, c *leasehold.Client, key leasehold.SessionKey) []string {
	t.Helper()
	var holders []string
	for _, e := range history(t, c, key) {
		if e.GetType() == leasev1.EventType_EVENT_TYPE_ACQUIRED {
			holders = append(holders, e.GetHolder())
		}
	}
	slices.Reverse(holders)
	return holders
}

// leaveNothingBehind proves that no candidate is left in line before a new
// one: the new one queues (the queue's arrivals count so far is before),
// the holder resigns, and the new one is granted at once (well before the
// holder's 60s deadline), the session's grants being the holder's and then
// its own.
func leaveNothingBehind(t *testing.T, srv *testenv.Server, key leasehold.SessionKey, holder *leasehold.Leadership, before int) {
	t.Helper()
	c := dial(t, []string{srv.Addr})
	third := campaignAsync(context.Background(), c, key, "third", leasehold.CampaignOptions{TTL: time.Minute})
	testenv.WaitFor(t, 10*time.Second, "the third candidate waiting", func() bool { return queued(srv, key) > before })
	resign(t, holder)
	won := leads(t, third, 5*time.Second, "the third candidate")
	if won.Value() != "third" {
		t.Fatalf("leader %q, want third", won.Value())
	}
	if granted, deadline := won.Lease().Lease().GetAcquiredAt().AsTime(), holder.Lease().Lease().GetExpiresAt().AsTime(); !granted.Before(deadline.Add(-50 * time.Second)) {
		t.Fatalf("third granted at %v, want at the resign, long before the holder's deadline %v", granted, deadline)
	}
	if got := grantedTo(t, c, key); !slices.Equal(got, []string{holder.Value(), "third"}) {
		t.Fatalf("grants %v, want [%s third]: no other candidate granted", got, holder.Value())
	}
	resign(t, won)
}

// E1, S1, S6: three candidates, one leader at a time (each starts only
// after the last one's OnStoppedLeading), terms strictly increasing.
func TestElectionThreeCandidatesOneLeaderAtATimeTermsIncreasing(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	var mu sync.Mutex
	leading := map[string]bool{}
	var overlaps []string
	var terms []int64
	results := make(chan campaignResult, 3)
	for _, name := range []string{"a", "b", "c"} {
		o := leasehold.CampaignOptions{
			TTL: 5 * time.Second,
			OnStartedLeading: func(term int64) {
				mu.Lock()
				defer mu.Unlock()
				for other := range leading {
					overlaps = append(overlaps, name+" started while "+other+" led")
				}
				leading[name] = true
				terms = append(terms, term)
			},
			OnStoppedLeading: func(int64, leasehold.StopReason) {
				mu.Lock()
				defer mu.Unlock()
				delete(leading, name)
			},
		}
		go func() {
			l, err := dial(t, []string{srv.Addr}).Campaign(context.Background(), key, name, o)
			results <- campaignResult{l, err}
		}()
	}
	observer := dial(t, []string{srv.Addr})
	var order []*leasehold.Leadership
	for round := range 3 {
		l := leads(t, results, 30*time.Second, "the next leader")
		order = append(order, l)
		got, err := observer.Leader(context.Background(), key)
		if err != nil || got == nil || got.Value != l.Value() || got.Term != l.Term() || got.RunID != l.RunID() {
			t.Fatalf("Leader = %+v, %v; want %s, term %d, run %s", got, err, l.Value(), l.Term(), l.RunID())
		}
		if round == 0 {
			testenv.WaitFor(t, 10*time.Second, "the other two waiting", func() bool { return queued(srv, key) >= 2 })
		}
		resign(t, l)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(overlaps) > 0 {
		t.Fatalf("overlapping terms: %v", overlaps)
	}
	if len(terms) != 3 || terms[0] != order[0].Term() || terms[1] != order[1].Term() || terms[2] != order[2].Term() {
		t.Fatalf("OnStartedLeading terms %v, want the leaders' in order", terms)
	}
	if !(terms[0] < terms[1] && terms[1] < terms[2]) {
		t.Fatalf("terms %v, want strictly increasing", terms)
	}
	if values := map[string]bool{order[0].Value(): true, order[1].Value(): true, order[2].Value(): true}; len(values) != 3 {
		t.Fatalf("leaders %v, want each candidate once", values)
	}
	if got, err := observer.Leader(context.Background(), key); err != nil || got != nil {
		t.Fatalf("Leader after the last resign = %+v, %v; want none", got, err)
	}
}

// E1: candidates waiting on one instance lead in their arrival order (the
// server's one FIFO per key).
func TestElectionCandidatesWaitingOnOneInstanceLeadInArrivalOrder(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	first := campaign(t, dial(t, []string{srv.Addr}), key, "first", leasehold.CampaignOptions{TTL: time.Minute})
	names := []string{"b", "c", "d"}
	var wins []<-chan campaignResult
	for i, name := range names {
		wins = append(wins, campaignAsync(context.Background(), dial(t, []string{srv.Addr}), key, name, leasehold.CampaignOptions{TTL: time.Minute}))
		testenv.WaitFor(t, 10*time.Second, name+" waiting", func() bool { return queued(srv, key) >= i+1 })
	}
	resign(t, first)
	var order []string
	for _, win := range wins {
		l := leads(t, win, 5*time.Second, "the next in line")
		order = append(order, l.Value())
		resign(t, l)
	}
	if !slices.Equal(order, names) {
		t.Fatalf("led in the order %v, want %v", order, names)
	}
}

// E1: Resign ends the term at once (its Context, ErrResigned) and the
// waiting candidate is granted at once, long before the first term's
// deadline.
func TestElectionResignHandsOverAtOnce(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	first := campaign(t, dial(t, []string{srv.Addr}), key, "first", leasehold.CampaignOptions{TTL: time.Minute})
	next := campaignAsync(context.Background(), dial(t, []string{srv.Addr}), key, "second", leasehold.CampaignOptions{TTL: time.Minute})
	testenv.WaitFor(t, 10*time.Second, "the second candidate waiting", func() bool { return queued(srv, key) >= 1 })
	resign(t, first)
	if cause := context.Cause(first.Context()); !errors.Is(cause, leasehold.ErrResigned) {
		t.Fatalf("Context after Resign: cause %v, want ErrResigned", cause)
	}
	second := leads(t, next, 5*time.Second, "the second candidate")
	if second.Term() <= first.Term() {
		t.Fatalf("second term %d, want above %d", second.Term(), first.Term())
	}
	if granted, deadline := second.Lease().Lease().GetAcquiredAt().AsTime(), first.Lease().Lease().GetExpiresAt().AsTime(); !granted.Before(deadline.Add(-50 * time.Second)) {
		t.Fatalf("second granted at %v, want at the resign, long before the first's deadline %v", granted, deadline)
	}
	resign(t, second)
}

// E1, L2: the resigning leader's OnStoppedLeading has returned before the
// waiting candidate is granted: the one stops acting before the next starts.
func TestElectionResignLetsTheNextInOnlyAfterOnStoppedLeading(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	next := make(chan campaignResult, 1)
	var overlapped bool
	first := campaign(t, dial(t, []string{srv.Addr}), key, "first", leasehold.CampaignOptions{
		TTL: time.Minute,
		OnStoppedLeading: func(int64, leasehold.StopReason) {
			// Still stopping: the successor must not lead yet. A second
			// is the window in which it would (it is granted within
			// milliseconds of a release).
			select {
			case r := <-next:
				overlapped = true
				next <- r
			case <-time.After(time.Second):
			}
		},
	})
	c := dial(t, []string{srv.Addr})
	go func() {
		l, err := c.Campaign(context.Background(), key, "second", leasehold.CampaignOptions{TTL: time.Minute})
		next <- campaignResult{l, err}
	}()
	testenv.WaitFor(t, 10*time.Second, "the second candidate waiting", func() bool { return queued(srv, key) >= 1 })
	resign(t, first)
	if overlapped {
		t.Fatal("the second candidate led while the first's OnStoppedLeading was still running")
	}
	second := leads(t, next, 5*time.Second, "the second candidate")
	resign(t, second)
}

// E1: Proclaim changes the advertised value in the same term; refused once
// the term is over; a value longer than the holder label is refused before
// any call, naming the field.
func TestElectionProclaimKeepsTheTermAndIsRefusedOnceOver(t *testing.T) {
	key := freshKey(t)
	c := dial(t, []string{shared.Addr})
	l := campaign(t, c, key, "v1", leasehold.CampaignOptions{TTL: 10 * time.Second})
	if err := l.Proclaim(context.Background(), "v2"); err != nil {
		t.Fatalf("Proclaim = %v", err)
	}
	if l.Value() != "v2" {
		t.Fatalf("Value() = %q, want v2", l.Value())
	}
	if got, err := c.Leader(context.Background(), key); err != nil || got.Value != "v2" || got.Term != l.Term() || got.RunID != l.RunID() {
		t.Fatalf("Leader = %+v, %v; want v2 in term %d", got, err, l.Term())
	}
	resign(t, l)
	if err := l.Proclaim(context.Background(), "v3"); !errors.Is(err, leasehold.ErrResigned) {
		t.Fatalf("Proclaim after Resign = %v, want ErrResigned", err)
	}
	if got, err := c.Leader(context.Background(), key); err != nil || got != nil {
		t.Fatalf("Leader after Resign = %+v, %v; want none", got, err)
	}
	_, err := c.Campaign(context.Background(), key, strings.Repeat("x", 65), leasehold.CampaignOptions{})
	var bad *leasehold.InvalidArgumentError
	if !errors.As(err, &bad) || bad.Field != "value" {
		t.Fatalf("Campaign with a 65-character value = %v, want an *InvalidArgumentError naming value", err)
	}
}

// databaseNow is the database clock now.
func databaseNow(t *testing.T) time.Time {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.Get().LeaseDB)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var now time.Time
	if err := conn.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// E1, L2, S7: the leader's stream stalls; its term ends (Context done,
// StopLost with reason deadline) before the database grants the next one,
// read on the database clock; the new term's write passes the fence, which
// then refuses the old term, and the fencing interceptor no longer sends
// the old leader's writes at all.
func TestElectionStalledLeaderStopsBeforeTheNextStartsAndTheFenceRefusesTheOldTerm(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	p := testenv.StartProxy(t, srv.Addr)
	old := campaign(t, dial(t, []string{p.Addr}), key, "old", leasehold.CampaignOptions{TTL: 2 * time.Second, SafetyMargin: 600 * time.Millisecond})
	docs := guardedStore(t, store.Addr, grpc.WithChainUnaryInterceptor(leasehold.UnaryFencingInterceptor()))
	put := func(ctx context.Context, value string, token int64) error {
		_, err := docs.Put(bearer(ctx), &guardedv1.PutRequest{Key: key2proto(key), Name: "doc", Value: []byte(value), FencingToken: token})
		return err
	}
	if err := put(leasehold.WithLease(context.Background(), old.Lease()), "old", old.Term()); err != nil {
		t.Fatal(err)
	}
	next := campaignAsync(context.Background(), dial(t, []string{srv.Addr}), key, "new", leasehold.CampaignOptions{TTL: 5 * time.Second})
	testenv.WaitFor(t, 10*time.Second, "the next candidate waiting", func() bool { return queued(srv, key) >= 1 })
	p.Stall()
	waitDone(t, old.Context(), 10*time.Second, "the stalled leader's term")
	stoppedBefore := databaseNow(t)
	why := ended(t, old, 5*time.Second, "the stalled leader")
	var lost *leasehold.LeaseLostError
	if why.Kind != leasehold.StopLost || !errors.As(why.Err, &lost) || lost.Reason != leasehold.LossDeadline {
		t.Fatalf("StopReason %+v, want lost at the local deadline", why)
	}
	successor := leads(t, next, 20*time.Second, "the successor")
	// L2 on the database clock: the old leader had stopped (its Context
	// done before the reading) before the successor was granted.
	if granted := successor.Lease().Lease().GetAcquiredAt().AsTime(); !stoppedBefore.Before(granted) {
		t.Fatalf("old term stopped by %v, successor granted at %v: want the stop first", stoppedBefore, granted)
	}
	if successor.Term() <= old.Term() {
		t.Fatalf("successor term %d, want above %d", successor.Term(), old.Term())
	}
	if err := put(leasehold.WithLease(context.Background(), successor.Lease()), "new", successor.Term()); err != nil {
		t.Fatalf("the new term's write = %v, want it accepted", err)
	}
	if err := put(leasehold.WithLease(context.Background(), old.Lease()), "old again", old.Term()); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("the old leader's write through the interceptor = %v, want it not sent (the *LeaseLostError)", err)
	}
	err := put(context.Background(), "old again", old.Term())
	var stale *leasehold.StaleFencingTokenError
	if !errors.As(leasehold.FromError(err), &stale) || stale.Presented != old.Term() || stale.Highest != successor.Term() {
		t.Fatalf("the old term's write = %v, want STALE_FENCING_TOKEN presented %d highest %d", err, old.Term(), successor.Term())
	}
	doc, err := docs.Get(bearer(context.Background()), &guardedv1.GetRequest{Key: key2proto(key), Name: "doc"})
	if err != nil || string(doc.GetValue()) != "new" {
		t.Fatalf("doc = %q, %v; want new", doc.GetValue(), err)
	}
	p.Resume()
	resign(t, successor)
}

// E1: a waiting candidate whose connection is lost returns the
// *UnavailableError, never leads (no OnStoppedLeading), and leaves no
// candidate behind.
func TestElectionWaitingCandidateWhoseConnectionIsLostLeavesNoCandidateBehind(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	p := testenv.StartProxy(t, srv.Addr)
	calls := &stopCalls{}
	lost := campaignAsync(context.Background(), dial(t, []string{p.Addr}), key, "lost", leasehold.CampaignOptions{
		TTL:              time.Minute,
		OnStoppedLeading: calls.record,
	})
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting", func() bool { return queued(srv, key) >= 1 })
	p.Refuse()
	if r := outcome(t, lost, 20*time.Second, "the cut-off campaign"); !errors.Is(r.err, leasehold.ErrUnavailable) {
		t.Fatalf("Campaign cut off = %v, %v; want the *UnavailableError", r.l, r.err)
	}
	leaveNothingBehind(t, srv, key, holder, 1)
	calls.mu.Lock()
	defer calls.mu.Unlock()
	if len(calls.terms) != 0 {
		t.Fatalf("OnStoppedLeading called for terms %v, want never (no term began)", calls.terms)
	}
}

// E1: a campaign cancelled while waiting returns ctx's cause and leaves no
// waiter behind.
func TestElectionCampaignCancelledWhileWaitingLeavesNoWaiter(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	waiter := campaignAsync(ctx, dial(t, []string{srv.Addr}), key, "waiter", leasehold.CampaignOptions{TTL: time.Minute})
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting", func() bool { return queued(srv, key) >= 1 })
	cancel()
	if r := outcome(t, waiter, 10*time.Second, "the cancelled campaign"); !errors.Is(r.err, context.Canceled) {
		t.Fatalf("cancelled Campaign = %v, %v; want context.Canceled", r.l, r.err)
	}
	leaveNothingBehind(t, srv, key, holder, 1)
}

// E1: a campaign whose Timeout passes is not acquired and names the
// leader, and leaves no waiter behind.
func TestElectionCampaignTimeoutNamesTheLeader(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	_, err := dial(t, []string{srv.Addr}).Campaign(context.Background(), key, "late", leasehold.CampaignOptions{Timeout: 300 * time.Millisecond})
	var na *leasehold.NotAcquiredError
	if !errors.As(err, &na) || na.Current.GetHolder() != "holder" {
		t.Fatalf("Campaign past its Timeout = %v, want a *NotAcquiredError naming holder", err)
	}
	leaveNothingBehind(t, srv, key, holder, queued(srv, key))
}

// E1: one waiting Acquire is bounded (the server's --max-wait; here a
// 200ms WaitChunk): the campaign asks again until the leader resigns, and
// then leads; the session is granted to the holder and then to the
// candidate only (no wait left anything behind).
func TestElectionCampaignAsksAgainWheneverOneWaitRunsOut(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	c := dial(t, []string{srv.Addr})
	holder := campaign(t, c, key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	patient := campaignAsync(context.Background(), c, key, "patient", leasehold.CampaignOptions{TTL: time.Minute, WaitChunk: 200 * time.Millisecond})
	testenv.WaitFor(t, 10*time.Second, "three waits, one after another", func() bool { return queued(srv, key) >= 3 })
	resign(t, holder)
	won := leads(t, patient, 5*time.Second, "the patient candidate")
	if won.Term() <= holder.Term() {
		t.Fatalf("term %d after %d, want higher", won.Term(), holder.Term())
	}
	if got := grantedTo(t, c, key); !slices.Equal(got, []string{"holder", "patient"}) {
		t.Fatalf("grants %v, want [holder patient]", got)
	}
	resign(t, won)
}

// E1, L2, S4: a grant whose answer came after its local deadline is
// released and the campaign goes on, with a new run (the released run
// never holds the session again, S4), and leads. Here each answer chunk is
// held 800ms: the waited grant's answer comes after its 1s lease expired,
// so the re-acquire that would confirm it finds the run's lease ended.
func TestElectionCampaignWhoseGrantCameLateGoesOnWithANewRunAndLeads(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	c := dial(t, []string{p.Addr})
	direct := dial(t, []string{shared.Addr})
	if _, err := c.Get(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	// Every answer chunk 800ms late: past the 500ms a 1s lease with a
	// 500ms margin leaves, until a late grant has been released.
	p.Delay(800 * time.Millisecond)
	campaigning := campaignAsync(context.Background(), c, key, "patient", leasehold.CampaignOptions{TTL: time.Second, SafetyMargin: 500 * time.Millisecond})
	late := ""
	testenv.WaitFor(t, 20*time.Second, "a late grant ended", func() bool {
		for _, e := range history(t, direct, key) {
			if e.GetType() == leasev1.EventType_EVENT_TYPE_ACQUIRED {
				late = e.GetRunId()
			}
		}
		now, err := direct.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		return late != "" && now.GetRunId() != late
	})
	p.Delay(0)
	l := leads(t, campaigning, 20*time.Second, "the campaign")
	if l.RunID() == late {
		t.Fatalf("led with run %s, the one whose late grant was released", late)
	}
	leader, err := direct.Leader(context.Background(), key)
	if err != nil || leader == nil || leader.RunID != l.RunID() || leader.Term != l.Term() {
		t.Fatalf("Leader = %+v, %v; want run %s in term %d", leader, err, l.RunID(), l.Term())
	}
	resign(t, l)
}

// E1: a campaign on a keeper gives up when its Timeout passes even when
// the keeper's stream is cut while it waits: the acquire sent again on the
// re-attached stream waits only what is left of the first one's wait.
func TestElectionCampaignTimeoutOnAKeeperHoldsAcrossAReattach(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	p := testenv.StartProxy(t, srv.Addr)
	c := dial(t, []string{p.Addr})
	k := newKeeper(t, c, leasehold.WithKeeperTTL(30*time.Second))
	const timeout = 3 * time.Second
	start := time.Now()
	late := campaignAsync(context.Background(), c, key, "late", leasehold.CampaignOptions{Keeper: k, Timeout: timeout})
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting on its keeper", func() bool { return queued(srv, key) >= 1 })
	// Half-way through the Timeout (a point in time, not a wait for an
	// outcome): the wait sent again must end with the Timeout, not a
	// whole Timeout after the re-attach.
	time.Sleep(timeout/2 - time.Since(start))
	p.Cut()
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting again on the re-attached keeper", func() bool { return queued(srv, key) >= 2 })
	r := outcome(t, late, 10*time.Second, "the campaign past its Timeout")
	took := time.Since(start)
	var na *leasehold.NotAcquiredError
	if !errors.As(r.err, &na) || na.Current.GetHolder() != "holder" {
		t.Fatalf("Campaign past its Timeout on a keeper = %v, %v; want a *NotAcquiredError naming holder", r.l, r.err)
	}
	if took > timeout+time.Second {
		t.Fatalf("Campaign with a %s Timeout returned after %s, want within a second of it", timeout, took)
	}
	leaveNothingBehind(t, srv, key, holder, queued(srv, key))
}

// stopCalls records OnStoppedLeading's calls.
type stopCalls struct {
	mu    sync.Mutex
	terms []int64
	why   []leasehold.StopReason
}

func (s *stopCalls) record(term int64, why leasehold.StopReason) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.terms = append(s.terms, term)
	s.why = append(s.why, why)
}

// once asserts exactly one call, for term, of kind.
func (s *stopCalls) once(t *testing.T, term int64, kind leasehold.StopKind) leasehold.StopReason {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.terms) != 1 || s.terms[0] != term || s.why[0].Kind != kind {
		t.Fatalf("OnStoppedLeading calls: terms %v, reasons %+v; want exactly one, term %d, %s", s.terms, s.why, term, kind)
	}
	return s.why[0]
}

// E1: OnStoppedLeading is called exactly once per term in every ending:
// resign, revoke, the caller's cancel, and a loss at the local deadline;
// whatever follows (a Resign after it) calls it no more.
func TestElectionStoppedLeadingOncePerTerm(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	start := func(t *testing.T, c *leasehold.Client, o leasehold.CampaignOptions) (*leasehold.Leadership, *stopCalls, leasehold.SessionKey) {
		key := freshKey(t)
		calls := &stopCalls{}
		var started []int64
		o.OnStartedLeading = func(term int64) { started = append(started, term) }
		o.OnStoppedLeading = calls.record
		l := campaign(t, c, key, "me", o)
		if !slices.Equal(started, []int64{l.Term()}) {
			t.Fatalf("OnStartedLeading %v before Campaign returned, want [%d]", started, l.Term())
		}
		return l, calls, key
	}
	t.Run("resign", func(t *testing.T) {
		c := dial(t, []string{srv.Addr})
		l, calls, key := start(t, c, leasehold.CampaignOptions{TTL: 5 * time.Second})
		resign(t, l)
		resign(t, l)
		calls.once(t, l.Term(), leasehold.StopResigned)
		if got, err := c.Leader(context.Background(), key); err != nil || got != nil {
			t.Fatalf("Leader after Resign = %+v, %v; want none", got, err)
		}
	})
	t.Run("revoked", func(t *testing.T) {
		l, calls, key := start(t, dial(t, []string{srv.Addr}), leasehold.CampaignOptions{TTL: 5 * time.Second})
		if revoked, err := admin(t, srv).Revoke(context.Background(), key, "an operator ended it"); err != nil || !revoked {
			t.Fatalf("Revoke = %v, %v", revoked, err)
		}
		ended(t, l, 10*time.Second, "the revoked term")
		resign(t, l)
		why := calls.once(t, l.Term(), leasehold.StopLost)
		var lost *leasehold.LeaseLostError
		if !errors.As(why.Err, &lost) || lost.Reason != leasehold.LossRevoked {
			t.Fatalf("StopReason.Err = %v, want a *LeaseLostError (revoked)", why.Err)
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		c := dial(t, []string{srv.Addr})
		key := freshKey(t)
		calls := &stopCalls{}
		shutdown := errors.New("shutting down")
		ctx, cancel := context.WithCancelCause(context.Background())
		var term int64
		err := c.RunElection(ctx, key, "me", leasehold.ElectionOptions{
			CampaignOptions: leasehold.CampaignOptions{TTL: 5 * time.Second, OnStoppedLeading: calls.record},
		}, func(ctx context.Context, l *leasehold.Leadership) error {
			term = l.Term()
			cancel(shutdown)
			<-ctx.Done()
			return context.Cause(ctx)
		})
		if err != nil {
			t.Fatalf("RunElection cancelled while leading = %v, want nil", err)
		}
		if why := calls.once(t, term, leasehold.StopCancelled); !errors.Is(why.Err, shutdown) {
			t.Fatalf("StopReason.Err = %v, want the cancel's cause", why.Err)
		}
		if got, err := c.Leader(context.Background(), key); err != nil || got != nil {
			t.Fatalf("Leader after the cancel = %+v, %v; want none (released)", got, err)
		}
	})
	t.Run("lost", func(t *testing.T) {
		p := testenv.StartProxy(t, srv.Addr)
		l, calls, _ := start(t, dial(t, []string{p.Addr}), leasehold.CampaignOptions{TTL: 1500 * time.Millisecond, SafetyMargin: 500 * time.Millisecond})
		p.Stall()
		ended(t, l, 10*time.Second, "the stalled term")
		resign(t, l)
		p.Resume()
		why := calls.once(t, l.Term(), leasehold.StopLost)
		var lost *leasehold.LeaseLostError
		if !errors.As(why.Err, &lost) || lost.Reason != leasehold.LossDeadline {
			t.Fatalf("StopReason.Err = %v, want a *LeaseLostError (deadline)", why.Err)
		}
	})
}

// E1: RunElection runs lead once per term, calls the callbacks once per
// term (OnNewLeader with its own term too), campaigns again after a term,
// releases the last when ctx ends, and leaves no goroutine behind.
func TestElectionRunElectionLeadsPerTermAndCampaignsAgain(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	key := freshKey(t)
	c, err := leasehold.Dial(context.Background(), []string{srv.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var mu sync.Mutex
	var started, stopped, leaders []int64
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	terms := 0
	err = c.RunElection(ctx, key, "me", leasehold.ElectionOptions{
		CampaignOptions: leasehold.CampaignOptions{
			TTL:              5 * time.Second,
			OnStartedLeading: func(term int64) { mu.Lock(); started = append(started, term); mu.Unlock() },
			OnStoppedLeading: func(term int64, _ leasehold.StopReason) { mu.Lock(); stopped = append(stopped, term); mu.Unlock() },
		},
		OnNewLeader: func(l leasehold.Leader) { mu.Lock(); leaders = append(leaders, l.Term); mu.Unlock() },
	}, func(ctx context.Context, l *leasehold.Leadership) error {
		terms++
		if ctx.Err() != nil {
			t.Errorf("lead called with its term over: %v", context.Cause(ctx))
		}
		testenv.WaitFor(t, 10*time.Second, "OnNewLeader with this term", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return slices.Contains(leaders, l.Term())
		})
		if terms == 2 {
			cancel()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("RunElection = %v, want nil once ctx ended", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if terms != 2 || len(started) != 2 || !slices.Equal(stopped, started) || started[0] >= started[1] {
		t.Fatalf("%d terms, started %v, stopped %v; want 2, each stopped once, increasing", terms, started, stopped)
	}
	if got, err := c.Leader(context.Background(), key); err != nil || got != nil {
		t.Fatalf("Leader after RunElection = %+v, %v; want none", got, err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}

// E1: a waiting campaign whose connection is lost is started again by
// RunElection, and leads once the leader resigns.
func TestElectionRunElectionCampaignsAgainAfterALostWaitingCall(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	p := testenv.StartProxy(t, srv.Addr)
	log := &messages{}
	c := dial(t, []string{p.Addr}, leasehold.WithLogger(slog.New(log)))
	var led []int64
	done := make(chan error, 1)
	go func() {
		done <- c.RunElection(context.Background(), key, "patient", leasehold.ElectionOptions{
			CampaignOptions: leasehold.CampaignOptions{TTL: time.Minute},
			Once:            true,
		}, func(ctx context.Context, l *leasehold.Leadership) error {
			led = append(led, l.Term())
			return nil
		})
	}()
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting", func() bool { return queued(srv, key) >= 1 })
	p.Refuse()
	testenv.WaitFor(t, 20*time.Second, "the campaign lost and started again", func() bool { return log.count(leasehold.MsgCampaignAgain) >= 1 })
	p.Admit()
	testenv.WaitFor(t, 20*time.Second, "the candidate waiting again", func() bool { return queued(srv, key) >= 2 })
	resign(t, holder)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("RunElection = %v, want nil after its one term", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("RunElection did not lead its one term and return within 20s")
	}
	if len(led) != 1 || led[0] <= holder.Term() {
		t.Fatalf("led terms %v, want one above %d", led, holder.Term())
	}
	if got, err := c.Leader(context.Background(), key); err != nil || got != nil {
		t.Fatalf("Leader after RunElection = %+v, %v; want none", got, err)
	}
}

// E1: RunElection started while no instance answers still calls
// OnNewLeader once one does: its Observe keeps trying, as after a
// reconnect, rather than ending with the first failed call.
func TestElectionRunElectionOnNewLeaderAfterTheServersWereOutOfReachAtStart(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	p.Refuse()
	log := &messages{}
	c := dial(t, []string{p.Addr}, leasehold.WithLogger(slog.New(log)))
	var mu sync.Mutex
	var leaders []int64
	go func() {
		// The campaign has failed twice: the observer's first calls have
		// failed too. Then the instance is in reach again.
		for deadline := time.Now().Add(20 * time.Second); log.count(leasehold.MsgCampaignAgain) < 2 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		p.Admit()
	}()
	var led int64
	err := c.RunElection(context.Background(), key, "started-early", leasehold.ElectionOptions{
		CampaignOptions: leasehold.CampaignOptions{TTL: 5 * time.Second},
		OnNewLeader:     func(l leasehold.Leader) { mu.Lock(); leaders = append(leaders, l.Term); mu.Unlock() },
		Once:            true,
	}, func(ctx context.Context, l *leasehold.Leadership) error {
		led = l.Term()
		testenv.WaitFor(t, 10*time.Second, "OnNewLeader with this term", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return slices.Contains(leaders, l.Term())
		})
		return nil
	})
	if err != nil || led == 0 {
		t.Fatalf("RunElection = %v after leading term %d, want nil after one term", err, led)
	}
}

// observeInto runs Observe on a goroutine, sending each change (and an
// error, as the last) to the channel; stop with cancel, then wait on done.
func observeInto(ctx context.Context, c *leasehold.Client, key leasehold.SessionKey) (changes <-chan leasehold.ElectionChange, errs <-chan error, done <-chan struct{}) {
	ch := make(chan leasehold.ElectionChange, 64)
	ech := make(chan error, 1)
	d := make(chan struct{})
	go func() {
		defer close(d)
		for change, err := range c.Observe(ctx, key) {
			if err != nil {
				ech <- err
				return
			}
			ch <- change
		}
	}()
	return ch, ech, d
}

func nextChange(t *testing.T, changes <-chan leasehold.ElectionChange, errs <-chan error, what string) leasehold.ElectionChange {
	t.Helper()
	select {
	case ch := <-changes:
		return ch
	case err := <-errs:
		t.Fatalf("%s: Observe ended with %v", what, err)
	case <-time.After(20 * time.Second):
		t.Fatalf("%s: no change within 20s", what)
	}
	return leasehold.ElectionChange{}
}

type seenChange struct {
	Type leasehold.ChangeType
	Term int64
}

// E1: Observe yields the current leader first, then every change in order
// (a proclaimed value, a resignation, a new term), across an instance
// stopped mid-watch: the terms begun and ended while the watcher could
// reach no instance are read from History.
func TestElectionObserveYieldsEveryChangeInOrderAcrossAStoppedInstance(t *testing.T) {
	one, two := testenv.StartServer(t), testenv.StartServer(t)
	key := freshKey(t)
	// The watcher reaches the second instance through a proxy, refused
	// while the changes below are made: they can only reach it through
	// History.
	toTwo := testenv.StartProxy(t, two.Addr)
	watcher := dial(t, []string{one.Addr, toTwo.Addr})
	actor := dial(t, []string{two.Addr})
	o := leasehold.CampaignOptions{TTL: 10 * time.Second}
	first := campaign(t, actor, key, "first", o)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes, errs, done := observeInto(ctx, watcher, key)
	var seen []leasehold.ElectionChange
	next := func(what string) { seen = append(seen, nextChange(t, changes, errs, what)) }
	next("the current leader")
	if err := first.Proclaim(context.Background(), "first-v2"); err != nil {
		t.Fatal(err)
	}
	next("the proclaimed value")
	resign(t, first)
	next("the first term's end")
	// The watcher's instance stops; before its watch can be back on the
	// other instance, two terms begin and one ends.
	toTwo.Refuse()
	one.Stop()
	second := campaign(t, actor, key, "second", o)
	resign(t, second)
	third := campaign(t, actor, key, "third", o)
	toTwo.Admit()
	next("the second term")
	next("the second term's end")
	next("the third term")
	resign(t, third)
	next("the third term's end")
	cancel()
	<-done
	got := make([]seenChange, len(seen))
	for i, ch := range seen {
		got[i] = seenChange{ch.Type, ch.Term}
	}
	want := []seenChange{
		{leasehold.ChangeCurrent, first.Term()},
		{leasehold.ChangeProclaimed, first.Term()},
		{leasehold.ChangeEnded, first.Term()},
		{leasehold.ChangeElected, second.Term()},
		{leasehold.ChangeEnded, second.Term()},
		{leasehold.ChangeElected, third.Term()},
		{leasehold.ChangeEnded, third.Term()},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("changes %v, want %v", got, want)
	}
	if seen[1].Leader.Value != "first-v2" || seen[3].Leader.Value != "second" || seen[6].How != "resigned" {
		t.Fatalf("proclaimed %+v, second %+v, last end %+v; want first-v2, second, resigned", seen[1].Leader, seen[3].Leader, seen[6])
	}
}

// E1: a term granted between a fresh snapshot (nobody leading) and the
// History read after it is seen elected, not ended, and its end is seen
// once, as it happened. The watcher's first History read after its watch
// is cut lets that term begin first: the snapshot shows nobody, History
// shows the term.
func TestElectionObserveTermGrantedBetweenTheSnapshotAndHistoryIsElectedNotEnded(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	actor := dial(t, []string{shared.Addr})
	o := leasehold.CampaignOptions{TTL: 30 * time.Second}
	var armed atomic.Bool
	var second atomic.Pointer[leasehold.Leadership]
	hook := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if strings.HasSuffix(method, "/History") && armed.CompareAndSwap(true, false) {
			l, err := actor.Campaign(ctx, key, "second", o)
			if err != nil {
				return err
			}
			second.Store(l)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	watcher := dial(t, []string{p.Addr}, leasehold.WithDialOptions(grpc.WithChainUnaryInterceptor(hook)))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes, errs, done := observeInto(ctx, watcher, key)
	var seen []leasehold.ElectionChange
	next := func(what string) { seen = append(seen, nextChange(t, changes, errs, what)) }
	next("the current leader (none)")
	first := campaign(t, actor, key, "first", o)
	next("the first term")
	resign(t, first)
	next("the first term's end")
	// The watch is cut; it comes back with a fresh snapshot (nobody leads).
	armed.Store(true)
	p.Cut()
	next("the second term")
	if second.Load() == nil {
		t.Fatal("the second term began without the watcher's History read")
	}
	// Nothing else is yielded until the second term really ends.
	select {
	case ch := <-changes:
		t.Fatalf("change %+v while the second term leads, want none", ch)
	case err := <-errs:
		t.Fatalf("Observe ended with %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	resign(t, second.Load())
	next("the second term's end")
	cancel()
	<-done
	got := make([]seenChange, len(seen))
	for i, ch := range seen {
		got[i] = seenChange{ch.Type, ch.Term}
	}
	want := []seenChange{
		{leasehold.ChangeCurrent, 0},
		{leasehold.ChangeElected, first.Term()},
		{leasehold.ChangeEnded, first.Term()},
		{leasehold.ChangeElected, second.Load().Term()},
		{leasehold.ChangeEnded, second.Load().Term()},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("changes %v, want %v", got, want)
	}
	if seen[4].How != "resigned" {
		t.Fatalf("the second term's end %+v, want resigned", seen[4])
	}
}

// E1: a term that expires with nobody to succeed it is seen as ended,
// expired.
func TestElectionObserveSeesATermExpireWithNoSuccessor(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes, errs, done := observeInto(ctx, dial(t, []string{shared.Addr}), key)
	current := nextChange(t, changes, errs, "the current leader (none)")
	l := campaign(t, dial(t, []string{p.Addr}), key, "brief", leasehold.CampaignOptions{TTL: time.Second, SafetyMargin: 300 * time.Millisecond})
	elected := nextChange(t, changes, errs, "the term")
	p.Refuse()
	end := nextChange(t, changes, errs, "the expiry")
	cancel()
	<-done
	if current.Type != leasehold.ChangeCurrent || current.Leader != nil {
		t.Fatalf("first change %+v, want current with no leader", current)
	}
	if elected.Type != leasehold.ChangeElected || elected.Term != l.Term() || elected.Leader.Value != "brief" {
		t.Fatalf("second change %+v, want brief elected in term %d", elected, l.Term())
	}
	if end.Type != leasehold.ChangeEnded || end.Term != l.Term() || end.How != "expired" {
		t.Fatalf("third change %+v, want term %d ended, expired", end, l.Term())
	}
}

// E1, K1: campaigning on a keeper, the leader's lease is on the keeper,
// Proclaim keeps the term there, and the keeper's stall ends the term once.
func TestElectionOnAKeeperProclaimKeepsTheTermAndTheKeepersStallEndsItOnce(t *testing.T) {
	key := freshKey(t)
	p := testenv.StartProxy(t, shared.Addr)
	k := newKeeper(t, dial(t, []string{p.Addr}), leasehold.WithKeeperTTL(2*time.Second))
	direct := dial(t, []string{shared.Addr})
	calls := &stopCalls{}
	if _, err := direct.Campaign(context.Background(), key, "on-keeper", leasehold.CampaignOptions{Keeper: k, TTL: time.Second}); err == nil || !strings.Contains(err.Error(), "TTL") {
		t.Fatalf("Campaign on a keeper with a TTL of its own = %v, want an error naming TTL (the keeper's applies)", err)
	}
	l := campaign(t, direct, key, "on-keeper", leasehold.CampaignOptions{Keeper: k, OnStoppedLeading: calls.record})
	if got, err := direct.Get(context.Background(), key); err != nil || got.GetKeeperId() != k.ID() || got.GetRunId() != l.RunID() {
		t.Fatalf("Get = %v, %v; want the leader's run on keeper %s", got, err, k.ID())
	}
	if err := l.Proclaim(context.Background(), "on-keeper-2"); err != nil {
		t.Fatalf("Proclaim on the keeper = %v", err)
	}
	if got, err := direct.Leader(context.Background(), key); err != nil || got.Value != "on-keeper-2" || got.Term != l.Term() {
		t.Fatalf("Leader = %+v, %v; want on-keeper-2 in term %d", got, err, l.Term())
	}
	if got, err := direct.Get(context.Background(), key); err != nil || got.GetKeeperId() != k.ID() {
		t.Fatalf("Get after Proclaim = %v, %v; want still on keeper %s", got, err, k.ID())
	}
	p.Stall()
	why := ended(t, l, 15*time.Second, "the term on the stalled keeper")
	if k.Context().Err() == nil {
		t.Fatal("term ended, keeper still live; want the keeper lost")
	}
	resign(t, l)
	p.Resume()
	calls.once(t, l.Term(), leasehold.StopLost)
	if !errors.Is(why.Err, leasehold.ErrKeeperLost) {
		t.Fatalf("StopReason.Err = %v, want the keeper's loss", why.Err)
	}
}

// E1: a candidate waiting on a keeper whose stream is cut and cannot
// re-attach returns the *KeeperLostError and leaves no candidate behind.
func TestElectionWaitingCandidateWhoseKeeperIsLostLeavesNoCandidateBehind(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	p := testenv.StartProxy(t, srv.Addr)
	c := dial(t, []string{p.Addr})
	k := newKeeper(t, c, leasehold.WithKeeperTTL(1500*time.Millisecond))
	lost := campaignAsync(context.Background(), c, key, "lost", leasehold.CampaignOptions{Keeper: k})
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting on its keeper", func() bool { return queued(srv, key) >= 1 })
	p.Refuse()
	if r := outcome(t, lost, 15*time.Second, "the campaign on the lost keeper"); !errors.Is(r.err, leasehold.ErrKeeperLost) {
		t.Fatalf("Campaign on a lost keeper = %v, %v; want the *KeeperLostError", r.l, r.err)
	}
	leaveNothingBehind(t, srv, key, holder, 1)
}

// E1: a campaign on a keeper cancelled while waiting returns ctx's cause
// and leaves no waiter (its run released on the keeper's stream, which
// gives the waiting Acquire up on the server at once, not when its wait
// runs out); the keeper goes on.
func TestElectionCampaignOnAKeeperCancelledWhileWaitingLeavesNoWaiter(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	k := newKeeper(t, dial(t, []string{srv.Addr}), leasehold.WithKeeperTTL(30*time.Second))
	ctx, cancel := context.WithCancel(context.Background())
	waiter := campaignAsync(ctx, dial(t, []string{srv.Addr}), key, "cancelled", leasehold.CampaignOptions{Keeper: k})
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting on its keeper", func() bool { return queued(srv, key) >= 1 })
	cancel()
	if r := outcome(t, waiter, 10*time.Second, "the cancelled campaign on a keeper"); !errors.Is(r.err, context.Canceled) {
		t.Fatalf("cancelled Campaign on a keeper = %v, %v; want context.Canceled", r.l, r.err)
	}
	if err := k.Context().Err(); err != nil {
		t.Fatalf("keeper ended by the cancelled campaign: %v", context.Cause(k.Context()))
	}
	// The keeper goes on; this acquire follows the release on its stream.
	other, err := k.Hold(context.Background(), freshKey(t))
	if err != nil {
		t.Fatalf("Hold on the keeper after the cancelled campaign = %v", err)
	}
	if err := other.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	leaveNothingBehind(t, srv, key, holder, 1)
}

// E1, K1: a candidate waiting on a keeper whose stream stalls returns the
// *KeeperLostError at the keeper's local deadline; the server, which saw
// no stall, never grants its stale waiter once the keeper has expired, and
// the next candidate is granted at once when the leader resigns.
func TestElectionWaitingCandidateWhoseKeeperStallsIsNeverGranted(t *testing.T) {
	srv := testenv.StartDebugServer(t)
	key := freshKey(t)
	holder := campaign(t, dial(t, []string{srv.Addr}), key, "holder", leasehold.CampaignOptions{TTL: time.Minute})
	p := testenv.StartProxy(t, srv.Addr)
	c := dial(t, []string{p.Addr})
	k := newKeeper(t, c, leasehold.WithKeeperTTL(1500*time.Millisecond))
	lost := campaignAsync(context.Background(), c, key, "lost", leasehold.CampaignOptions{Keeper: k})
	testenv.WaitFor(t, 10*time.Second, "the candidate waiting on its keeper", func() bool { return queued(srv, key) >= 1 })
	p.Stall()
	if r := outcome(t, lost, 15*time.Second, "the campaign on the stalled keeper"); !errors.Is(r.err, leasehold.ErrKeeperLost) {
		t.Fatalf("Campaign on a stalled keeper = %v, %v; want the *KeeperLostError", r.l, r.err)
	}
	// The keeper's deadline passes on the database clock.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.Get().LeaseDB)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SELECT pg_sleep_until(expires_at) FROM keepers WHERE id = $1::uuid", k.ID()); err != nil {
		t.Fatal(err)
	}
	leaveNothingBehind(t, srv, key, holder, 1)
}
