package leasehold

// One KeepAlive stream per client, shared by every lease it holds (DESIGN
// §6), and one more per WithMaxLeasesPerStream leases beyond the first
// stream's share (a server bounds the leases of one stream). A stream opens
// when its first lease registers and closes when its last one leaves. When
// it fails — an error, an end, or a renewal left unanswered (a stalled
// connection) — it reconnects over a fresh connection to the next address,
// after a backoff with full jitter, and sends a renewal for every lease
// again (same run id: renewals are idempotent).
//
// The channel never decides that a lease is still held: it hands each
// answer to the lease with the monotonic time its request was sent, and the
// lease sets its local deadline from that.
//
// A renewal the server answers undecided (the database did not decide it: a
// statement or lock timeout) is answered all the same: the stream is alive,
// so the stall watch lets it be and nothing reconnects (a slow database is
// as slow from every address). The lease is not told: its local deadline
// stays where the last renewal put it, its next renewal goes at its usual
// interval, and the deadline ends it if the database stays slow (L2). The
// client's logger hears of it (Warn, MsgRenewalUndecided).
//
// Locking: one mutex for the channel and its lanes; callbacks into leases
// (which take the lease's own mutex and may call back in to remove
// themselves) always run after it is released.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// MsgRenewalUndecided is the message of the client's Warn log record
// (WithLogger) for a renewal the server did not decide (its database timed
// out): the stream and the lease go on, the lease's local deadline where
// its last renewal put it. Its "err" is the answer's status (UNAVAILABLE,
// ErrorInfo DATABASE_UNAVAILABLE), its "sql_state" 57014 (statement
// timeout) or 55P03 (lock timeout).
const MsgRenewalUndecided = "leasehold: keepalive renewal undecided; the stream goes on"

type entryID struct {
	accountID, sessionID, runID string
}

type entry struct {
	lease *Lease
	// Send times of renewals not yet answered on the current stream,
	// oldest first (the server answers one run's renewals in order).
	outstanding []time.Time
	seq         uint64
	// Closed once no renewal of the lease is on the way any more
	// (registration.settled).
	waiters []chan struct{}
}

// settle tells whoever waits on registration.settled that no renewal of
// the entry is on the way any more: its answers came, it left the channel,
// or its stream failed. ch.mu is held.
func (e *entry) settle() {
	wake(e.detach())
}

// detach takes the entry's waiters, to be woken (wake) once the lease has
// heard the news that settles them: a waiting Release then sees the
// renewal or the loss. ch.mu is held.
func (e *entry) detach() []chan struct{} {
	ws := e.waiters
	e.waiters = nil
	return ws
}

func wake(ws []chan struct{}) {
	for _, w := range ws {
		close(w)
	}
}

type laneStream struct {
	gen    uint64
	addr   string
	conn   *grpc.ClientConn
	ctx    context.Context
	cancel context.CancelFunc
	queue  []*leasev1.KeepAliveRequest
	wake   chan struct{}
	ended  bool // half-close once the queue is sent
	stall  timer
}

type lane struct {
	ch        *keepAliveChannel
	entries   map[entryID]*entry
	stream    *laneStream
	reconnect timer
	addrIndex int
	failures  int
	// Opens of this lane since a renewal was last confirmed that ended
	// UNAUTHENTICATED: a token function that keeps returning an expired
	// token must not reconnect forever.
	authRetries int
	// What the lane's streams got from each address since a renewal was
	// last confirmed, in the order the addresses first failed: what a loss
	// at the local deadline reports.
	failed []streamFailure
}

type streamFailure struct {
	addr, what string
}

type keepAliveChannel struct {
	c          *Client
	mu         sync.Mutex
	lanes      []*lane
	placed     map[entryID]*placement
	maxPerLane int
	closed     bool
	gen        uint64
	seq        uint64
	wg         sync.WaitGroup
}

type placement struct {
	lease *Lease
	lane  *lane
}

// registration is a lease's handle on the channel.
type registration struct {
	ch *keepAliveChannel
	id entryID
	p  *placement
}

func newKeepAliveChannel(c *Client) *keepAliveChannel {
	return &keepAliveChannel{c: c, placed: map[entryID]*placement{}, maxPerLane: c.cfg.maxLeasesPerStream}
}

// callbacks are calls into leases, made once the channel's mutex is released.
type callbacks []func()

func (cb callbacks) run() {
	for _, f := range cb {
		f()
	}
}

