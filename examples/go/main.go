// Command worker is a Leasehold worker built on the Go client
// (leasehold.dev/go, clients/go): it holds one session's lease, writes
// documents to the guarded store with its fencing token until it is done,
// asked to hand off, or the lease's Context ends (L2), and releases.
// Everything it does is one JSON object per line on stdout, for people and
// for test/polyglot/.
//
//	examples/go/gen/bin/worker --account acme --session s1
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

type fields = map[string]any

// events writes one JSON line per event; t_ms and at_ms are milliseconds
// since the worker started, on the monotonic clock.
type events struct {
	mu     sync.Mutex
	start  time.Time
	holder string
	runID  string
}

func (e *events) ms(t time.Time) float64 { return float64(t.Sub(e.start).Microseconds()) / 1000 }

func (e *events) emit(event string, f fields) {
	r := fields{"event": event, "lang": "go", "holder": e.holder, "run_id": e.runID, "t_ms": e.ms(time.Now())}
	for k, v := range f {
		r[k] = v
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	_ = json.NewEncoder(os.Stdout).Encode(r)
}

// Handle turns the client's debug records into events: "renewed" for
// every confirmed renewal, and notes a waited grant being confirmed.
func (e *events) Handle(_ context.Context, r slog.Record) error {
	switch r.Message {
	case leasehold.MsgRenewed:
		f := fields{}
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "token":
				f["token"] = strconv.FormatInt(a.Value.Int64(), 10)
			case "remaining", "deadline_in":
				f[a.Key+"_ms"] = a.Value.Duration().Milliseconds()
			}
			return true
		})
		e.emit("renewed", f)
	case leasehold.MsgConfirming:
		confirming.Store(true)
	}
	return nil
}
func (e *events) Enabled(context.Context, slog.Level) bool { return true }
func (e *events) WithAttrs([]slog.Attr) slog.Handler       { return e }
func (e *events) WithGroup(string) slog.Handler            { return e }

// confirming is set when the client confirmed a late waited grant.
var confirming atomic.Bool

func leaseFields(l *leasev1.Lease) fields {
	return fields{"run_id": l.GetRunId(), "holder": l.GetHolder(), "token": strconv.FormatInt(l.GetFencingToken(), 10), "remaining_ms": l.GetRemaining().AsDuration().Milliseconds()}
}

// describe gives a failed call's code, message and ErrorInfo as event fields.
func describe(err error) fields {
	st := status.Convert(err)
	f := fields{"code": strings.ToUpper(codeName(st.Code().String())), "message": st.Message()}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			f["reason"], f["domain"], f["metadata"] = info.GetReason(), info.GetDomain(), info.GetMetadata()
		}
	}
	return f
}

// codeName spells a gRPC code as the spec does: FailedPrecondition → FAILED_PRECONDITION.
func codeName(camel string) string {
	if camel == "Canceled" {
		return "CANCELLED"
	}
	var b strings.Builder
	for i, r := range camel {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return b.String()
}

type options struct {
	server, store, account, session, holder string
	runID, document                         string
	ttl, margin, renew, wait, writeEvery    time.Duration
	releaseTimeout                          time.Duration
	writes                                  int
	control                                 bool
}

// Exit statuses, as the Python worker's and `leasehold run`'s.
const (
	exitFinished      = 0
	exitError         = 1
	exitUsage         = 2
	exitLost          = 3
	exitHeldElsewhere = 75
)

func parse() (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.StringVar(&o.server, "server", "127.0.0.1:7070", "lease server, host:port")
	fs.StringVar(&o.store, "store", "127.0.0.1:7071", "guarded store, host:port")
	fs.StringVar(&o.account, "account", "", "account id (required)")
	fs.StringVar(&o.session, "session", "", "session id (required)")
	fs.StringVar(&o.holder, "holder", "go-worker", "label others see as the holder")
	fs.StringVar(&o.runID, "run-id", leasehold.NewRunID(), "this run's UUID (default: a new one)")
	fs.StringVar(&o.document, "document", "transcript", "name of the document written")
	ttl := fs.Int("ttl-ms", 10_000, "lease TTL")
	margin := fs.Int("margin-ms", 0, "safety margin of the local deadline (default a tenth of the TTL)")
	renew := fs.Int("renew-ms", 0, "renewal interval (default a third of TTL minus margin)")
	releaseTimeout := fs.Int("release-timeout-ms", 1_000, "deadline of the final Release")
	wait := fs.Int("wait-ms", 0, "when held elsewhere, wait this long for it")
	fs.IntVar(&o.writes, "writes", 0, "writes before releasing (0: until stopped)")
	every := fs.Int("write-every-ms", 200, "pause between writes")
	fs.BoolVar(&o.control, "control", false, "read commands from stdin: go, late-write, quit")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return nil, err
	}
	if o.account == "" || o.session == "" {
		return nil, errors.New("--account and --session are required")
	}
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	o.ttl, o.margin, o.renew, o.wait, o.writeEvery = ms(*ttl), ms(*margin), ms(*renew), ms(*wait), ms(*every)
	o.releaseTimeout = ms(*releaseTimeout)
	return o, nil
}

