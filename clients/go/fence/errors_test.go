package fence_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/fence"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
	"leasehold.dev/go/internal/testenv"
)

// answering is a fenced service whose Put answers what its request names:
// its own status errors, or the error of its own statement on the fence's
// transaction (a bug, or a row held by another transaction).
type answering struct {
	guardedv1.UnimplementedGuardedStoreServiceServer
}

var invalidName = func() error {
	st := status.New(codes.InvalidArgument, "name must not be empty")
	st, _ = st.WithDetails(&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "name", Description: "must not be empty"}}})
	return st.Err()
}()

func (answering) Put(ctx context.Context, req *guardedv1.PutRequest) (*guardedv1.PutResponse, error) {
	call := fence.CallFrom(ctx)
	if call == nil {
		return nil, status.Error(codes.Internal, "the fencing interceptor did not run")
	}
	switch string(req.GetValue()) {
	case "invalid":
		return nil, invalidName
	case "missing":
		return nil, status.Errorf(codes.NotFound, "document %q not found", req.GetName())
	case "bad statement":
		// A bug of the handler's, not the fence database failing.
		_, err := call.Tx.ExecContext(ctx, `SELECT no_such_column FROM leasehold_fences`)
		return nil, err
	case "duplicate":
		// A bug of the handler's: the same name twice (23505).
		for range 2 {
			if _, err := call.Tx.ExecContext(ctx, `INSERT INTO go_fence_names VALUES ($1)`, req.GetName()); err != nil {
				return nil, err
			}
		}
	case "locked row":
		// Database trouble: a row another transaction holds, until lock_timeout.
		if _, err := call.Tx.ExecContext(ctx, `UPDATE go_fence_rows SET n = n + 1 WHERE id = 1`); err != nil {
			return nil, err
		}
	case "slow":
		// A statement far longer than the statement_timeout set before it.
		if _, err := call.Tx.ExecContext(ctx, `SET LOCAL statement_timeout = '100ms'`); err != nil {
			return nil, err
		}
		if _, err := call.Tx.ExecContext(ctx, `SELECT pg_sleep(30)`); err != nil {
			return nil, err
		}
	case "terminated":
		// The server ends the handler's connection under it.
		if _, err := call.Tx.ExecContext(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`); err != nil {
			return nil, err
		}
	}
	return &guardedv1.PutResponse{HighestToken: call.Highest}, nil
}

// serveAnswering runs answering behind the fence interceptor on db.
func serveAnswering(t *testing.T, db *sql.DB) guardedv1.GuardedStoreServiceClient {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(fence.UnaryServerInterceptor(db, fence.Options{})))
	guardedv1.RegisterGuardedStoreServiceServer(gs, answering{})
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return guardedv1.NewGuardedStoreServiceClient(conn)
}

func openFenceDB(t *testing.T, params string) *sql.DB {
	t.Helper()
	url := testenv.Get().FenceDB
	if params != "" {
		sep := "?"
		if strings.Contains(url, "?") {
			sep = "&"
		}
		url += sep + params
	}
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// S7, S8 and the error table, one rule with the TypeScript and Python
// interceptors: the handler's own status error reaches the caller unchanged
// (code, message, details), and so does its bug (a bad statement, a unique
// violation: not UNAVAILABLE, retrying cannot help); database trouble (a
// lock timeout) is UNAVAILABLE DATABASE_UNAVAILABLE wherever it happened,
// in the fence check or in the handler's statement; a stale token stays
// ABORTED STALE_FENCING_TOKEN.
func TestInterceptorKeepsTheHandlersErrors(t *testing.T) {
	// lock_timeout: a fence row held by another transaction fails the
	// check quickly (S8), as the database failing to decide.
	db := openFenceDB(t, "lock_timeout=300")
	for _, stmt := range []string{
		`CREATE TABLE IF NOT EXISTS go_fence_names (name text PRIMARY KEY)`,
		`CREATE TABLE IF NOT EXISTS go_fence_rows (id int PRIMARY KEY, n int NOT NULL)`,
		`INSERT INTO go_fence_rows VALUES (1, 0) ON CONFLICT DO NOTHING`,
	} {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	client := serveAnswering(t, db)
	var b [6]byte
	_, _ = rand.Read(b[:])
	key := leasehold.SessionKey{AccountID: account, SessionID: "answers-" + hex.EncodeToString(b[:])}
	put := func(token int64, value string) error {
		ctx := metadata.NewOutgoingContext(context.Background(), metadata.Pairs(
			leasehold.FencingTokenHeader, strconv.FormatInt(token, 10),
			leasehold.AccountIDHeader, key.AccountID,
			leasehold.SessionIDHeader, key.SessionID,
		))
		_, err := client.Put(ctx, &guardedv1.PutRequest{Name: key.SessionID, Value: []byte(value)})
		return err
	}

	if err := put(5, "ok"); err != nil {
		t.Fatalf("a fenced write: %v", err)
	}

	t.Run("the handler's INVALID_ARGUMENT, unchanged", func(t *testing.T) {
		got := status.Convert(put(5, "invalid"))
		want := status.Convert(invalidName)
		if got.Code() != codes.InvalidArgument || got.Message() != want.Message() || len(got.Details()) != 1 || !proto.Equal(got.Proto(), want.Proto()) {
			t.Fatalf("got %v %q %v, want the handler's %v %q %v", got.Code(), got.Message(), got.Details(), want.Code(), want.Message(), want.Details())
		}
		var ia *leasehold.InvalidArgumentError
		if !errors.As(leasehold.FromError(got.Err()), &ia) || ia.Field != "name" {
			t.Fatalf("FromError: %v, want an *InvalidArgumentError naming name", leasehold.FromError(got.Err()))
		}
	})

	t.Run("the handler's NOT_FOUND, unchanged", func(t *testing.T) {
		got := status.Convert(put(5, "missing"))
		if got.Code() != codes.NotFound || got.Message() != fmt.Sprintf("document %q not found", key.SessionID) {
			t.Fatalf("got %v %q, want NOT_FOUND from the handler", got.Code(), got.Message())
		}
	})

	t.Run("the handler's own failure is not UNAVAILABLE", func(t *testing.T) {
		got := status.Convert(put(5, "bad statement"))
		if got.Code() == codes.Unavailable || !strings.Contains(got.Message(), "no_such_column") {
			t.Fatalf("got %v %q, want the handler's error (UNKNOWN), not UNAVAILABLE", got.Code(), got.Message())
		}
	})

	t.Run("the handler's unique violation is not UNAVAILABLE", func(t *testing.T) {
		got := status.Convert(put(5, "duplicate"))
		if got.Code() != codes.Unknown || !strings.Contains(got.Message(), "23505") {
			t.Fatalf("got %v %q, want the handler's unique violation (UNKNOWN), not UNAVAILABLE", got.Code(), got.Message())
		}
	})

	t.Run("the handler's statement hitting lock_timeout is UNAVAILABLE", func(t *testing.T) {
		// S8: a row the handler updates, held by an uncommitted transaction.
		holder := openFenceDB(t, "")
		tx, err := holder.Begin()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.Exec(`SELECT n FROM go_fence_rows WHERE id = 1 FOR UPDATE`); err != nil {
			t.Fatal(err)
		}
		err = put(5, "locked row")
		assertDatabaseUnavailable(t, err, "55P03")
		_ = tx.Rollback()
		if err := put(5, "locked row"); err != nil {
			t.Fatalf("once the row is free: %v", err)
		}
	})

	t.Run("the handler's statement past statement_timeout is DEADLINE_EXCEEDED", func(t *testing.T) {
		got := status.Convert(put(5, "slow"))
		if got.Code() != codes.DeadlineExceeded || !strings.Contains(got.Message(), "57014") {
			t.Fatalf("got %v %q, want DEADLINE_EXCEEDED for the statement timeout", got.Code(), got.Message())
		}
	})

	t.Run("the handler's connection ended by the server is UNAVAILABLE", func(t *testing.T) {
		got := status.Convert(put(5, "terminated"))
		if got.Code() != codes.Unavailable {
			t.Fatalf("got %v %q, want UNAVAILABLE for the lost connection", got.Code(), got.Message())
		}
		if err := put(5, "ok"); err != nil {
			t.Fatalf("the next call, on another connection: %v", err)
		}
	})

	t.Run("a stale token stays ABORTED STALE_FENCING_TOKEN", func(t *testing.T) {
		err := put(4, "ok")
		var stale *leasehold.StaleFencingTokenError
		if status.Code(err) != codes.Aborted || !errors.As(leasehold.FromError(err), &stale) || stale.Presented != 4 || stale.Highest != 5 {
			t.Fatalf("got %v, want ABORTED STALE_FENCING_TOKEN 4 < 5", err)
		}
	})

	t.Run("the fence database failing to decide is UNAVAILABLE", func(t *testing.T) {
		// S8: the session's fence row held by an uncommitted transaction:
		// the check's upsert waits on it until lock_timeout.
		holder := openFenceDB(t, "")
		tx, err := holder.Begin()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.Exec(`SELECT 1 FROM leasehold_fences WHERE account_id = $1 AND session_id = $2 FOR UPDATE`, key.AccountID, key.SessionID); err != nil {
			t.Fatal(err)
		}
		assertDatabaseUnavailable(t, put(5, "ok"), "55P03")
		_ = tx.Rollback()
		if err := put(5, "ok"); err != nil {
			t.Fatalf("once the row is free: %v", err)
		}
	})
}

// assertDatabaseUnavailable: err is UNAVAILABLE naming the lock timeout, with
// ErrorInfo DATABASE_UNAVAILABLE and sql_state, as the TypeScript interceptor answers.
func assertDatabaseUnavailable(t *testing.T, err error, sqlState string) {
	t.Helper()
	got := status.Convert(err)
	if got.Code() != codes.Unavailable || !strings.Contains(got.Message(), "lock") {
		t.Fatalf("got %v %q, want UNAVAILABLE naming the lock timeout", got.Code(), got.Message())
	}
	for _, d := range got.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == leasehold.ReasonDatabaseUnavailable &&
			info.GetDomain() == leasehold.ErrorDomain && info.GetMetadata()["sql_state"] == sqlState {
			return
		}
	}
	t.Fatalf("details %v, want ErrorInfo %s sql_state %s", got.Details(), leasehold.ReasonDatabaseUnavailable, sqlState)
}