func (ch *keepAliveChannel) register(l *Lease) *registration {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	id := entryID{l.key.AccountID, l.key.SessionID, l.runID}
	p := &placement{lease: l}
	r := &registration{ch: ch, id: id, p: p}
	if ch.closed {
		return r
	}
	if old := ch.placed[id]; old != nil {
		p.lane = old.lane
	} else {
		p.lane = ch.laneWithRoom()
	}
	ch.placed[id] = p
	p.lane.add(id, l)
	return r
}

// renew sends a renewal now (on a lane that is reconnecting, the reopened
// stream renews every lease).
func (r *registration) renew() {
	ch := r.ch
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.placed[r.id] != r.p {
		return
	}
	r.p.lane.send(r.id)
}

// deadlineLoss is the message and cause of a loss at the local deadline.
// When the lease's stream failed meanwhile, they name each address it
// tried since the last confirmed renewal and what that address last did (a
// refused connection, a stream ended, a renewal left unanswered), as the
// Python client's message does; the cause is an *UnavailableError whose
// Tried lists them.
func (r *registration) deadlineLoss() (string, error) {
	const msg = "the local deadline passed without a confirmed renewal"
	if r == nil {
		return msg, nil
	}
	ch := r.ch
	ch.mu.Lock()
	var tried []string
	if ch.placed[r.id] == r.p {
		for _, f := range r.p.lane.failed {
			tried = append(tried, f.addr+": "+f.what)
		}
	}
	ch.mu.Unlock()
	if len(tried) == 0 {
		return msg, nil
	}
	st := status.New(codes.Unavailable, "no server instance renewed the lease")
	return msg + " (the KeepAlive stream failed: " + strings.Join(tried, "; ") + ")", &UnavailableError{serverError{st}, tried}
}

// settled is closed once no renewal of the lease is unanswered: its
// answers came, it was lost, or its stream failed (the stall watch bounds
// that by the renewal interval). A run's Release waits for it, so that its
// own renewal, still on the way, is never refused as "released" and
// counted by the server as a lost lease.
func (r *registration) settled() <-chan struct{} {
	ch := r.ch
	ch.mu.Lock()
	defer ch.mu.Unlock()
	done := make(chan struct{})
	if ch.placed[r.id] != r.p {
		close(done)
		return done
	}
	ln := r.p.lane
	e := ln.entries[r.id]
	if e == nil || ln.stream == nil || len(e.outstanding) == 0 {
		close(done)
		return done
	}
	e.waiters = append(e.waiters, done)
	return done
}

// remove stops keeping the lease alive.
func (r *registration) remove() {
	ch := r.ch
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.placed[r.id] != r.p {
		return
	}
	delete(ch.placed, r.id)
	r.p.lane.remove(r.id)
}

func (ch *keepAliveChannel) laneWithRoom() *lane {
	for _, ln := range ch.lanes {
		if len(ln.entries) < ch.maxPerLane {
			return ln
		}
	}
	ln := &lane{ch: ch, entries: map[entryID]*entry{}}
	ch.lanes = append(ch.lanes, ln)
	return ln
}

// lowerLimit: the server carries at most max leases per stream and refused
// `refused` for carrying more. New leases go max to a stream from now on;
// the refused lane keeps its first max and the rest move to lanes with room.
// Other lanes are trimmed when the server refuses them in turn: the leases
// a stream has sent still count on the server until it ends.
func (ch *keepAliveChannel) lowerLimit(refused *lane, max int) {
	ch.maxPerLane = min(ch.maxPerLane, max)
	if len(refused.entries) <= ch.maxPerLane {
		return
	}
	ids := make([]entryID, 0, len(refused.entries))
	for id := range refused.entries {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b entryID) int {
		return int(refused.entries[a].seq) - int(refused.entries[b].seq)
	})
	for _, id := range ids[ch.maxPerLane:] {
		e := refused.entries[id]
		delete(refused.entries, id)
		p := ch.placed[id]
		if p == nil {
			continue
		}
		ln := ch.laneWithRoom()
		p.lane = ln
		connected := ln.stream != nil
		ln.add(id, e.lease)
		if connected {
			ln.send(id)
		}
	}
}

// close ends every stream at once and forgets every lease (Client.Close
// has released them), then waits for the streams' goroutines.
func (ch *keepAliveChannel) close() {
	ch.mu.Lock()
	ch.closed = true
	for _, ln := range ch.lanes {
		for _, e := range ln.entries {
			e.settle()
		}
		clear(ln.entries)
		ln.shutdown(true)
	}
	clear(ch.placed)
	ch.mu.Unlock()
	ch.wg.Wait()
}