func main() {
	o, err := parse()
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(exitFinished)
		}
		fmt.Fprintln(os.Stderr, "worker:", err)
		os.Exit(exitUsage)
	}
	os.Exit(run(o))
}

func run(o *options) int {
	runID := o.runID
	ev := &events{start: time.Now(), holder: o.holder, runID: runID}
	ctx := context.Background()
	opts := []leasehold.Option{leasehold.WithLogger(slog.New(ev))}
	if t := os.Getenv("LEASEHOLD_TOKEN"); t != "" {
		opts = append(opts, leasehold.WithToken(t))
	}
	client, err := leasehold.Dial(ctx, []string{o.server}, opts...)
	if err != nil {
		ev.emit("error", fields{"message": err.Error()})
		return exitError
	}
	defer client.Close()
	// Calls made with leasehold.WithLease(ctx, lease) carry its fencing headers.
	// The guarded store authenticates its callers as the lease server does.
	storeAuth := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if t := os.Getenv("LEASEHOLD_TOKEN"); t != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+t)
		}
		return invoker(ctx, method, req, reply, cc, callOpts...)
	}
	conn, err := grpc.NewClient(o.store, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(leasehold.UnaryFencingInterceptor(), storeAuth))
	if err != nil {
		ev.emit("error", fields{"message": err.Error()})
		return exitError
	}
	defer conn.Close()
	w := &worker{o: o, ev: ev, runID: runID, leases: client, store: guardedv1.NewGuardedStoreServiceClient(conn),
		key: leasehold.SessionKey{AccountID: o.account, SessionID: o.session}}

	commands := make(chan string, 16)
	if o.control {
		go func() {
			sc := bufio.NewScanner(os.Stdin)
			for sc.Scan() {
				commands <- strings.TrimSpace(sc.Text())
			}
			close(commands)
		}()
	}
	ev.emit("ready", fields{"server": o.server, "store": o.store})
	if o.control {
		if c := <-commands; c != "go" {
			return exitFinished
		}
	}
	lease, code := w.hold(ctx)
	for c := range commands {
		if c == "late-write" && lease != nil {
			w.lateWrite(lease)
		} else if c == "quit" {
			break
		}
	}
	return code
}

type worker struct {
	o      *options
	ev     *events
	runID  string
	key    leasehold.SessionKey
	leases *leasehold.Client
	store  guardedv1.GuardedStoreServiceClient
}

func (w *worker) acquire(ctx context.Context, wait time.Duration) (*leasehold.Lease, error) {
	lease, err := w.leases.Hold(ctx, w.key, leasehold.HoldOptions{TTL: w.o.ttl, SafetyMargin: w.o.margin, RenewInterval: w.o.renew, Wait: wait, Holder: w.o.holder, RunID: w.runID})
	var na *leasehold.NotAcquiredError
	var late *leasehold.LateGrantError
	if errors.As(err, &late) {
		// The client released the grant that came too late to vouch for.
		w.ev.emit("grant_too_late", fields{"token": strconv.FormatInt(late.Lease.GetFencingToken(), 10), "late_ms": late.Elapsed.Milliseconds()})
	} else if errors.As(err, &na) {
		w.ev.emit("not_acquired", fields{"wait_ms": wait.Milliseconds(), "current": leaseFields(na.Current)})
	}
	if err != nil {
		return nil, err
	}
	w.ev.emit("acquired", fields{
		"wait_ms": wait.Milliseconds(), "confirmed": confirming.Load(),
		"token":        strconv.FormatInt(lease.FencingToken(), 10),
		"remaining_ms": lease.Lease().GetRemaining().AsDuration().Milliseconds(),
		"ttl_ms":       w.o.ttl.Milliseconds(), "deadline_in_ms": lease.Remaining().Milliseconds(),
	})
	return lease, nil
}

