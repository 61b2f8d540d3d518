// Command worker is a Leasehold worker in Go, built offline against
// Debian's packaged gRPC (see build.sh and docs/polyglot.md).
//
// It acquires one session's lease with its own run_id, keeps the lease alive
// over one bidirectional KeepAlive stream, and writes documents to the
// guarded store with its fencing token. It stops its work the moment the
// stream says `lost`, or when its local deadline passes without a confirmed
// renewal (DESIGN.md, L2). Everything it does is reported as one JSON object
// per line on stdout, for people and for test/polyglot/.
//
//	examples/go/gen/bin/worker --account acme --session s1
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	errdetails "leasehold.dev/examples/gen/google/rpc/errdetails"
	guardedv1 "leasehold.dev/examples/gen/leasehold/guarded/v1"
	leasev1 "leasehold.dev/examples/gen/leasehold/v1"
)

const (
	exitFinished = 0
	exitError    = 1
	exitUsage    = 2
	exitLost     = 3
	// As `leasehold run`: EX_TEMPFAIL, try later.
	exitHeldElsewhere = 75

	fencingTokenHeader = "leasehold-fencing-token"
	accountHeader      = "leasehold-account-id"
	sessionHeader      = "leasehold-session-id"
)

type fields = map[string]interface{}

// events writes one JSON object per line on stdout, from any goroutine.
type events struct {
	mu     sync.Mutex
	start  time.Time
	holder string
	runID  string
	out    *json.Encoder
}

// ms is a monotonic instant as milliseconds since this process started.
func (e *events) ms(t time.Time) float64 {
	return millis(t.Sub(e.start))
}

func (e *events) emit(event string, f fields) {
	record := fields{
		"event":  event,
		"lang":   "go",
		"holder": e.holder,
		"run_id": e.runID,
		"t_ms":   e.ms(time.Now()),
	}
	for k, v := range f {
		record[k] = v
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	_ = e.out.Encode(record)
}

func millis(d time.Duration) float64 {
	return math.Round(float64(d)/float64(time.Millisecond)*10) / 10
}

// tokenString writes an int64 as protobuf's JSON mapping does: a string.
func tokenString(token int64) string {
	return strconv.FormatInt(token, 10)
}

func leaseFields(lease *leasev1.Lease) fields {
	return fields{
		"run_id":       lease.GetRunId(),
		"holder":       lease.GetHolder(),
		"token":        tokenString(lease.GetFencingToken()),
		"remaining_ms": lease.GetRemaining().AsDuration().Milliseconds(),
	}
}

// Canonical gRPC code names, as in the status codes table of the gRPC spec
// (Go's codes.Code.String() spells them in CamelCase).
var codeNames = [...]string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
	"NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
	"FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
	"INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
}

func codeName(c codes.Code) string {
	if int(c) < len(codeNames) {
		return codeNames[c]
	}
	return c.String()
}

// errorInfo is the google.rpc.ErrorInfo the server attached to a failed
// call. grpc-go decodes the grpc-status-details-bin trailer into the status;
// its details are Any messages.
func errorInfo(st *status.Status) *errdetails.ErrorInfo {
	for _, detail := range st.Proto().GetDetails() {
		info := &errdetails.ErrorInfo{}
		if detail.MessageIs(info) && detail.UnmarshalTo(info) == nil {
			return info
		}
	}
	return nil
}

// describeError gives the code, message and ErrorInfo of a failed call, as
// event fields.
func describeError(err error) fields {
	st := status.Convert(err)
	f := fields{"code": codeName(st.Code()), "message": st.Message()}
	if info := errorInfo(st); info != nil {
		f["reason"] = info.GetReason()
		f["domain"] = info.GetDomain()
		f["metadata"] = info.GetMetadata()
	}
	return f
}

func newRunID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	b[6] = b[6]&0x0f | 0x40 // version 4
	b[8] = b[8]&0x3f | 0x80 // RFC 4122 variant
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

type options struct {
	server, store      string
	account, session   string
	holder, runID      string
	ttl, margin, renew time.Duration
	wait               time.Duration
	writes             int
	writeEvery         time.Duration
	document           string
	releaseTimeout     time.Duration
	control            bool
}

