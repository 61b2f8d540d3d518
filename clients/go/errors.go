package leasehold

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of every detail Leasehold sends.
const ErrorDomain = "leasehold.dev"

// ErrorInfo reasons Leasehold sends (docs/client.md lists what each carries).
const (
	ReasonLeaseNotHeld      = "LEASE_NOT_HELD"
	ReasonStaleFencingToken = "STALE_FENCING_TOKEN"
	ReasonInvalidArgument   = "INVALID_ARGUMENT"
	ReasonLimitExceeded     = "LIMIT_EXCEEDED"
	ReasonUnauthenticated   = "UNAUTHENTICATED"
	// ReasonKeeperNotHeld: FAILED_PRECONDITION, the keeper named has ended
	// (metadata cause: expired, closed, revoked, not_found).
	ReasonKeeperNotHeld = "KEEPER_NOT_HELD"
	// ReasonDatabaseUnavailable: UNAVAILABLE, the database could not answer
	// (metadata sql_state when it said why); retrying may succeed.
	ReasonDatabaseUnavailable = "DATABASE_UNAVAILABLE"
)

// Sentinels for errors.Is. Every error of this package also carries the
// gRPC status it came from: status.Code(err) and status.Convert(err) work on it.
var (
	// ErrNotAcquired: the session is held by another run (*NotAcquiredError),
	// or the grant arrived too late to use (ErrLateGrant).
	ErrNotAcquired = errors.New("leasehold: not acquired")
	// ErrLateGrant: a grant whose answer arrived after its own local
	// deadline (L2). It counts as not acquired; the client released it.
	ErrLateGrant = errors.New("leasehold: the grant arrived after its local deadline")
	// ErrLeaseNotHeld: Renew or Release of a run without a valid lease
	// (FAILED_PRECONDITION, reason LEASE_NOT_HELD); see *LeaseNotHeldError.
	ErrLeaseNotHeld = errors.New("leasehold: lease not held")
	// ErrLeaseLost: the lease was lost; see *LeaseLostError.
	ErrLeaseLost = errors.New("leasehold: lease lost")
	// ErrReleased is the context.Cause of a lease's Context after its own
	// Release: the run ended it, nothing was lost.
	ErrReleased = errors.New("leasehold: lease released by its run")
	// ErrStaleFencingToken: a guarded resource refused a token below the
	// highest it has seen (ABORTED, STALE_FENCING_TOKEN); see *StaleFencingTokenError.
	ErrStaleFencingToken = errors.New("leasehold: stale fencing token")
	// ErrResourceExhausted: a limit or quota (RESOURCE_EXHAUSTED); see *ResourceExhaustedError.
	ErrResourceExhausted = errors.New("leasehold: resource exhausted")
	// ErrInvalidArgument: a request field broke a rule; see *InvalidArgumentError.
	ErrInvalidArgument = errors.New("leasehold: invalid argument")
	// ErrUnauthenticated: the server did not accept the credentials.
	ErrUnauthenticated = errors.New("leasehold: unauthenticated")
	// ErrPermissionDenied: the caller may not touch this account, session or method.
	ErrPermissionDenied = errors.New("leasehold: permission denied")
	// ErrUnavailable: no configured instance could answer; see *UnavailableError.
	ErrUnavailable = errors.New("leasehold: unavailable")
	// ErrClosed: the client was closed.
	ErrClosed = errors.New("leasehold: client closed")
	// ErrKeeperLost: the keeper was lost; see *KeeperLostError. Every
	// lease on it was lost with it: its *LeaseLostError wraps the keeper's.
	ErrKeeperLost = errors.New("leasehold: keeper lost")
	// ErrKeeperClosed is the context.Cause of a keeper's Context after its
	// own Close: the process ended it, nothing was lost.
	ErrKeeperClosed = errors.New("leasehold: keeper closed by its process")
	// ErrResigned is the context.Cause of a Leadership's Context after its
	// own Resign: the leader ended its term, nothing was lost.
	ErrResigned = errors.New("leasehold: leadership resigned")
	// ErrKeeperNotHeld: the server says the keeper named has ended
	// (FAILED_PRECONDITION, reason KEEPER_NOT_HELD); see *KeeperNotHeldError.
	ErrKeeperNotHeld = errors.New("leasehold: keeper not held")
)

