package leasehold_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// Each documented error, as the server sends it, matched with errors.Is
// and errors.As.
func TestDocumentedErrors(t *testing.T) {
	ctx := context.Background()
	key := freshKey(t)
	c := dial(t, []string{shared.Addr})

	t.Run("NotAcquiredError names the holder", func(t *testing.T) {
		l, err := c.Hold(ctx, key, holdOptions)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		_, err = dial(t, []string{shared.Addr}).Hold(ctx, key, holdOptions)
		var na *leasehold.NotAcquiredError
		if !errors.Is(err, leasehold.ErrNotAcquired) || !errors.As(err, &na) || na.Current.GetRunId() != l.RunID() {
			t.Fatalf("second Hold = %v, want a *NotAcquiredError naming run %s", err, l.RunID())
		}
	})
	t.Run("LeaseNotHeldError with its cause", func(t *testing.T) {
		_, err := c.Renew(ctx, freshKey(t), leasehold.NewRunID(), 0)
		var nh *leasehold.LeaseNotHeldError
		if !errors.Is(err, leasehold.ErrLeaseNotHeld) || !errors.As(err, &nh) || nh.Cause != leasehold.LossNotFound {
			t.Fatalf("Renew of a never-held session = %v, want a *LeaseNotHeldError with cause %s", err, leasehold.LossNotFound)
		}
	})
	t.Run("InvalidArgumentError names the field", func(t *testing.T) {
		_, err := c.Acquire(ctx, freshKey(t), leasehold.AcquireOptions{TTL: 2 * time.Hour})
		var ia *leasehold.InvalidArgumentError
		if !errors.Is(err, leasehold.ErrInvalidArgument) || !errors.As(err, &ia) || ia.Field != "ttl" || !strings.Contains(ia.Rule, "between") {
			t.Fatalf("Acquire with a 2h TTL = %v (%+v), want an *InvalidArgumentError on field ttl saying \"between\"", err, ia)
		}
	})
	t.Run("ResourceExhaustedError names the limit", func(t *testing.T) {
		s := testenv.StartServer(t, "--max-leases-per-account", "1")
		q := dial(t, []string{s.Addr}, leasehold.WithToken(testenv.Token("quota-account", time.Hour)))
		qkey := leasehold.SessionKey{AccountID: "quota-account", SessionID: "one"}
		l, err := q.Hold(ctx, qkey, holdOptions)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		_, err = q.Hold(ctx, leasehold.SessionKey{AccountID: "quota-account", SessionID: "two"}, holdOptions)
		var re *leasehold.ResourceExhaustedError
		if !errors.Is(err, leasehold.ErrResourceExhausted) || !errors.As(err, &re) || re.Limit != "max-leases-per-account" || re.Max != 1 {
			t.Fatalf("second Hold = %v (%+v), want a *ResourceExhaustedError with limit max-leases-per-account, max 1", err, re)
		}
	})
	t.Run("ErrUnauthenticated", func(t *testing.T) {
		bad := dial(t, []string{shared.Addr}, leasehold.WithToken("not-a-jwt"))
		if _, err := bad.Get(ctx, key); !errors.Is(err, leasehold.ErrUnauthenticated) {
			t.Fatalf("Get with a malformed token = %v, want ErrUnauthenticated", err)
		}
	})
	t.Run("ErrPermissionDenied", func(t *testing.T) {
		if _, err := c.Revoke(ctx, key, "no admin scope"); !errors.Is(err, leasehold.ErrPermissionDenied) {
			t.Fatalf("Revoke without the admin scope = %v, want ErrPermissionDenied", err)
		}
		other := leasehold.SessionKey{AccountID: "someone-else", SessionID: "s"}
		if _, err := c.Get(ctx, other); !errors.Is(err, leasehold.ErrPermissionDenied) {
			t.Fatalf("Get of another account's session = %v, want ErrPermissionDenied", err)
		}
	})
	t.Run("UnavailableError names every address tried", func(t *testing.T) {
		a, b := closedPort(t), closedPort(t)
		u := dial(t, []string{a, b})
		// Get is idempotent: each address is tried once more.
		_, err := u.Get(ctx, key)
		var ue *leasehold.UnavailableError
		if !errors.Is(err, leasehold.ErrUnavailable) || !errors.As(err, &ue) || status.Code(err) != codes.Unavailable {
			t.Fatalf("Get with every address closed = %v, want an *UnavailableError with code Unavailable", err)
		}
		var addrs []string
		for _, attempt := range ue.Tried {
			addr, what, _ := strings.Cut(attempt, ": ")
			if what == "" {
				t.Fatalf("attempt %q, want \"address: what it did\"", attempt)
			}
			addrs = append(addrs, addr)
		}
		if want := []string{a, b, a, b}; !slices.Equal(addrs, want) {
			t.Fatalf("tried %q, want the addresses %q", ue.Tried, want)
		}
		// RequestHandoff is not idempotent: each address once.
		_, _, err = u.RequestHandoff(ctx, key, "tests", "")
		if !errors.As(err, &ue) || len(ue.Tried) != 2 {
			t.Fatalf("RequestHandoff: %v, want each of the two addresses tried once", err)
		}
	})
	t.Run("LateGrantError: an answer past its own deadline is released", func(t *testing.T) {
		p := testenv.StartProxy(t, shared.Addr)
		lc := dial(t, []string{p.Addr})
		lkey := freshKey(t)
		if _, err := lc.Get(ctx, lkey); err != nil {
			t.Fatal(err)
		}
		// Answers arrive 1.3s late: past the local deadline of a 3s lease
		// with a 2s margin, well before the server's deadline, so the
		// client's release of the late grant ends it there.
		p.Delay(1300 * time.Millisecond)
		_, err := lc.Hold(ctx, lkey, leasehold.HoldOptions{TTL: 3 * time.Second, SafetyMargin: 2 * time.Second})
		var lg *leasehold.LateGrantError
		if !errors.Is(err, leasehold.ErrLateGrant) || !errors.Is(err, leasehold.ErrNotAcquired) || !errors.As(err, &lg) {
			t.Fatalf("Hold with answers 1.3s late = %v, want a *LateGrantError (also ErrNotAcquired)", err)
		}
		p.Delay(0)
		direct := dial(t, []string{shared.Addr})
		if held, err := direct.Get(ctx, lkey); err != nil || held != nil {
			t.Fatalf("Get after the late grant = %v, %v; want nil, nil (released)", held, err)
		}
		if n := countEvents(history(t, direct, lkey), leasev1.EventType_EVENT_TYPE_RELEASED, lg.Lease.GetRunId()); n != 1 {
			t.Fatalf("late grant released %d times, want 1", n)
		}
	})
	t.Run("bad options name the option", func(t *testing.T) {
		_, err := c.Hold(ctx, freshKey(t), leasehold.HoldOptions{TTL: time.Second, SafetyMargin: 2 * time.Second})
		if err == nil || !strings.Contains(err.Error(), "SafetyMargin") {
			t.Fatalf("Hold with SafetyMargin above TTL = %v, want an error naming SafetyMargin", err)
		}
		if _, err := leasehold.Dial(ctx, []string{"http://host/with/path"}); err == nil || !strings.Contains(err.Error(), "address") {
			t.Fatalf("Dial with a path = %v, want an error naming the address", err)
		}
	})
}

func closedPort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// Close releases what the client holds, ends its streams and leaves no
// goroutine behind (goleak).
func TestCloseLeavesNoGoroutine(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	c, err := leasehold.Dial(context.Background(), []string{shared.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	var leases []*leasehold.Lease
	for range 3 {
		l, err := c.Hold(context.Background(), freshKey(t), holdOptions)
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, l)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	for _, l := range leases {
		if !errors.Is(context.Cause(l.Context()), leasehold.ErrReleased) || l.Err() != nil {
			t.Fatalf("after Close: cause %v, Err() %v; want ErrReleased, nil", context.Cause(l.Context()), l.Err())
		}
	}
	if _, err := c.Hold(context.Background(), freshKey(t), holdOptions); !errors.Is(err, leasehold.ErrClosed) {
		t.Fatalf("Hold after Close = %v, want ErrClosed", err)
	}
}
