package leasehold_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	leasehold "leasehold.dev/go"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// The account every test works in; keys are fresh per test.
const account = "go-client-tests"

// shared is a lease server and store a guarded store every test may use;
// tests that stop a server or need flags of their own start their own.
var shared, store *testenv.Server

func TestMain(m *testing.M) {
	if err := testenv.Load(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var err error
	if shared, err = testenv.NewServer(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if store, err = testenv.NewGuarded(shared.Addr); err != nil {
		shared.Stop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	shared.Stop()
	store.Stop()
	os.Exit(code)
}

func freshKey(t *testing.T) leasehold.SessionKey {
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '-'
	}, t.Name())
	return leasehold.SessionKey{AccountID: account, SessionID: name + "-" + hex.EncodeToString(b[:])}
}

func token(ttl time.Duration, scopes ...string) string {
	return testenv.Token(account, ttl, scopes...)
}

// dial makes a client of addrs with a valid token, closed at cleanup.
func dial(t *testing.T, addrs []string, opts ...leasehold.Option) *leasehold.Client {
	t.Helper()
	opts = append([]leasehold.Option{leasehold.WithToken(token(time.Hour))}, opts...)
	c, err := leasehold.Dial(context.Background(), addrs, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// admin is a client with the admin scope (Revoke) and no proxy in between.
func admin(t *testing.T, s *testenv.Server) *leasehold.Client {
	return dial(t, []string{s.Addr}, leasehold.WithToken(token(time.Hour, "leasehold:admin")))
}

func guardedStore(t *testing.T, addr string, opts ...grpc.DialOption) guardedv1.GuardedStoreServiceClient {
	t.Helper()
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return guardedv1.NewGuardedStoreServiceClient(conn)
}

func bearer(ctx context.Context) context.Context {
	return leasehold.WithBearer(ctx, token(time.Hour))
}

// history is the session's audit trail, newest first.
func history(t *testing.T, c *leasehold.Client, key leasehold.SessionKey) []*leasev1.Event {
	t.Helper()
	events, _, err := c.History(context.Background(), key, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	return events
}

func countEvents(events []*leasev1.Event, typ leasev1.EventType, runID string) int {
	n := 0
	for _, e := range events {
		if e.GetType() == typ && e.GetRunId() == runID {
			n++
		}
	}
	return n
}

// lostCause asserts that the lease's Context has ended with a
// *LeaseLostError, and returns it.
func lostCause(t *testing.T, l *leasehold.Lease) *leasehold.LeaseLostError {
	t.Helper()
	var lost *leasehold.LeaseLostError
	if !errors.As(context.Cause(l.Context()), &lost) {
		t.Fatalf("context.Cause = %v, want a *LeaseLostError", context.Cause(l.Context()))
	}
	if !errors.Is(l.Err(), leasehold.ErrLeaseLost) {
		t.Fatalf("Err() = %v, want ErrLeaseLost", l.Err())
	}
	return lost
}

func waitDone(t *testing.T, ctx context.Context, within time.Duration, what string) {
	t.Helper()
	select {
	case <-ctx.Done():
	case <-time.After(within):
		t.Fatalf("%s: not done within %s, want done", what, within)
	}
}