// LossReason says why a lease was lost: a cause the server reported
// (expired, released, taken_over, revoked, not_found), or one the client
// decided: deadline, renewal_failed, token_expired.
type LossReason string

// Loss reasons.
const (
	LossExpired       LossReason = "expired"
	LossReleased      LossReason = "released"
	LossTakenOver     LossReason = "taken_over"
	LossRevoked       LossReason = "revoked"
	LossNotFound      LossReason = "not_found"
	LossDeadline      LossReason = "deadline"
	LossRenewalFailed LossReason = "renewal_failed"
	// LossTokenExpired: the server ended the stream because the client's
	// static token (WithToken) expired, and a static token cannot be
	// refreshed. The TypeScript and Python clients name it the same.
	LossTokenExpired LossReason = "token_expired"
	// LossClosed: a keeper closed (by another stream of it, or an admin's
	// close); its leases were released with it.
	LossClosed LossReason = "closed"
)

// serverError is the part every error from a server answer shares: its
// status, so status.Code and status.Convert see through the typed error.
type serverError struct{ st *status.Status }

func (e serverError) GRPCStatus() *status.Status { return e.st }

// NotAcquiredError: the session is held by another run. Current is the
// lease that blocked the grant, so a UI can say who holds it and for how long.
// LockDelayUntil is set instead when no lease holds the session but its last
// one was on a keeper that expired (K2): no run gets it before that instant
// (on the database clock).
type NotAcquiredError struct {
	Current        *leasev1.Lease
	LockDelayUntil time.Time
}

// notAcquired is the *NotAcquiredError of an Acquire's refusal.
func notAcquired(resp *leasev1.AcquireResponse) *NotAcquiredError {
	e := &NotAcquiredError{Current: resp.GetCurrent()}
	if resp.GetLockDelayUntil() != nil {
		e.LockDelayUntil = resp.GetLockDelayUntil().AsTime()
	}
	return e
}

func (e *NotAcquiredError) Error() string {
	c := e.Current
	if c == nil && !e.LockDelayUntil.IsZero() {
		return "leasehold: session held back by the lock-delay of an expired keeper until " + e.LockDelayUntil.UTC().Format(time.RFC3339Nano)
	}
	if c == nil {
		return "leasehold: session held by another run"
	}
	who := "another run"
	if c.GetHolder() != "" {
		who = strconv.Quote(c.GetHolder())
	}
	return fmt.Sprintf("leasehold: session %s/%s held by %s (run %s, token %d), %.1fs left",
		c.GetKey().GetAccountId(), c.GetKey().GetSessionId(), who, c.GetRunId(), c.GetFencingToken(),
		c.GetRemaining().AsDuration().Seconds())
}

// Is makes errors.Is(err, ErrNotAcquired) true.
func (e *NotAcquiredError) Is(target error) bool { return target == ErrNotAcquired }

// LateGrantError: the grant's answer arrived after its local deadline (L2);
// the client released it. errors.Is matches ErrLateGrant and ErrNotAcquired.
type LateGrantError struct {
	// Lease is the grant that came too late (already released).
	Lease *leasev1.Lease
	// Elapsed is how long the answer took, on the monotonic clock.
	Elapsed time.Duration
}

func (e *LateGrantError) Error() string {
	return fmt.Sprintf("leasehold: the grant arrived %s after the request was sent, past its local deadline; it was released", e.Elapsed.Round(time.Millisecond))
}

// Is makes errors.Is match ErrLateGrant and ErrNotAcquired.
func (e *LateGrantError) Is(target error) bool {
	return target == ErrLateGrant || target == ErrNotAcquired
}

// LeaseNotHeldError: FAILED_PRECONDITION, reason LEASE_NOT_HELD. Cause is
// what the server said: expired, released, taken_over, revoked, not_found
// ("" when it did not say).
type LeaseNotHeldError struct {
	serverError
	Cause LossReason
}

