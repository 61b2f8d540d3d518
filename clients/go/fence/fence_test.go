package fence_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/fence"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
	"leasehold.dev/go/internal/testenv"
)

const account = "go-fence-tests"

func TestMain(m *testing.M) {
	if err := testenv.Load(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

// store is a GuardedStoreService fenced by its request headers alone: Put
// records the token the interceptor checked, on the interceptor's
// transaction, and never looks at the token in the message.
type store struct {
	guardedv1.UnimplementedGuardedStoreServiceServer
}

func (store) Put(ctx context.Context, req *guardedv1.PutRequest) (*guardedv1.PutResponse, error) {
	call := fence.CallFrom(ctx)
	if call == nil {
		return nil, status.Error(codes.Internal, "the fencing interceptor did not run")
	}
	_, err := call.Tx.ExecContext(ctx, `INSERT INTO go_fenced_writes (session_id, header_token, value) VALUES ($1, $2, $3)`,
		call.Claim.Key.SessionID, call.Claim.Token, string(req.GetValue()))
	if err != nil {
		return nil, err
	}
	return &guardedv1.PutResponse{HighestToken: call.Highest}, nil
}

type fixture struct {
	db      *sql.DB
	leases  *leasehold.Client
	admin   *leasehold.Client
	fenced  guardedv1.GuardedStoreServiceClient
	session string
}

// setup starts a lease server and the fenced store; live puts the store
// in live mode, checking tokens with that lease server.
func setup(t *testing.T, live bool) *fixture {
	t.Helper()
	return setupWith(t, func(f *fixture) fence.Options {
		if live {
			return fence.Options{Live: fence.Live(f.leases)}
		}
		return fence.Options{}
	})
}

// setupWith starts a lease server and the store fenced with the options
// options returns (f.leases and f.admin are set by then).
func setupWith(t *testing.T, options func(f *fixture) fence.Options) *fixture {
	t.Helper()
	db, err := sql.Open("pgx", testenv.Get().FenceDB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS go_fenced_writes (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		session_id text NOT NULL, header_token bigint NOT NULL, value text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	server := testenv.StartServer(t)
	f := &fixture{db: db}
	f.leases = dial(t, server.Addr, testenv.Token(account, time.Hour))
	f.admin = dial(t, server.Addr, testenv.Token(account, time.Hour, "leasehold:admin"))
	o := options(f)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(fence.UnaryServerInterceptor(db, o)))
	guardedv1.RegisterGuardedStoreServiceServer(gs, store{})
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(l.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(leasehold.UnaryFencingInterceptor()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	f.fenced = guardedv1.NewGuardedStoreServiceClient(conn)
	var b [6]byte
	_, _ = rand.Read(b[:])
	f.session = "fence-" + hex.EncodeToString(b[:])
	return f
}

func dial(t *testing.T, addr, token string) *leasehold.Client {
	c, err := leasehold.Dial(context.Background(), []string{addr}, leasehold.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func (f *fixture) key() leasehold.SessionKey {
	return leasehold.SessionKey{AccountID: account, SessionID: f.session}
}

func (f *fixture) put(ctx context.Context, value string) (*guardedv1.PutResponse, error) {
	return f.fenced.Put(ctx, &guardedv1.PutRequest{Name: "doc", Value: []byte(value)})
}

func (f *fixture) rows(t *testing.T) []string {
	rows, err := f.db.Query(`SELECT value || '@' || header_token FROM go_fenced_writes WHERE session_id = $1 ORDER BY id`, f.session)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var v string
		_ = rows.Scan(&v)
		out = append(out, v)
	}
	return out
}

var hold = leasehold.HoldOptions{TTL: 3 * time.Second, SafetyMargin: time.Second}

// S7 through the Go interceptors: the client's fencing headers come from
// the lease in the call's context; the server's check runs in the
// handler's transaction; a stale token is refused with the guarded store's
// details, and a call for a lost lease is never sent.
func TestFencedWritesThroughTheInterceptors(t *testing.T) {
	f := setup(t, false)
	ctx := context.Background()
	old, err := f.leases.Hold(ctx, f.key(), hold)
	if err != nil {
		t.Fatal(err)
	}
	t1 := old.FencingToken()
	if resp, err := f.put(leasehold.WithLease(ctx, old), "first"); err != nil || resp.GetHighestToken() != t1 {
		t.Fatalf("fenced write: %v %v", resp, err)
	}
	// Revoked: the old run's Context ends; its calls are no longer sent.
	if _, err := f.admin.Revoke(ctx, f.key(), "test"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-old.Context().Done():
	case <-time.After(10 * time.Second):
		t.Fatal("revoke not seen")
	}
	if _, err := f.put(leasehold.WithLease(ctx, old), "after loss"); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("a call for a lost lease: %v, want the *LeaseLostError before sending", err)
	}
	newer, err := f.leases.Hold(ctx, f.key(), hold)
	if err != nil {
		t.Fatal(err)
	}
	t2 := newer.FencingToken()
	if _, err := f.put(leasehold.WithLease(ctx, newer), "newer"); err != nil {
		t.Fatal(err)
	}
	// The old run's late write, its headers sent by hand, is refused by
	// the interceptor before the handler runs.
	late := metadataContext(ctx, old)
	_, err = f.put(late, "late")
	var stale *leasehold.StaleFencingTokenError
	if status.Code(err) != codes.Aborted || !errors.As(leasehold.FromError(err), &stale) || stale.Presented != t1 || stale.Highest != t2 {
		t.Fatalf("late write: %v, want ABORTED STALE_FENCING_TOKEN %d < %d", err, t1, t2)
	}
	want := []string{fmt.Sprintf("first@%d", t1), fmt.Sprintf("newer@%d", t2)}
	if got := f.rows(t); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("rows %v, want %v", got, want)
	}
	// No headers: INVALID_ARGUMENT naming the header.
	_, err = f.put(ctx, "unfenced")
	var ia *leasehold.InvalidArgumentError
	if !errors.As(leasehold.FromError(err), &ia) || ia.Field != leasehold.FencingTokenHeader {
		t.Fatalf("unfenced write: %v", err)
	}
	_ = newer.Release(ctx)
}

// fence.Write: the check and the write in one transaction; a stale claim
// writes nothing.
func TestFencedWriteHelper(t *testing.T) {
	f := setup(t, false)
	ctx := context.Background()
	insert := func(value string, token int64) func(tx *sql.Tx) error {
		return func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO go_fenced_writes (session_id, header_token, value) VALUES ($1, $2, $3)`, f.session, token, value)
			return err
		}
	}
	if h, err := fence.Write(ctx, f.db, fence.Claim{Key: f.key(), Token: 7}, insert("seven", 7)); err != nil || h != 7 {
		t.Fatalf("%d %v", h, err)
	}
	_, err := fence.Write(ctx, f.db, fence.Claim{Key: f.key(), Token: 5}, insert("five", 5))
	var stale *leasehold.StaleFencingTokenError
	if !errors.As(leasehold.FromError(err), &stale) || stale.Highest != 7 || stale.Presented != 5 {
		t.Fatalf("stale claim: %v", err)
	}
	if got := f.rows(t); len(got) != 1 || got[0] != "seven@7" {
		t.Fatalf("rows %v", got)
	}
}

// Live mode: a token whose lease has ended is refused even when no newer
// run has written (CheckFence before the transaction).
func TestLiveMode(t *testing.T) {
	f := setup(t, true)
	ctx := context.Background()
	l, err := f.leases.Hold(ctx, f.key(), hold)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.put(leasehold.WithLease(ctx, l), "live"); err != nil {
		t.Fatal(err)
	}
	late := metadataContext(ctx, l)
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = f.put(late, "after release")
	var nh *leasehold.LeaseNotHeldError
	if !errors.As(leasehold.FromError(err), &nh) || nh.Cause != leasehold.LossExpired {
		t.Fatalf("write after release in live mode: %v", err)
	}
}

// metadataContext sends l's headers as they were, by hand: what a run
// that did not notice its loss (a paused process) sends. FencingMetadata
// and the interceptor send nothing for an ended lease.
func metadataContext(ctx context.Context, l *leasehold.Lease) context.Context {
	return metadata.NewOutgoingContext(ctx, metadata.Pairs(
		leasehold.FencingTokenHeader, strconv.FormatInt(l.FencingToken(), 10),
		leasehold.AccountIDHeader, l.Key().AccountID,
		leasehold.SessionIDHeader, l.Key().SessionID,
	))
}

// forged sends fencing headers with a token of the sender's choosing.
func (f *fixture) forged(ctx context.Context, token int64) context.Context {
	return metadata.NewOutgoingContext(ctx, metadata.Pairs(
		leasehold.FencingTokenHeader, strconv.FormatInt(token, 10),
		leasehold.AccountIDHeader, account,
		leasehold.SessionIDHeader, f.session,
	))
}

// fence is the highest token the resource has seen for the session, -1
// when it has no fence row.
func (f *fixture) fence(t *testing.T) int64 {
	t.Helper()
	var highest int64
	err := f.db.QueryRow(`SELECT highest_token FROM leasehold_fences WHERE account_id = $1 AND session_id = $2`, account, f.session).Scan(&highest)
	if errors.Is(err, sql.ErrNoRows) {
		return -1
	}
	if err != nil {
		t.Fatal(err)
	}
	return highest
}

// S7, DESIGN §7: given the lease server (Options.Leases), the interceptor
// confirms a token that would raise the fence with CheckFence: 2^63−1, or
// any token never granted, is FAILED_PRECONDITION LEASE_NOT_HELD not_found
// and does not raise the fence; a replaced run's token the resource has
// not seen is ABORTED with the lease server's highest; the real runs'
// writes pass before and after.
func TestGrantCheckRefusesATokenNeverGranted(t *testing.T) {
	f := setupWith(t, func(f *fixture) fence.Options { return fence.Options{Leases: f.leases} })
	ctx := context.Background()
	neverGranted := func(token int64) {
		t.Helper()
		_, err := f.put(f.forged(ctx, token), "forged")
		var nh *leasehold.LeaseNotHeldError
		if status.Code(err) != codes.FailedPrecondition || !errors.As(leasehold.FromError(err), &nh) || nh.Cause != leasehold.LossNotFound {
			t.Fatalf("a write with token %d, never granted: %v; want FAILED_PRECONDITION LEASE_NOT_HELD not_found", token, err)
		}
	}
	stale := func(c context.Context, presented, highest int64) {
		t.Helper()
		_, err := f.put(c, "stale")
		var se *leasehold.StaleFencingTokenError
		if status.Code(err) != codes.Aborted || !errors.As(leasehold.FromError(err), &se) || se.Presented != presented || se.Highest != highest {
			t.Fatalf("a write with token %d: %v; want ABORTED STALE_FENCING_TOKEN below %d", presented, err, highest)
		}
	}

	// 2^63−1 before anyone wrote: refused, and no fence row appears.
	neverGranted(math.MaxInt64)
	if h := f.fence(t); h != -1 {
		t.Fatalf("the fence after the refused write: %d, want none", h)
	}
	first, err := f.leases.Hold(ctx, f.key(), hold)
	if err != nil {
		t.Fatal(err)
	}
	t1 := first.FencingToken()
	if _, err := f.put(leasehold.WithLease(ctx, first), "real 1"); err != nil {
		t.Fatal(err)
	}
	// Once the resource has seen t1: 2^63−1 and t1+1 are refused, the fence
	// stays at t1, and the run writes on.
	neverGranted(math.MaxInt64)
	neverGranted(t1 + 1)
	if h := f.fence(t); h != t1 {
		t.Fatalf("the fence: %d, want %d", h, t1)
	}
	if _, err := f.put(leasehold.WithLease(ctx, first), "real 2"); err != nil {
		t.Fatal(err)
	}
	oldHeaders := metadataContext(ctx, first)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	second, err := f.leases.Hold(ctx, f.key(), hold)
	if err != nil {
		t.Fatal(err)
	}
	replaced := metadataContext(ctx, second)
	if err := second.Release(ctx); err != nil {
		t.Fatal(err)
	}
	third, err := f.leases.Hold(ctx, f.key(), hold)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = third.Release(ctx) }()
	t3 := third.FencingToken()
	stale(replaced, second.FencingToken(), t3)
	if _, err := f.put(leasehold.WithLease(ctx, third), "real 3"); err != nil {
		t.Fatal(err)
	}
	stale(oldHeaders, t1, t3)
	if h := f.fence(t); h != t3 {
		t.Fatalf("the fence: %d, want %d", h, t3)
	}
	want := []string{fmt.Sprintf("real 1@%d", t1), fmt.Sprintf("real 2@%d", t1), fmt.Sprintf("real 3@%d", t3)}
	if got := f.rows(t); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("rows %v, want %v", got, want)
	}
}

// S7: with the lease server unreachable, a write at or below the highest
// token the resource has seen needs no CheckFence and goes on; one that
// would raise the fence is UNAVAILABLE and writes nothing.
func TestGrantCheckWhileTheLeaseServerIsUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nobody := l.Addr().String()
	l.Close()
	f := setupWith(t, func(*fixture) fence.Options {
		return fence.Options{Leases: dial(t, nobody, testenv.Token(account, time.Hour)), LeaseTimeout: 2 * time.Second}
	})
	ctx := context.Background()
	if _, err := fence.Write(ctx, f.db, fence.Claim{Key: f.key(), Token: 40}, func(*sql.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := f.put(f.forged(ctx, 40), "at the fence"); err != nil {
		t.Fatalf("a write at the fence with the lease server unreachable: %v", err)
	}
	_, err = f.put(f.forged(ctx, 41), "above the fence")
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "the lease server could not confirm the fencing token") {
		t.Fatalf("a write above the fence with the lease server unreachable: %v; want UNAVAILABLE", err)
	}
	if h := f.fence(t); h != 40 {
		t.Fatalf("the fence: %d, want 40", h)
	}
	if got := f.rows(t); fmt.Sprint(got) != "[at the fence@40]" {
		t.Fatalf("rows %v", got)
	}
}
