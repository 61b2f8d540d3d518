package main

import (
	"context"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "leasehold.dev/examples/gen/leasehold/v1"
)

// holding is one grant of the session to this run, bounded by a local
// deadline.
//
// The deadline is when the request that confirmed the lease was sent, plus
// the lease's `remaining` (computed by the database), minus a safety margin.
// The server measured `remaining` after the request left, so counting it
// from the send time errs early, never late. time.Now() carries Go's
// monotonic clock reading, and every comparison below (time.Until, Add,
// context deadlines) uses it, so a wall-clock jump cannot move the deadline.
type holding struct {
	ev     *events
	key    *leasev1.SessionKey
	runID  string
	token  int64
	margin time.Duration

	mu          sync.Mutex
	deadline    time.Time
	stopReason  string
	cancelWrite context.CancelFunc

	stopped     chan struct{}
	handoff     chan struct{}
	handoffOnce sync.Once
}

func newHolding(ev *events, lease *leasev1.Lease, sentAt time.Time, margin time.Duration) *holding {
	return &holding{
		ev:       ev,
		key:      lease.GetKey(),
		runID:    lease.GetRunId(),
		token:    lease.GetFencingToken(),
		margin:   margin,
		deadline: sentAt.Add(lease.GetRemaining().AsDuration() - margin),
		stopped:  make(chan struct{}),
		handoff:  make(chan struct{}),
	}
}

func (h *holding) isStopped() bool {
	select {
	case <-h.stopped:
		return true
	default:
		return false
	}
}

func (h *holding) reason() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stopReason
}

func (h *holding) timeLeft() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return time.Until(h.deadline)
}

// confirm extends the deadline after a renewal sent at sentAt succeeded,
// and returns the time left.
func (h *holding) confirm(sentAt time.Time, lease *leasev1.Lease) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	confirmed := sentAt.Add(lease.GetRemaining().AsDuration() - h.margin)
	// An earlier request answered late must not shorten what a later one
	// confirmed.
	if confirmed.After(h.deadline) {
		h.deadline = confirmed
	}
	return time.Until(h.deadline)
}

// stop ends the work once; later calls change nothing.
func (h *holding) stop(reason string, detail fields) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.isStopped() {
		return false
	}
	now := time.Now()
	close(h.stopped)
	h.stopReason = reason
	if h.cancelWrite != nil {
		h.cancelWrite()
	}
	f := fields{"reason": reason, "at_ms": h.ev.ms(now), "slack_ms": millis(h.deadline.Sub(now))}
	for k, v := range detail {
		f[k] = v
	}
	h.ev.emit("stopped", f)
	return true
}

// startWrite gives a write its context unless the run has stopped. The
// check happens under the lock that stop takes, so every write began before
// the stop; stop cancels the one in flight. The context ends at the local
// deadline: a write must not outlive the lease as far as this run knows.
func (h *holding) startWrite(parent context.Context) (context.Context, float64, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.isStopped() {
		return nil, 0, false
	}
	now := time.Now()
	if !now.Before(h.deadline) {
		return nil, 0, false
	}
	ctx, cancel := context.WithDeadline(parent, h.deadline)
	h.cancelWrite = cancel
	return ctx, h.ev.ms(now), true
}

func (h *holding) endWrite() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cancelWrite != nil {
		h.cancelWrite()
		h.cancelWrite = nil
	}
}

func (h *holding) requestHandoff() {
	h.handoffOnce.Do(func() { close(h.handoff) })
}

func (h *holding) handoffRequested() bool {
	select {
	case <-h.handoff:
		return true
	default:
		return false
	}
}

// watch stops the run when the deadline passes. A renewal only moves the
// deadline later, so waking at an old deadline and reading it again is
// enough.
func (h *holding) watch() {
	for {
		left := h.timeLeft()
		if left <= 0 {
			h.stop("deadline", nil)
			return
		}
		timer := time.NewTimer(left)
		select {
		case <-h.stopped:
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

// keepAlive renews the run's lease over one bidirectional KeepAlive stream.
type keepAlive struct {
	client leasev1.LeaseServiceClient
	h      *holding
	ttl    time.Duration
	every  time.Duration

	mu sync.Mutex
	// Send times of renewals not answered yet, oldest first: the server
	// answers one run's renewals in order.
	sent   []time.Time
	stream leasev1.LeaseService_KeepAliveClient
	cancel context.CancelFunc
}

func (k *keepAlive) start(parent context.Context) error {
	ctx, cancel := context.WithCancel(parent)
	stream, err := k.client.KeepAlive(ctx)
	if err != nil {
		cancel()
		return err
	}
	k.stream, k.cancel = stream, cancel
	go k.read()
	go k.renew()
	return nil
}

func (k *keepAlive) close() {
	k.cancel()
}

func (k *keepAlive) renew() {
	// The first renewal goes out at once: the server watches a run for
	// `lost` and handoff requests only once the stream has named it.
	for {
		k.mu.Lock()
		k.sent = append(k.sent, time.Now())
		k.mu.Unlock()
		err := k.stream.Send(&leasev1.KeepAliveRequest{
			Key:   k.h.key,
			RunId: k.h.runID,
			Ttl:   durationpb.New(k.ttl),
		})
		if err != nil {
			// The stream is broken; read() gets the status from Recv.
			return
		}
		timer := time.NewTimer(k.every)
		select {
		case <-k.h.stopped:
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

func (k *keepAlive) read() {
	h := k.h
	for {
		resp, err := k.stream.Recv()
		if err == io.EOF {
			h.stop("stream_ended", nil)
			return
		}
		if err != nil {
			// Our own cancel after a stop ends the stream too: not news.
			if !h.isStopped() {
				h.stop("stream_failed", describeError(err))
			}
			return
		}
		if resp.GetRunId() != h.runID {
			continue
		}
		switch result := resp.GetResult().(type) {
		case *leasev1.KeepAliveResponse_Lease:
			k.mu.Lock()
			var sentAt time.Time
			if len(k.sent) > 0 {
				sentAt, k.sent = k.sent[0], k.sent[1:]
			}
			k.mu.Unlock()
			if sentAt.IsZero() {
				continue
			}
			left := h.confirm(sentAt, result.Lease)
			h.ev.emit("renewed", fields{
				"token":          tokenString(result.Lease.GetFencingToken()),
				"remaining_ms":   result.Lease.GetRemaining().AsDuration().Milliseconds(),
				"deadline_in_ms": millis(left),
			})
		case *leasev1.KeepAliveResponse_Lost:
			h.stop("lost", fields{"cause": result.Lost.GetReason().String()})
			return
		case *leasev1.KeepAliveResponse_HandoffRequested:
			h.ev.emit("handoff_requested", fields{
				"requester_holder": result.HandoffRequested.GetRequesterHolder(),
				"reason":           result.HandoffRequested.GetReason(),
			})
			h.requestHandoff()
		}
	}
}

// withBearer adds the lease server's bearer token, when there is one.
func withBearer(ctx context.Context, token string) context.Context {
	if token == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}