func (e *LeaseNotHeldError) Error() string {
	return "leasehold: lease not held: " + e.st.Message()
}

// Is makes errors.Is(err, ErrLeaseNotHeld) true.
func (e *LeaseNotHeldError) Is(target error) bool { return target == ErrLeaseNotHeld }

// LeaseLostError is the context.Cause of a lost lease's Context, and what
// Lease.Err, Release and RunExclusive return after loss. Reason says why;
// Err, when set, is the error that caused it.
type LeaseLostError struct {
	Reason  LossReason
	Message string
	Err     error
}

func (e *LeaseLostError) Error() string { return "leasehold: lease lost: " + e.Message }

// Unwrap returns the error that caused the loss, if any.
func (e *LeaseLostError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrLeaseLost) true.
func (e *LeaseLostError) Is(target error) bool { return target == ErrLeaseLost }

// KeeperNotHeldError: FAILED_PRECONDITION, reason KEEPER_NOT_HELD: the
// keeper has ended. Cause is what the server said: expired, closed,
// revoked, not_found.
type KeeperNotHeldError struct {
	serverError
	Cause LossReason
}

func (e *KeeperNotHeldError) Error() string {
	return "leasehold: keeper not held: " + e.st.Message()
}

// Is makes errors.Is(err, ErrKeeperNotHeld) true.
func (e *KeeperNotHeldError) Is(target error) bool { return target == ErrKeeperNotHeld }

// KeeperLostError is the context.Cause of a lost keeper's Context, what
// Keeper.Err returns after the loss, and the Err of the *LeaseLostError of
// every lease that was on it (so errors.Is(leaseErr, ErrKeeperLost) tells a
// lease lost with its keeper from one lost alone). Reason is the same set
// as a lease's: expired, revoked, closed, not_found (the server's), or
// deadline, renewal_failed, token_expired (the client's).
type KeeperLostError struct {
	KeeperID string
	Reason   LossReason
	Message  string
	Err      error
}

func (e *KeeperLostError) Error() string {
	return "leasehold: keeper " + e.KeeperID + " lost: " + e.Message
}

// Unwrap returns the error that caused the loss, if any.
func (e *KeeperLostError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrKeeperLost) true.
func (e *KeeperLostError) Is(target error) bool { return target == ErrKeeperLost }

// StaleFencingTokenError: ABORTED, reason STALE_FENCING_TOKEN. A newer run
// holds, or held, the session; the write did not happen. Presented and
// Highest are 0 when the server did not say.
type StaleFencingTokenError struct {
	serverError
	Presented, Highest int64
}

func (e *StaleFencingTokenError) Error() string {
	return "leasehold: stale fencing token: " + e.st.Message()
}

// Is makes errors.Is(err, ErrStaleFencingToken) true.
func (e *StaleFencingTokenError) Is(target error) bool { return target == ErrStaleFencingToken }

// ResourceExhaustedError: RESOURCE_EXHAUSTED. Limit names the bound when the
// server said (LIMIT_EXCEEDED: e.g. max-leases-per-stream), Max its value (0
// when not said).
type ResourceExhaustedError struct {
	serverError
	Limit string
	Max   int
}

func (e *ResourceExhaustedError) Error() string {
	return "leasehold: resource exhausted: " + e.st.Message()
}

// Is makes errors.Is(err, ErrResourceExhausted) true.
func (e *ResourceExhaustedError) Is(target error) bool { return target == ErrResourceExhausted }

// InvalidArgumentError: INVALID_ARGUMENT; Field names the request field
// (e.g. "ttl", "key.session_id"), Rule the rule it broke.
type InvalidArgumentError struct {
	serverError
	Field, Rule string
}

func (e *InvalidArgumentError) Error() string {
	return "leasehold: invalid argument: " + e.st.Message()
}

// Is makes errors.Is(err, ErrInvalidArgument) true.
func (e *InvalidArgumentError) Is(target error) bool { return target == ErrInvalidArgument }

