// Package fence guards a Go resource with Leasehold fencing tokens (DESIGN
// S7, §5): the check runs the leasehold_fence SQL function of
// migrations/fence/0001_fence.sql in the resource's own PostgreSQL, inside
// the transaction of the write it guards, so a stale run's late write is
// refused atomically with the check.
//
// It uses database/sql: bring a PostgreSQL driver (pgx's stdlib, lib/pq)
// and apply migrations/fence/0001_fence.sql to the database.
//
// Given the lease server (Options.Leases), the interceptor runs the guarded
// store's grant check (src/guarded/live-check.ts): a call whose token would
// raise the session's fence must present the newest token the lease server
// granted for that session, so nobody who reaches the service can poison a
// fence with 2^63−1. Options.Live checks every call instead (live mode).
package fence

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
)

// StaleTokenSQLState is the SQLSTATE leasehold_fence raises for a stale
// token; its DETAIL holds the highest token seen.
const StaleTokenSQLState = "LHF01"

// Claim is the session and token a call writes with.
type Claim struct {
	Key   leasehold.SessionKey
	Token int64
}

// Check runs the fence in tx: accepts claim.Token if it is at least the
// highest token seen for the session, records it, and returns the new
// highest. A stale token is a *leasehold.StaleFencingTokenError, and tx can
// no longer commit. Call it before the guarded write, in the same tx.
func Check(ctx context.Context, tx *sql.Tx, claim Claim) (int64, error) {
	if claim.Token <= 0 {
		return 0, status.Errorf(codes.InvalidArgument, "fencing_token must be a positive fencing token, got %d", claim.Token)
	}
	var highest int64
	err := tx.QueryRowContext(ctx, `SELECT leasehold_fence($1, $2, $3)`,
		claim.Key.AccountID, claim.Key.SessionID, claim.Token).Scan(&highest)
	if err != nil {
		if h, ok := staleHighest(err); ok {
			return 0, staleError(claim.Token, h)
		}
		return 0, err
	}
	return highest, nil
}

// sqlStateError is what PostgreSQL drivers' errors share (pgconn.PgError
// and lib/pq's Error both have SQLState; DETAIL differs, so it is read
// from the error's fields where the driver has them).
type sqlStateError interface{ SQLState() string }

var detailPattern = regexp.MustCompile(`highest token seen is (\d+)`)

func staleHighest(err error) (int64, bool) {
	var se sqlStateError
	if !errors.As(err, &se) || se.SQLState() != StaleTokenSQLState {
		return 0, false
	}
	// The message names the highest token as DETAIL does, whatever the driver.
	m := detailPattern.FindStringSubmatch(err.Error())
	if m == nil {
		return 0, true
	}
	h, _ := strconv.ParseInt(m[1], 10, 64)
	return h, true
}

// staleError is the refusal the guarded store sends: ABORTED with ErrorInfo
// STALE_FENCING_TOKEN, presented_token and highest_token.
func staleError(presented, highest int64) error {
	st := status.New(codes.Aborted, fmt.Sprintf("fencing token %d is stale: the highest token seen for this session is %d", presented, highest))
	st, _ = st.WithDetails(&errdetails.ErrorInfo{
		Reason: leasehold.ReasonStaleFencingToken,
		Domain: leasehold.ErrorDomain,
		Metadata: map[string]string{
			"presented_token": strconv.FormatInt(presented, 10),
			"highest_token":   strconv.FormatInt(highest, 10),
		},
	})
	return st.Err()
}

// Write runs write in one transaction of db after the fence check of
// claim: both commit, or neither. It returns the highest token seen.
func Write(ctx context.Context, db *sql.DB, claim Claim, write func(tx *sql.Tx) error) (int64, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	highest, err := Check(ctx, tx, claim)
	if err != nil {
		return 0, err
	}
	if err := write(tx); err != nil {
		return 0, err
	}
	return highest, tx.Commit()
}

type callKey struct{}

// Call is what a fenced handler finds with CallFrom: the claim, the highest
// token seen once it passed, and the transaction holding the session's
// fence row lock. Write on Tx: it commits when the handler returns without
// error and rolls back otherwise.
type Call struct {
	Claim   Claim
	Highest int64
	Tx      *sql.Tx
}