// hold acquires (waiting if asked), writes until stopped, and releases;
// it returns the lease (nil if none) and the exit status.
func (w *worker) hold(ctx context.Context) (*leasehold.Lease, int) {
	lease, err := w.acquire(ctx, 0)
	if errors.Is(err, leasehold.ErrNotAcquired) && w.o.wait > 0 {
		lease, err = w.acquire(ctx, w.o.wait)
	}
	if errors.Is(err, leasehold.ErrNotAcquired) {
		return nil, exitHeldElsewhere
	}
	if err != nil {
		f := describe(err)
		f["message"] = err.Error()
		w.ev.emit("error", f)
		return nil, exitError
	}
	reason, n := w.work(lease)
	stop := fields{"reason": reason, "at_ms": w.ev.ms(time.Now()), "writes": n}
	if lost := lease.Err(); lost != nil {
		var le *leasehold.LeaseLostError
		errors.As(lost, &le)
		stop["reason"] = "lost"
		if le.Reason == leasehold.LossDeadline {
			stop["reason"] = "deadline"
		}
		stop["cause"] = "LOSS_REASON_" + strings.ToUpper(string(le.Reason))
	}
	w.ev.emit("stopped", stop)
	code := exitFinished
	if stop["reason"] != "finished" && stop["reason"] != "handoff" {
		code = exitLost
	}
	rctx, cancel := context.WithTimeout(ctx, w.o.releaseTimeout)
	defer cancel()
	switch err := lease.Release(rctx); {
	case errors.Is(err, leasehold.ErrLeaseLost):
		// Never sent after a loss: the run no longer holds the lease.
		w.ev.emit("released", fields{"released": false, "sent": false})
	case err != nil:
		w.ev.emit("release_failed", describe(err))
	default:
		w.ev.emit("released", fields{"released": true, "sent": true})
	}
	return lease, code
}

// work writes every writeEvery under the lease's Context until done.
func (w *worker) work(lease *leasehold.Lease) (string, int) {
	for n := 0; ; {
		if w.o.writes > 0 && n >= w.o.writes {
			return "finished", n
		}
		select {
		case h := <-lease.HandoffRequests():
			w.ev.emit("handoff_requested", fields{"requester_holder": h.RequesterHolder, "reason": h.Reason})
			return "handoff", n
		case <-lease.Context().Done():
			return "lost", n
		default:
		}
		n++
		started := w.ev.ms(time.Now())
		text := fmt.Sprintf("%s: write %d with token %d", w.o.holder, n, lease.FencingToken())
		resp, err := w.store.Put(leasehold.WithLease(lease.Context(), lease), w.put(lease.FencingToken(), text))
		if err != nil {
			f := describe(err)
			f["n"], f["started_ms"] = n, started
			w.ev.emit("write_failed", f)
		} else {
			w.ev.emit("wrote", fields{"n": n, "token": strconv.FormatInt(lease.FencingToken(), 10), "highest_token": strconv.FormatInt(resp.GetHighestToken(), 10), "started_ms": started})
		}
		select {
		case <-lease.Context().Done():
		case <-time.After(w.o.writeEvery):
		}
	}
}

func (w *worker) put(token int64, text string) *guardedv1.PutRequest {
	return &guardedv1.PutRequest{Key: &leasev1.SessionKey{AccountId: w.key.AccountID, SessionId: w.key.SessionID}, Name: w.o.document, Value: []byte(text), FencingToken: token}
}

// lateWrite sends the write a paused run sends when it wakes up, token and
// headers as they were: it shows what the guarded store does with a write
// from a run that no longer holds the lease.
func (w *worker) lateWrite(lease *leasehold.Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	token := strconv.FormatInt(lease.FencingToken(), 10)
	// By hand: FencingMetadata and the interceptor send nothing for a lease
	// that has ended, and this write is the one a run that missed its loss sends.
	ctx = metadata.NewOutgoingContext(ctx, metadata.Pairs(
		leasehold.FencingTokenHeader, token,
		leasehold.AccountIDHeader, lease.Key().AccountID,
		leasehold.SessionIDHeader, lease.Key().SessionID,
	))
	resp, err := w.store.Put(ctx, w.put(lease.FencingToken(), fmt.Sprintf("%s: late write with token %s", w.o.holder, token)))
	if err != nil {
		f := describe(err)
		f["token"] = token
		w.ev.emit("late_write_refused", f)
		return
	}
	w.ev.emit("late_write_accepted", fields{"token": token, "highest_token": strconv.FormatInt(resp.GetHighestToken(), 10)})
}