// UnavailableError: no instance answered. Tried lists every attempt,
// "address: what it did", in order: an idempotent call tries each address
// twice. As the cause of a loss at the local deadline, it lists each
// address the KeepAlive stream tried since its last confirmed renewal.
type UnavailableError struct {
	serverError
	Tried []string
}

func (e *UnavailableError) Error() string {
	return "leasehold: unavailable: " + strings.Join(e.Tried, "; ")
}

// Is makes errors.Is(err, ErrUnavailable) true.
func (e *UnavailableError) Is(target error) bool { return target == ErrUnavailable }

// codeError is any other answer of a server: UNAUTHENTICATED,
// PERMISSION_DENIED, DEADLINE_EXCEEDED, CANCELED, …; errors.Is matches its
// sentinel where it has one, and status.Code gives its code.
type codeError struct {
	serverError
	sentinel error
	// Cause is the ErrorInfo `cause` metadata, e.g. "expired" for UNAUTHENTICATED.
	cause string
}

func (e *codeError) Error() string {
	return fmt.Sprintf("leasehold: %s: %s", e.st.Code(), e.st.Message())
}

func (e *codeError) Is(target error) bool {
	switch {
	case e.sentinel != nil && target == e.sentinel:
		return true
	case target == context.DeadlineExceeded:
		return e.st.Code() == codes.DeadlineExceeded
	case target == context.Canceled:
		return e.st.Code() == codes.Canceled
	}
	return false
}

func errorInfo(st *status.Status) *errdetails.ErrorInfo {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && (info.GetDomain() == ErrorDomain || info.GetDomain() == "") {
			return info
		}
	}
	return nil
}

// authFailure is the `cause` of an UNAUTHENTICATED answer ("expired" when
// the bearer token has expired); "" for any other error.
func authFailure(err error) string {
	var ce *codeError
	if errors.As(err, &ce) && ce.st.Code() == codes.Unauthenticated {
		return ce.cause
	}
	return ""
}

// fromStatus turns an error of a gRPC call into this package's typed error.
// Errors that are not gRPC statuses (a context's own error) pass through.
func fromStatus(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	info := errorInfo(st)
	md := info.GetMetadata()
	se := serverError{st}
	switch {
	case info.GetReason() == ReasonLeaseNotHeld || (st.Code() == codes.FailedPrecondition && info == nil):
		return &LeaseNotHeldError{se, LossReason(md["cause"])}
	case info.GetReason() == ReasonKeeperNotHeld:
		return &KeeperNotHeldError{se, LossReason(md["cause"])}
	case info.GetReason() == ReasonStaleFencingToken || (st.Code() == codes.Aborted && info != nil):
		presented, _ := strconv.ParseInt(md["presented_token"], 10, 64)
		highest, _ := strconv.ParseInt(md["highest_token"], 10, 64)
		return &StaleFencingTokenError{se, presented, highest}
	}
	switch st.Code() {
	case codes.InvalidArgument:
		field, rule := md["field"], st.Message()
		for _, d := range st.Details() {
			if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) > 0 {
				field, rule = br.GetFieldViolations()[0].GetField(), br.GetFieldViolations()[0].GetDescription()
			}
		}
		return &InvalidArgumentError{se, field, rule}
	case codes.ResourceExhausted:
		limit, _ := strconv.Atoi(md["max"])
		return &ResourceExhaustedError{se, md["limit"], limit}
	case codes.Unavailable:
		return &UnavailableError{se, nil}
	case codes.Unauthenticated:
		return &codeError{se, ErrUnauthenticated, md["cause"]}
	case codes.PermissionDenied:
		return &codeError{se, ErrPermissionDenied, ""}
	}
	return &codeError{se, nil, md["cause"]}
}

// FromError maps an error of a gRPC call made outside the client (to a
// guarded store, say) to this package's typed errors, as the client's own
// calls are: a STALE_FENCING_TOKEN refusal becomes *StaleFencingTokenError.
func FromError(err error) error { return fromStatus(err) }
