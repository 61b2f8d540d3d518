package fence_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
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
	var o fence.Options
	if live {
		o.Live = fence.Live(f.leases)
	}
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
