package leasehold

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// failsOver: the call reached no server that answered it: UNAVAILABLE
// (refused, reset or closed connection), or ABORTED without an ErrorInfo (a
// connection cut under the call; Leasehold's own ABORTED, a stale fencing
// token, always carries one), as the Python client reads them. The next
// instance may be asked, and an idempotent call each one again.
func failsOver(err error) bool {
	switch st := status.Convert(err); st.Code() {
	case codes.Unavailable:
		return true
	case codes.Aborted:
		return errorInfo(st) == nil
	}
	return false
}

// idempotentMethods change nothing when sent twice: reads, and writes keyed
// by the caller's run id (S5: a Release can only end that run's own lease;
// sent again after it succeeded it answers released=false). Revoke and
// RequestHandoff are not among them: a second Revoke could end a lease
// granted in between, a second RequestHandoff records a second request.
// Acquire is idempotent with its run id (same run id, same token), which
// Client.Acquire always sends (the caller's, or one it makes).
var idempotentMethods = map[string]bool{
	"Renew": true, "Release": true, "Get": true, "List": true, "History": true, "CheckFence": true,
}

// secondRoundPause comes before an idempotent call's second round, which
// asks addresses already tried: a connection reset under the first attempt
// may not yet be seen by the gRPC channel, whose next call would then go
// out on the dead connection. A pause of this length, as a gRPC retry
// policy's backoff, lets it close the connection and dial again (the
// Python client's SECOND_ROUND_PAUSE_S).
const secondRoundPause = 100 * time.Millisecond

// unary runs call on the preferred instance, failing over to the others in
// turn; an idempotent method then tries each instance once more. The
// instance that answered is preferred next time.
func unary[T any](ctx context.Context, c *Client, method string, call func(context.Context, leasev1.LeaseServiceClient) (T, error)) (T, error) {
	return unaryAttempts(ctx, c, method, idempotentMethods[method], call)
}

// unaryAttempts is unary with the method's idempotence given: each address
// once from the preferred one and, when idempotent, each again after a
// pause (a connection reset under a call fails that call once though the
// same address answers the next one; with a single address there is
// nowhere else to go). Every attempt shares the call's one deadline.
func unaryAttempts[T any](ctx context.Context, c *Client, method string, idempotent bool, call func(context.Context, leasev1.LeaseServiceClient) (T, error)) (T, error) {
	var zero T
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.cfg.callTimeout)
		defer cancel()
	}
	n := len(c.endpoints)
	attempts := n
	if idempotent {
		attempts = 2 * n
	}
	start := int(c.preferred.Load())
	var tried []string
	var last error
	for i := range attempts {
		if i == n && !pauseWithin(ctx, secondRoundPause) {
			break
		}
		index := (start + i) % n
		ep := c.endpoints[index]
		resp, err := call(ctx, ep.stub)
		if err == nil {
			c.preferred.Store(int32(index))
			return resp, nil
		}
		if ctx.Err() != nil || !failsOver(err) {
			if len(tried) == 0 {
				return zero, fromStatus(err)
			}
			tried = append(tried, fmt.Sprintf("%s: %s", ep.addr, status.Convert(err).Message()))
			return zero, fmt.Errorf("leasehold: %s after failover (%s): %w", method, strings.Join(tried, "; "), fromStatus(err))
		}
		tried = append(tried, fmt.Sprintf("%s: %s", ep.addr, status.Convert(err).Message()))
		last = err
		if i+1 < attempts {
			c.log(slog.LevelWarn, "leasehold: failover", "method", method, "addr", ep.addr, "err", err, "next", c.endpoints[(index+1)%n].addr)
		}
	}
	// Every attempt failed without an answer: UNAVAILABLE, whatever the
	// last one read as (an ABORTED cut).
	st := status.Convert(last)
	if st.Code() != codes.Unavailable {
		st = status.New(codes.Unavailable, st.Message())
	}
	return zero, &UnavailableError{serverError{st}, tried}
}

// pauseWithin waits d, or half of what is left of ctx's deadline if that is
// less; false when ctx ends first.
func pauseWithin(ctx context.Context, d time.Duration) bool {
	// On the real clock, as ctx's deadline is.
	if deadline, ok := ctx.Deadline(); ok {
		d = min(d, time.Until(deadline)/2)
	}
	if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
	}
	return ctx.Err() == nil
}
