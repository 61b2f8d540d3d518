package leasehold_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/internal/testenv"
)

// slowServer is a server of its own whose renewal statements time out
// (statement_timeout 150ms) long before a lease's stall watch (its renewal
// interval, 500ms) would fire.
func slowServer(t *testing.T) *testenv.Server {
	return testenv.StartServer(t, "--statement-timeout", "150ms", "--lock-timeout", "30s")
}

// lockRenewals holds every write to the leases table up, through a
// connection of its own, until the returned function ends its transaction:
// each renewal statement then runs into statement_timeout.
func lockRenewals(t *testing.T) (unlock func()) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.Get().LeaseDB)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, "LOCK TABLE leases IN SHARE MODE")
	}
	if err != nil {
		_ = conn.Close(ctx)
		t.Fatal(err)
	}
	done := false
	unlock = func() {
		if done {
			return
		}
		done = true
		_ = tx.Rollback(ctx)
		_ = conn.Close(ctx)
	}
	t.Cleanup(unlock)
	return unlock
}

// undecidedLog is a slog handler that keeps the messages it gets, and the
// MsgRenewalUndecided records whole.
type undecidedLog struct {
	messages
	undecided []slog.Record
}

func (r *undecidedLog) Handle(ctx context.Context, rec slog.Record) error {
	if rec.Message == leasehold.MsgRenewalUndecided {
		r.mu.Lock()
		r.undecided = append(r.undecided, rec.Clone())
		r.mu.Unlock()
	}
	return r.messages.Handle(ctx, rec)
}

func (r *undecidedLog) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *undecidedLog) WithGroup(string) slog.Handler      { return r }

const (
	msgStreamOpening = "leasehold: keepalive stream opening"
	msgStreamFailed  = "leasehold: keepalive stream failed; reconnecting"
)

// L2: a renewal the server answers undecided (its statement timed out)
// keeps the stream (no reconnect) and the lease, whose local deadline does
// not move; a renewal once the database is back renews it. As
// test/run-exclusive.test.ts does for the TypeScript client.
func TestUndecidedRenewalKeepsStreamAndLease(t *testing.T) {
	ctx := context.Background()
	srv := slowServer(t)
	log := &undecidedLog{}
	c := dial(t, []string{srv.Addr}, leasehold.WithLogger(slog.New(log)))
	key := freshKey(t)
	lease, err := c.Hold(ctx, key, leasehold.HoldOptions{TTL: 2500 * time.Millisecond, RenewInterval: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lease.Release(ctx) }()
	unlock := lockRenewals(t)
	// Every renewal from the first undecided one on is held up by the lock;
	// two more rounds answered undecided span more than one renewal
	// interval, which the stall watch took for a stalled connection.
	testenv.WaitFor(t, 10*time.Second, "a renewal answered undecided", func() bool {
		return log.count(leasehold.MsgRenewalUndecided) >= 1
	})
	before := lease.Lease().GetExpiresAt().AsTime()
	testenv.WaitFor(t, 10*time.Second, "two more renewals answered undecided", func() bool {
		return log.count(leasehold.MsgRenewalUndecided) >= 3
	})
	during := lease.Lease().GetExpiresAt().AsTime()
	unlock()
	if lease.Err() != nil {
		t.Fatalf("the lease ended while its renewals were undecided: %v", lease.Err())
	}
	if !during.Equal(before) {
		t.Errorf("the lease's expiry moved from %s to %s on undecided renewals", before, during)
	}
	row, err := c.Get(ctx, key)
	if err != nil || row.GetRunId() != lease.RunID() {
		t.Fatalf("Get = %v, %v; want the run's lease", row, err)
	}
	if !row.GetExpiresAt().AsTime().Equal(before) {
		t.Errorf("the server's expiry %s, want %s (undecided renewals change nothing)", row.GetExpiresAt().AsTime(), before)
	}
	testenv.WaitFor(t, 10*time.Second, "a renewal once the database is back", func() bool {
		return lease.Lease().GetExpiresAt().AsTime().After(before)
	})
	log.mu.Lock()
	first := log.undecided[0]
	log.mu.Unlock()
	attrs := map[string]slog.Value{}
	first.Attrs(func(a slog.Attr) bool {
		attrs[a.Key] = a.Value
		return true
	})
	if err, _ := attrs["err"].Any().(error); status.Code(err) != codes.Unavailable {
		t.Errorf("the undecided renewal's err = %v, want UNAVAILABLE", err)
	}
	if got := attrs["sql_state"].String(); got != "57014" {
		t.Errorf("the undecided renewal's sql_state = %q, want 57014 (statement timeout)", got)
	}
	if got := attrs["run_id"].String(); got != lease.RunID() {
		t.Errorf("the undecided renewal's run_id = %q, want %q", got, lease.RunID())
	}
	if n := log.count(msgStreamOpening); n != 1 {
		t.Errorf("the KeepAlive stream opened %d times, want once (no reconnect)", n)
	}
	if n := log.count(msgStreamFailed); n != 0 {
		t.Errorf("the KeepAlive stream failed %d times, want never", n)
	}
}

// L2: a database that stays slow ends the lease at its local deadline,
// before the server-side one, on the same stream.
func TestSlowDatabaseEndsLeaseAtLocalDeadline(t *testing.T) {
	ctx := context.Background()
	srv := slowServer(t)
	log := &undecidedLog{}
	c := dial(t, []string{srv.Addr}, leasehold.WithLogger(slog.New(log)))
	key := freshKey(t)
	lease, err := c.Hold(ctx, key, leasehold.HoldOptions{TTL: 2 * time.Second, SafetyMargin: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	lockRenewals(t)
	<-lease.Context().Done()
	conn, err := pgx.Connect(ctx, testenv.Get().LeaseDB)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var leftMs float64
	if err := conn.QueryRow(ctx, `SELECT extract(epoch FROM expires_at - clock_timestamp()) * 1000
		FROM leases WHERE account_id = $1 AND session_id = $2`, key.AccountID, key.SessionID).Scan(&leftMs); err != nil {
		t.Fatal(err)
	}
	var lost *leasehold.LeaseLostError
	if !errors.As(lease.Err(), &lost) || lost.Reason != leasehold.LossDeadline {
		t.Fatalf("the lease ended with %v, want a loss at its local deadline", lease.Err())
	}
	if leftMs <= 0 {
		t.Errorf("the lease ended %.0fms after its server-side deadline, want before it", -leftMs)
	}
	if log.count(leasehold.MsgRenewalUndecided) == 0 {
		t.Error("no renewal was answered undecided")
	}
	if n := log.count(msgStreamFailed); n != 0 {
		t.Errorf("the KeepAlive stream failed %d times, want never", n)
	}
}