// CallFrom returns the fenced call of a handler's context, or nil.
func CallFrom(ctx context.Context) *Call {
	c, _ := ctx.Value(callKey{}).(*Call)
	return c
}

// LiveCheck asks the lease server whether a token is the session's valid
// lease's (live mode, DESIGN §5), before the transaction opens.
type LiveCheck func(ctx context.Context, key leasehold.SessionKey, token int64) error

// Live is a LiveCheck over a lease client's CheckFence: a token below the
// highest granted is stale (ABORTED), one that is the newest grant but no
// longer valid is FAILED_PRECONDITION LEASE_NOT_HELD, as the guarded store answers.
func Live(client *leasehold.Client) LiveCheck {
	return func(ctx context.Context, key leasehold.SessionKey, token int64) error {
		current, highest, err := client.CheckFence(ctx, key, token)
		if err != nil {
			return unconfirmed(err)
		}
		if current {
			return nil
		}
		if highest > token {
			return staleError(token, highest)
		}
		cause := "not_found"
		if highest == token {
			cause = "expired"
		}
		return notHeld("the fencing token's lease is not held ("+cause+")", cause)
	}
}

// unconfirmed is the answer when the lease server could not answer
// CheckFence: whatever it said (its UNAUTHENTICATED between the two servers
// too), the token could not be confirmed, and the caller may retry.
func unconfirmed(err error) error {
	return status.Errorf(codes.Unavailable, "the lease server could not confirm the fencing token: %v", err)
}

func notHeld(msg, cause string) error {
	st := status.New(codes.FailedPrecondition, msg)
	st, _ = st.WithDetails(&errdetails.ErrorInfo{Reason: leasehold.ReasonLeaseNotHeld, Domain: leasehold.ErrorDomain, Metadata: map[string]string{"cause": cause}})
	return st.Err()
}

// FenceChecker is what the grant check needs of the lease server:
// *leasehold.Client's CheckFence.
type FenceChecker interface {
	CheckFence(ctx context.Context, key leasehold.SessionKey, token int64) (current bool, highest int64, err error)
}

// DefaultLeaseTimeout bounds each CheckFence of the grant check when
// Options.LeaseTimeout is zero, as the guarded store's LEASEHOLD_LEASE_TIMEOUT.
const DefaultLeaseTimeout = 2 * time.Second

// GrantCheck is the grant check alone: nil when token is the newest token
// the lease server granted for key (valid lease or not). One above every
// grant was never granted (FAILED_PRECONDITION LEASE_NOT_HELD not_found),
// one below the newest grant belongs to a replaced run (ABORTED
// STALE_FENCING_TOKEN with the lease server's highest); UNAVAILABLE when
// the lease server cannot answer. The interceptor asks it only for a token
// above the highest the resource has seen (HighestSeen).
func GrantCheck(ctx context.Context, leases FenceChecker, key leasehold.SessionKey, token int64) error {
	_, highest, err := leases.CheckFence(ctx, key, token)
	switch {
	case err != nil:
		return unconfirmed(err)
	case highest == token:
		return nil
	case highest > token:
		return staleError(token, highest)
	}
	return notHeld(fmt.Sprintf("lease not held: fencing token %d was never granted for this session (the newest grant is %d)", token, highest), "not_found")
}

// HighestSeen is the highest token the resource behind db has seen for key
// (0 when none): a plain read, no lock, no transaction.
func HighestSeen(ctx context.Context, db *sql.DB, key leasehold.SessionKey) (int64, error) {
	var highest int64
	err := db.QueryRowContext(ctx, `SELECT highest_token FROM leasehold_fences WHERE account_id = $1 AND session_id = $2`,
		key.AccountID, key.SessionID).Scan(&highest)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return highest, err
}