func (ln *lane) add(id entryID, l *Lease) {
	ch := ln.ch
	ch.seq++
	// A lease of the same run placed again: a Release waiting on the entry
	// it replaces would otherwise wait on nothing.
	if old := ln.entries[id]; old != nil {
		old.settle()
	}
	ln.entries[id] = &entry{lease: l, seq: ch.seq}
	if ln.stream == nil && ln.reconnect == nil {
		ln.open()
	}
}

func (ln *lane) remove(id entryID) {
	e, ok := ln.entries[id]
	if !ok {
		return
	}
	e.settle()
	delete(ln.entries, id)
	if len(ln.entries) == 0 {
		ln.shutdown(false)
	}
}

// send queues a renewal of one lease on the open stream. ch.mu is held.
func (ln *lane) send(id entryID) {
	s := ln.stream
	e := ln.entries[id]
	if s == nil || e == nil {
		return
	}
	now := ln.ch.c.clock.Now()
	e.outstanding = append(e.outstanding, now)
	s.queue = append(s.queue, &leasev1.KeepAliveRequest{
		Key:   &leasev1.SessionKey{AccountId: id.accountID, SessionId: id.sessionID},
		RunId: id.runID,
		Ttl:   durationpb.New(e.lease.timing.ttl),
	})
	select {
	case s.wake <- struct{}{}:
	default:
	}
	if s.stall == nil {
		gen := s.gen
		s.stall = ln.ch.c.clock.AfterFunc(e.lease.timing.renewEvery, func() { ln.checkStall(gen) })
	}
}

// checkStall fails the stream when a renewal has gone unanswered for its
// lease's renewal interval: a half-open connection or a frozen proxy says
// nothing, so only silence tells.
func (ln *lane) checkStall(gen uint64) {
	ch := ln.ch
	ch.mu.Lock()
	s := ln.stream
	if s == nil || s.gen != gen {
		ch.mu.Unlock()
		return
	}
	now := ch.c.clock.Now()
	next := time.Duration(-1)
	var stalled time.Duration
	for _, e := range ln.entries {
		if len(e.outstanding) == 0 {
			continue
		}
		due := e.outstanding[0].Add(e.lease.timing.renewEvery).Sub(now)
		if due <= 0 {
			stalled = e.lease.timing.renewEvery
			break
		}
		if next < 0 || due < next {
			next = due
		}
	}
	if stalled > 0 {
		cb := ln.fail(gen, status.Errorf(codes.Unavailable, "no answer to a renewal within %s", stalled))
		ch.mu.Unlock()
		cb.run()
		return
	}
	if next >= 0 {
		s.stall.Reset(next)
	} else {
		s.stall = nil
	}
	ch.mu.Unlock()
}

// open starts a stream over a fresh connection to the lane's current
// address: a stalled HTTP/2 connection would stall a new stream on it too.
// ch.mu is held.
func (ln *lane) open() {
	ch := ln.ch
	ln.reconnect = nil
	c := ch.c
	addr := c.addrs[ln.addrIndex%len(c.addrs)]
	ch.gen++
	s := &laneStream{gen: ch.gen, addr: addr, wake: make(chan struct{}, 1)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	conn, _, err := c.dial(addr)
	if err != nil {
		// Only a malformed address fails here, and Dial checked them all.
		s.cancel()
		ln.stream = s
		// ch.mu is held: the leases hear of it from another goroutine.
		cb := ln.fail(s.gen, status.Error(codes.InvalidArgument, err.Error()))
		go cb.run()
		return
	}
	s.conn = conn
	ln.stream = s
	for id, e := range ln.entries {
		e.outstanding = nil
		ln.send(id)
	}
	c.log(slog.LevelDebug, "leasehold: keepalive stream opening", "addr", addr, "leases", len(ln.entries))
	ch.wg.Add(1)
	go ln.run(s)
}

// run drives one stream: opens it (the token function runs here), sends
// what is queued, and reads answers until the stream ends.
func (ln *lane) run(s *laneStream) {
	ch := ln.ch
	defer ch.wg.Done()
	defer func() {
		s.cancel()
		_ = s.conn.Close()
	}()
	stream, err := leasev1.NewLeaseServiceClient(s.conn).KeepAlive(s.ctx)
	if err != nil {
		ch.mu.Lock()
		cb := ln.fail(s.gen, err)
		ch.mu.Unlock()
		cb.run()
		return
	}
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		ln.sendLoop(s, stream)
	}()
	defer func() { <-sent }()
	for {
		resp, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = status.Error(codes.Unavailable, "the server ended the KeepAlive stream")
			}
			ch.mu.Lock()
			cb := ln.fail(s.gen, err)
			ch.mu.Unlock()
			s.cancel()
			cb.run()
			return
		}
		ch.mu.Lock()
		cb := ln.dispatch(s, resp)
		ch.mu.Unlock()
		cb.run()
	}
}