func parseOptions(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: worker --account A --session S [flags]\n\n"+
			"Holds a Leasehold session's lease and writes through the fence; one JSON\n"+
			"event per line on stdout. The bearer token for the lease server and the\n"+
			"guarded store, if they need one, is read from LEASEHOLD_TOKEN.\n\nFlags:")
		fs.PrintDefaults()
	}
	fs.StringVar(&o.server, "server", "127.0.0.1:7070", "lease server, host:port (gRPC over h2c)")
	fs.StringVar(&o.store, "store", "127.0.0.1:7071", "guarded store, host:port (gRPC over h2c)")
	fs.StringVar(&o.account, "account", "", "account id (required)")
	fs.StringVar(&o.session, "session", "", "session id (required)")
	fs.StringVar(&o.holder, "holder", "go-worker", "label other clients see as the holder")
	fs.StringVar(&o.runID, "run-id", newRunID(), "this run's UUID (default: a new one)")
	ttlMs := fs.Int("ttl-ms", 10_000, "lease TTL")
	marginMs := fs.Int("margin-ms", -1, "safety margin of the local deadline (default: a tenth of the TTL)")
	renewMs := fs.Int("renew-ms", -1, "renewal interval (default: a third of TTL minus margin)")
	waitMs := fs.Int("wait-ms", 0, "when held elsewhere, wait this long for it")
	fs.IntVar(&o.writes, "writes", 0, "writes before releasing (0: until stopped)")
	writeEveryMs := fs.Int("write-every-ms", 200, "pause between writes")
	fs.StringVar(&o.document, "document", "transcript", "name of the document written")
	releaseTimeoutMs := fs.Int("release-timeout-ms", 1_000, "deadline of the final Release")
	fs.BoolVar(&o.control, "control", false, "read commands from stdin: go (start), late-write (after stopping), quit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if o.account == "" || o.session == "" {
		return nil, errors.New("--account and --session are required")
	}
	if *ttlMs <= 0 {
		return nil, errors.New("--ttl-ms must be positive")
	}
	if *marginMs < 0 {
		*marginMs = *ttlMs / 10
	}
	if *marginMs >= *ttlMs {
		return nil, errors.New("--margin-ms must be at least 0 and below --ttl-ms")
	}
	usable := *ttlMs - *marginMs
	if *renewMs < 0 {
		*renewMs = usable / 3
	}
	// With renewals close to the usable window, one slow answer would stop
	// the run.
	if *renewMs <= 0 || *renewMs*2 > usable {
		return nil, errors.New("--renew-ms must be above 0 and at most half of --ttl-ms minus --margin-ms")
	}
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	o.ttl, o.margin, o.renew = ms(*ttlMs), ms(*marginMs), ms(*renewMs)
	o.wait, o.writeEvery, o.releaseTimeout = ms(*waitMs), ms(*writeEveryMs), ms(*releaseTimeoutMs)
	return o, nil
}

type worker struct {
	o        *options
	ev       *events
	key      *leasev1.SessionKey
	bearer   string
	leases   leasev1.LeaseServiceClient
	store    guardedv1.GuardedStoreServiceClient
	commands chan string
}

func dial(address string) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// WithInsecure: h2c, as the servers speak without TLS. grpc 1.33 (Debian
	// 12) predates credentials/insecure.
	return grpc.DialContext(ctx, address, grpc.WithInsecure(), grpc.WithBlock())
}

func (w *worker) readCommands() {
	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		if line := scanner.Text(); line != "" {
			w.commands <- line
		}
	}
	w.commands <- "quit"
}

func (w *worker) leaseContext(timeout time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	return withBearer(ctx, w.bearer), cancel
}

// ask sends one Acquire with this run's id and reports a refusal.
func (w *worker) ask(wait time.Duration) (time.Time, *leasev1.AcquireResponse, error) {
	request := &leasev1.AcquireRequest{
		Key:    w.key,
		RunId:  w.o.runID,
		Ttl:    durationpb.New(w.o.ttl),
		Holder: w.o.holder,
	}
	if wait > 0 {
		request.Wait = durationpb.New(wait)
	}
	ctx, cancel := w.leaseContext(wait + 10*time.Second)
	defer cancel()
	sentAt := time.Now()
	response, err := w.leases.Acquire(ctx, request)
	if err == nil && !response.GetAcquired() {
		w.ev.emit("not_acquired", fields{
			"wait_ms": wait.Milliseconds(),
			"current": leaseFields(response.GetCurrent()),
		})
	}
	return sentAt, response, err
}