// Options of UnaryServerInterceptor.
type Options struct {
	// Fenced says which methods need a token (full method names); default all.
	Fenced func(fullMethod string) bool
	// Leases is the lease server (a *leasehold.Client, whose token needs the
	// fence scope for sessions of other accounts). Given, the grant check is
	// on: a call whose token is above the highest this resource has seen
	// for the session is first confirmed with CheckFence (GrantCheck), and
	// is UNAVAILABLE, writing nothing, while the lease server cannot answer;
	// calls at or below that highest need no call and go on. Without Leases
	// (or Live) the interceptor trusts the token in the headers: whoever
	// reaches the service can raise a fence to any number.
	Leases FenceChecker
	// LeaseTimeout bounds each CheckFence of the grant check; zero means
	// DefaultLeaseTimeout.
	LeaseTimeout time.Duration
	// Live, when set, also checks that the token is the valid lease's, for
	// every call; it needs no grant check (live is stricter).
	Live LiveCheck
}

var tokenPattern = regexp.MustCompile(`^\d{1,19}$`)

// ReadClaim reads and checks the three fencing headers of an incoming
// call; a missing or malformed one is INVALID_ARGUMENT naming the header.
func ReadClaim(ctx context.Context) (Claim, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	get := func(name string) (string, error) {
		v := md.Get(name)
		if len(v) == 0 || v[0] == "" {
			return "", invalid(name, "is required")
		}
		return v[0], nil
	}
	text, err := get(leasehold.FencingTokenHeader)
	if err != nil {
		return Claim{}, err
	}
	token, perr := strconv.ParseInt(text, 10, 64)
	if !tokenPattern.MatchString(text) || perr != nil {
		return Claim{}, invalid(leasehold.FencingTokenHeader, fmt.Sprintf("must be a decimal int64 fencing token, got %q", text))
	}
	if token <= 0 {
		return Claim{}, invalid(leasehold.FencingTokenHeader, fmt.Sprintf("must be a positive fencing token, got %d", token))
	}
	account, err := get(leasehold.AccountIDHeader)
	if err != nil {
		return Claim{}, err
	}
	session, err := get(leasehold.SessionIDHeader)
	if err != nil {
		return Claim{}, err
	}
	return Claim{Key: leasehold.SessionKey{AccountID: account, SessionID: session}, Token: token}, nil
}

func invalid(field, rule string) error {
	st := status.New(codes.InvalidArgument, field+" "+rule)
	st, _ = st.WithDetails(&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: field, Description: rule}}})
	return st.Err()
}

// UnaryServerInterceptor fences a Go gRPC service as the TypeScript
// interceptor of src/guarded does: it reads the fencing headers, runs the
// fence check in a transaction of db, and hands that transaction to the
// handler (CallFrom); the handler's writes commit with the check (S7), or
// not at all. A stale token is ABORTED, ErrorInfo STALE_FENCING_TOKEN with
// presented_token and highest_token, before the handler runs.
//
// Errors follow one rule with the TypeScript and Python interceptors,
// wherever they happened (the fence's begin, check and commit, or the
// handler): database trouble — a SQLSTATE of src/postgres/database-errors.ts
// (lock timeout 55P03, serialization failure, deadlock, a server shutting
// down or refusing connections, a standby, class 08) or a lost connection —
// is UNAVAILABLE with ErrorInfo DATABASE_UNAVAILABLE (sql_state), and a
// statement timeout (57014) DEADLINE_EXCEEDED: retrying may succeed. The
// fence's own database work failing after the call's context ended is
// DEADLINE_EXCEEDED or CANCELLED. A status error (the handler's
// INVALID_ARGUMENT, NOT_FOUND, …) passes unchanged, and so does any other
// error (a handler's unique violation, a bug): gRPC answers UNKNOWN, and
// retrying cannot help.
func UnaryServerInterceptor(db *sql.DB, o Options) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if o.Fenced != nil && !o.Fenced(info.FullMethod) {
			return handler(ctx, req)
		}
		claim, err := ReadClaim(ctx)
		if err != nil {
			return nil, err
		}
		// Before the transaction: no row lock is held across a network call.
		if err := o.confirm(ctx, db, claim); err != nil {
			return nil, err
		}
		return fencedCall(ctx, db, claim, req, handler)
	}
}