func (ln *lane) sendLoop(s *laneStream, stream grpc.BidiStreamingClient[leasev1.KeepAliveRequest, leasev1.KeepAliveResponse]) {
	ch := ln.ch
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-s.wake:
		}
		ch.mu.Lock()
		queue, ended := s.queue, s.ended
		s.queue = nil
		ch.mu.Unlock()
		for _, req := range queue {
			if stream.Send(req) != nil {
				// Broken: Recv reports why.
				return
			}
		}
		if ended {
			_ = stream.CloseSend()
			return
		}
	}
}

func (ln *lane) dispatch(s *laneStream, resp *leasev1.KeepAliveResponse) callbacks {
	if ln.stream != s {
		return nil
	}
	id := entryID{resp.GetKey().GetAccountId(), resp.GetKey().GetSessionId(), resp.GetRunId()}
	e := ln.entries[id]
	if e == nil {
		return nil
	}
	switch r := resp.GetResult().(type) {
	case *leasev1.KeepAliveResponse_Lease:
		var sentAt time.Time
		if len(e.outstanding) > 0 {
			sentAt, e.outstanding = e.outstanding[0], e.outstanding[1:]
		}
		var settled []chan struct{}
		if len(e.outstanding) == 0 {
			settled = e.detach()
		}
		ln.failures, ln.authRetries, ln.failed = 0, 0, nil
		return callbacks{func() {
			e.lease.renewed(r.Lease, sentAt)
			wake(settled)
		}}
	case *leasev1.KeepAliveResponse_Lost:
		settled := e.detach()
		delete(ln.entries, id)
		delete(ln.ch.placed, id)
		if len(ln.entries) == 0 {
			ln.shutdown(false)
		}
		reason := lossReason(r.Lost.GetReason())
		msg := fmt.Sprintf("the server reports the lease lost (%s)", reason)
		return callbacks{func() {
			e.lease.lose(reason, msg, nil)
			wake(settled)
		}}
	case *leasev1.KeepAliveResponse_HandoffRequested:
		return callbacks{func() { e.lease.handoff(r.HandoffRequested) }}
	case *leasev1.KeepAliveResponse_Undecided:
		// Answered, so not stalled; the lease's deadline does not move.
		if len(e.outstanding) > 0 {
			e.outstanding = e.outstanding[1:]
		}
		var settled []chan struct{}
		if len(e.outstanding) == 0 {
			settled = e.detach()
		}
		ln.failures = 0
		st := status.FromProto(r.Undecided)
		ln.ch.c.log(slog.LevelWarn, MsgRenewalUndecided,
			"addr", s.addr, "account_id", id.accountID, "session_id", id.sessionID, "run_id", id.runID,
			"err", st.Err(), "sql_state", errorInfo(st).GetMetadata()["sql_state"])
		return callbacks{func() { wake(settled) }}
	}
	return nil
}

func lossReason(r leasev1.LossReason) LossReason {
	switch r {
	case leasev1.LossReason_LOSS_REASON_EXPIRED:
		return LossExpired
	case leasev1.LossReason_LOSS_REASON_RELEASED:
		return LossReleased
	case leasev1.LossReason_LOSS_REASON_TAKEN_OVER:
		return LossTakenOver
	case leasev1.LossReason_LOSS_REASON_REVOKED:
		return LossRevoked
	case leasev1.LossReason_LOSS_REASON_NOT_FOUND:
		return LossNotFound
	}
	return LossRenewalFailed
}

// Codes after which sending the same renewals again cannot succeed
// (UNAUTHENTICATED is decided apart: a fresh token may fix it).
var definitive = map[codes.Code]bool{
	codes.InvalidArgument:    true,
	codes.PermissionDenied:   true,
	codes.Unimplemented:      true,
	codes.FailedPrecondition: true,
}