func (w *worker) acquire(wait time.Duration) (*holding, error) {
	sentAt, response, err := w.ask(wait)
	if err != nil || !response.GetAcquired() {
		return nil, err
	}
	h := newHolding(w.ev, response.GetLease(), sentAt, w.o.margin)
	confirmed := false
	if h.timeLeft() <= 0 && wait > 0 {
		// A waited grant is late by construction when the wait outlasted the
		// window: the server granted it some time after the request left. The
		// same run_id asks again without waiting (idempotent: the same token),
		// and the deadline counts from that request.
		sentAt, response, err = w.ask(0)
		if err != nil || !response.GetAcquired() {
			return nil, err
		}
		h = newHolding(w.ev, response.GetLease(), sentAt, w.o.margin)
		confirmed = true
	}
	left := h.timeLeft()
	if left <= 0 {
		// The answer came after the local deadline it grants: this run cannot
		// vouch for the lease, so it gives the grant back.
		w.ev.emit("grant_too_late", fields{"token": tokenString(h.token), "late_ms": millis(-left)})
		w.release(h)
		return nil, nil
	}
	w.ev.emit("acquired", fields{
		"wait_ms":        wait.Milliseconds(),
		"confirmed":      confirmed,
		"token":          tokenString(h.token),
		"remaining_ms":   response.GetLease().GetRemaining().AsDuration().Milliseconds(),
		"ttl_ms":         w.o.ttl.Milliseconds(),
		"margin_ms":      w.o.margin.Milliseconds(),
		"deadline_in_ms": millis(left),
	})
	return h, nil
}

// withFence adds the three headers a fenced service reads (docs/fencing.md),
// and the bearer token: the guarded store authenticates as the lease server does.
func (w *worker) withFence(ctx context.Context, token int64) context.Context {
	return metadata.AppendToOutgoingContext(withBearer(ctx, w.bearer),
		fencingTokenHeader, tokenString(token),
		accountHeader, w.key.GetAccountId(),
		sessionHeader, w.key.GetSessionId())
}

func (w *worker) putRequest(token int64, text string) *guardedv1.PutRequest {
	return &guardedv1.PutRequest{Key: w.key, Name: w.o.document, Value: []byte(text), FencingToken: token}
}

func (w *worker) work(h *holding) {
	count := 0
	for !h.isStopped() {
		if w.o.writes > 0 && count >= w.o.writes {
			h.stop("finished", fields{"writes": count})
			return
		}
		if h.handoffRequested() {
			// Cooperative: the step in progress is done; hand over now.
			h.stop("handoff", fields{"writes": count})
			return
		}
		count++
		ctx, startedMs, ok := h.startWrite(context.Background())
		if !ok {
			return
		}
		request := w.putRequest(h.token, fmt.Sprintf("%s: write %d with token %d", w.o.holder, count, h.token))
		response, err := w.store.Put(w.withFence(ctx, h.token), request)
		h.endWrite()
		switch {
		case err == nil:
			w.ev.emit("wrote", fields{
				"n":             count,
				"token":         tokenString(h.token),
				"highest_token": tokenString(response.GetHighestToken()),
				"started_ms":    startedMs,
			})
		case status.Code(err) == codes.Canceled && h.isStopped():
			w.ev.emit("write_cancelled", fields{"n": count, "started_ms": startedMs})
		default:
			detail := describeError(err)
			detail["n"], detail["started_ms"] = count, startedMs
			w.ev.emit("write_failed", detail)
			if detail["reason"] == "STALE_FENCING_TOKEN" {
				// A newer run has written: this one is over.
				h.stop("write_refused", nil)
			}
		}
		timer := time.NewTimer(w.o.writeEvery)
		select {
		case <-h.stopped:
			timer.Stop()
		case <-timer.C:
		}
	}
}