// confirm runs the live check, or the grant check for a token that would
// raise the session's fence (as checkWrite of src/guarded/live-check.ts).
// Sound because a fence only rises: the transaction's fence then accepts
// this token only if the fence has not passed it meanwhile, and never
// raises it past a token that was checked here.
func (o Options) confirm(ctx context.Context, db *sql.DB, claim Claim) error {
	switch {
	case o.Live != nil:
		return o.Live(ctx, claim.Key, claim.Token)
	case o.Leases == nil:
		return nil
	}
	highest, err := HighestSeen(ctx, db, claim.Key)
	if err != nil {
		return undecided(ctx, "read of the highest token", err)
	}
	if claim.Token <= highest {
		return nil
	}
	timeout := o.LeaseTimeout
	if timeout <= 0 {
		timeout = DefaultLeaseTimeout
	}
	checkCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return GrantCheck(checkCtx, o.Leases, claim.Key, claim.Token)
}

func fencedCall(ctx context.Context, db *sql.DB, claim Claim, req any, handler grpc.UnaryHandler) (any, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, undecided(ctx, "begin", err)
	}
	defer func() { _ = tx.Rollback() }()
	highest, err := Check(ctx, tx, claim)
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err // the stale token's ABORTED, a bad token's INVALID_ARGUMENT
		}
		return nil, undecided(ctx, "check", err)
	}
	resp, err := handler(context.WithValue(ctx, callKey{}, &Call{Claim: claim, Highest: highest, Tx: tx}), req)
	if err != nil {
		// The handler's answer (its INVALID_ARGUMENT, NOT_FOUND, its bug)
		// passes unchanged; only its database trouble is made retryable.
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		// The call's own deadline or cancel: answered as grpc-go answers it.
		if ctx.Err() != nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		if trouble := databaseTrouble(err); trouble != nil {
			return nil, trouble
		}
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, undecided(ctx, "commit", err)
	}
	return resp, nil
}

// undecided is the answer when the fence's database work failed at step:
// database trouble, or the call's context ended, may succeed if retried;
// any other error (leasehold_fence missing: migrations not applied, a
// deferred constraint of the handler's writes at commit) passes unchanged.
func undecided(ctx context.Context, step string, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if trouble := databaseTrouble(err); trouble != nil {
		return trouble
	}
	return fmt.Errorf("the fence's %s failed: %w", step, err)
}

// unavailableStates are the SQLSTATEs that mean "the database cannot answer
// right now", as opposed to a bug in a statement: the set of
// src/postgres/database-errors.ts.
var unavailableStates = map[string]bool{
	"55P03": true, // lock_not_available: lock_timeout (S8)
	"40001": true, // serialization_failure
	"40P01": true, // deadlock_detected
	"57P01": true, // admin_shutdown
	"57P02": true, // crash_shutdown
	"57P03": true, // cannot_connect_now
	"53300": true, // too_many_connections
	"25P03": true, // idle_in_transaction_session_timeout
	"25006": true, // read_only_sql_transaction: a standby, or a primary being demoted
}

const statementTimeoutState = "57014"

// databaseTrouble is the answer for an error of database work that may
// succeed if retried (UNAVAILABLE DATABASE_UNAVAILABLE, or
// DEADLINE_EXCEEDED for a statement timeout), or nil for a bug.
func databaseTrouble(err error) error {
	state := ""
	var se sqlStateError
	if errors.As(err, &se) {
		state = se.SQLState()
	}
	switch {
	case state == statementTimeoutState:
		return status.Errorf(codes.DeadlineExceeded, "the database statement timed out: %v", err)
	case unavailableStates[state] || strings.HasPrefix(state, "08") || lostConnection(err):
		label := state
		if label == "" {
			label = "connection"
		}
		st := status.New(codes.Unavailable, fmt.Sprintf("the database is unavailable (%s): %v", label, err))
		st, _ = st.WithDetails(&errdetails.ErrorInfo{
			Reason:   leasehold.ReasonDatabaseUnavailable,
			Domain:   leasehold.ErrorDomain,
			Metadata: map[string]string{"sql_state": state},
		})
		return st.Err()
	}
	return nil
}

// lostConnection: the connection could not be made or was lost under the
// statement (pgx's connect error, database/sql's bad or done connection, a
// network error or EOF), not the server rejecting a statement.
func lostConnection(err error) bool {
	// A context's deadline satisfies net.Error (Timeout): it is not a lost
	// connection.
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	var connect *pgconn.ConnectError
	var opErr *net.OpError
	return errors.As(err, &connect) || errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &opErr)
}