// fail ends the lane's stream of generation gen and decides what follows:
// reconnect after a backoff, or lose every lease when retrying cannot help.
// ch.mu is held; the returned callbacks run after it is released.
func (ln *lane) fail(gen uint64, err error) callbacks {
	ch := ln.ch
	c := ch.c
	s := ln.stream
	if s == nil || s.gen != gen {
		return nil
	}
	ln.stream = nil
	if s.stall != nil {
		s.stall.Stop()
	}
	s.cancel()
	ln.noteFailure(s.addr, status.Convert(err).Message())
	lerr := fromStatus(err)
	code := status.Code(err)
	loseAll := func(reason LossReason, msg string) callbacks {
		var cb callbacks
		for id, e := range ln.entries {
			delete(ch.placed, id)
			settled := e.detach()
			cb = append(cb, func() {
				e.lease.lose(reason, msg, lerr)
				wake(settled)
			})
		}
		clear(ln.entries)
		c.log(slog.LevelError, "leasehold: keepalive stream failed for good", "addr", s.addr, "err", lerr)
		return cb
	}
	if code == codes.Unauthenticated {
		// The server ends a stream whose token has expired. A token
		// function gives a fresh one on the next open; a static token
		// cannot (its expiry is LossTokenExpired, as in the TypeScript and
		// Python clients; any other refusal is LossRenewalFailed), and
		// neither can a function that keeps failing. A client certificate
		// read again from its files for each connection is renewed as a
		// token function's token is.
		if (c.cfg.token == nil || c.cfg.staticToken) && !c.cfg.reopensOnExpiry() {
			reason := LossRenewalFailed
			if authFailure(lerr) == "expired" {
				reason = LossTokenExpired
			}
			return loseAll(reason, "the server refused the bearer token ("+authCause(err)+"); a static token cannot be refreshed: use WithTokenFunc")
		}
		if ln.authRetries >= 3 {
			return loseAll(LossRenewalFailed, "the server refused every fresh bearer token ("+authCause(err)+")")
		}
		ln.authRetries++
		if len(ln.entries) > 0 && !ch.closed {
			c.log(slog.LevelInfo, "leasehold: keepalive stream reopening with a fresh token", "addr", s.addr, "err", lerr)
			ln.open()
		}
		return nil
	}
	if definitive[code] {
		return loseAll(LossRenewalFailed, "renewals failed: "+lerr.Error())
	}
	// What was on the way on this stream will not be answered.
	for _, e := range ln.entries {
		e.settle()
	}
	// Full jitter: many clients cut off by one instance's death do not all
	// land on the next one at the same instant.
	bound := min(c.cfg.backoffMax, c.cfg.backoffInitial<<min(ln.failures, 20))
	delay := time.Duration(rand.Int64N(int64(bound) + 1))
	ln.failures++
	ln.addrIndex++
	if len(ln.entries) == 0 || ch.closed {
		return nil
	}
	ln.reconnect = c.clock.AfterFunc(delay, func() {
		ch.mu.Lock()
		defer ch.mu.Unlock()
		if ln.reconnect != nil && !ch.closed && len(ln.entries) > 0 {
			ln.open()
		}
	})
	c.log(slog.LevelWarn, "leasehold: keepalive stream failed; reconnecting", "addr", s.addr, "err", lerr, "retry_in", delay, "next", c.addrs[ln.addrIndex%len(c.addrs)])
	var re *ResourceExhaustedError
	if errors.As(lerr, &re) && re.Limit == "max-leases-per-stream" && re.Max >= 1 {
		ch.lowerLimit(ln, re.Max)
	}
	return nil
}

// noteFailure records what a stream to addr got, replacing what that
// address did before. ch.mu is held.
func (ln *lane) noteFailure(addr, what string) {
	for i := range ln.failed {
		if ln.failed[i].addr == addr {
			ln.failed[i].what = what
			return
		}
	}
	ln.failed = append(ln.failed, streamFailure{addr, what})
}

func authCause(err error) string {
	if cause := authFailure(fromStatus(err)); cause != "" {
		return cause
	}
	return status.Convert(err).Message()
}

// shutdown ends the lane's stream. A lane left empty half-closes, so the
// server ends the stream cleanly, and cuts it a second later if it does
// not; at Client.Close it cuts at once. ch.mu is held.
func (ln *lane) shutdown(now bool) {
	ln.failed = nil
	if ln.reconnect != nil {
		ln.reconnect.Stop()
		ln.reconnect = nil
	}
	s := ln.stream
	if s == nil {
		return
	}
	ln.stream = nil
	if s.stall != nil {
		s.stall.Stop()
	}
	if now {
		s.cancel()
		return
	}
	s.ended = true
	select {
	case s.wake <- struct{}{}:
	default:
	}
	ln.ch.c.clock.AfterFunc(time.Second, s.cancel)
}