func (w *worker) release(h *holding) {
	ctx, cancel := w.leaseContext(w.o.releaseTimeout)
	defer cancel()
	response, err := w.leases.Release(ctx, &leasev1.ReleaseRequest{Key: w.key, RunId: h.runID})
	if err != nil {
		w.ev.emit("release_failed", describeError(err))
		return
	}
	w.ev.emit("released", fields{"released": response.GetReleased()})
}

// lateWrite sends the write a paused run sends when it wakes up, token and
// all. It skips every check on purpose: it shows what the guarded store does
// with a write from a run that no longer holds the lease.
func (w *worker) lateWrite(h *holding) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	request := w.putRequest(h.token, fmt.Sprintf("%s: late write with token %d", w.o.holder, h.token))
	response, err := w.store.Put(w.withFence(ctx, h.token), request)
	if err != nil {
		f := describeError(err)
		f["token"] = tokenString(h.token)
		w.ev.emit("late_write_refused", f)
		return
	}
	w.ev.emit("late_write_accepted", fields{
		"token":         tokenString(h.token),
		"highest_token": tokenString(response.GetHighestToken()),
	})
}

// hold acquires, works until stopped and releases. A nil holding means the
// session is held elsewhere.
func (w *worker) hold() (*holding, error) {
	h, err := w.acquire(0)
	if err == nil && h == nil && w.o.wait > 0 {
		h, err = w.acquire(w.o.wait)
	}
	if err != nil || h == nil {
		return nil, err
	}
	ka := &keepAlive{client: w.leases, h: h, ttl: w.o.ttl, every: w.o.renew}
	if err := ka.start(withBearer(context.Background(), w.bearer)); err != nil {
		h.stop("stream_failed", describeError(err))
	} else {
		go h.watch()
		w.work(h)
		// The stream goes first: a release would otherwise come back on it as
		// `lost`.
		ka.close()
	}
	w.release(h)
	return h, nil
}

func (w *worker) run() (int, error) {
	if w.o.control {
		go w.readCommands()
	}
	w.ev.emit("ready", fields{"server": w.o.server, "store": w.o.store})
	if w.o.control {
		for command := range w.commands {
			if command == "go" {
				break
			}
			if command == "quit" {
				return exitFinished, nil
			}
			w.ev.emit("unknown_command", fields{"command": command})
		}
	}
	h, err := w.hold()
	if err != nil {
		return exitError, err
	}
	code := exitLost
	switch {
	case h == nil:
		code = exitHeldElsewhere
	case h.reason() == "finished" || h.reason() == "handoff":
		code = exitFinished
	}
	if !w.o.control {
		return code, nil
	}
	for command := range w.commands {
		switch {
		case command == "quit":
			return code, nil
		case command == "late-write" && h != nil:
			w.lateWrite(h)
		default:
			w.ev.emit("unknown_command", fields{"command": command})
		}
	}
	return code, nil
}

func main() {
	o, err := parseOptions(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(exitFinished)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		os.Exit(exitUsage)
	}
	ev := &events{start: time.Now(), holder: o.holder, runID: o.runID, out: json.NewEncoder(os.Stdout)}
	leaseConn, err := dial(o.server)
	if err != nil {
		ev.emit("error", fields{"code": "UNAVAILABLE", "message": fmt.Sprintf("cannot connect to %s: %v", o.server, err)})
		os.Exit(exitError)
	}
	storeConn, err := dial(o.store)
	if err != nil {
		ev.emit("error", fields{"code": "UNAVAILABLE", "message": fmt.Sprintf("cannot connect to %s: %v", o.store, err)})
		os.Exit(exitError)
	}
	w := &worker{
		o:        o,
		ev:       ev,
		key:      &leasev1.SessionKey{AccountId: o.account, SessionId: o.session},
		bearer:   os.Getenv("LEASEHOLD_TOKEN"),
		leases:   leasev1.NewLeaseServiceClient(leaseConn),
		store:    guardedv1.NewGuardedStoreServiceClient(storeConn),
		commands: make(chan string, 16),
	}
	code, err := w.run()
	if err != nil {
		ev.emit("error", describeError(err))
	}
	leaseConn.Close()
	storeConn.Close()
	os.Exit(code)
}
