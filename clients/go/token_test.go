package leasehold_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/internal/testenv"
)

// Tokens that the server accepts for about two more seconds: it allows 5s
// past `exp`, and then ends a stream opened with one with UNAUTHENTICATED
// (cause expired) by its own timer, without waiting for another message.
func shortToken() string { return token(-3 * time.Second) }

// A token function is called again when the server ends the stream for an
// expired token: the stream reopens with a fresh token and the lease is
// kept, through several expiries.
func TestTokenRefreshedMidHold(t *testing.T) {
	s := testenv.StartServer(t)
	var calls atomic.Int32
	c := dial(t, []string{s.Addr}, leasehold.WithTokenFunc(func(context.Context) (string, error) {
		calls.Add(1)
		return shortToken(), nil
	}))
	lease, err := c.Hold(context.Background(), freshKey(t), holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	heldAt := time.Now()
	// Refused streams, counted by the server as they end.
	testenv.WaitFor(t, 15*time.Second, "two streams ended for an expired token", func() bool {
		return keepAliveStreams(t, s, "unauthenticated") >= 2
	})
	testenv.WaitFor(t, 3*ttl, "a TTL past the second refusal", func() bool { return time.Since(heldAt) > 2*ttl })
	if err := lease.Err(); err != nil {
		t.Fatalf("Err() = %v, want nil: the token function gives fresh tokens", err)
	}
	if calls.Load() < 3 {
		t.Fatalf("token function called %d times, want one per stream open at least", calls.Load())
	}
	if err := lease.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A static token cannot be refreshed: once it expires, the server ends the
// stream and the lease is lost, with a reason that says so.
func TestStaticExpiredTokenLosesTheLease(t *testing.T) {
	c := dial(t, []string{shared.Addr}, leasehold.WithToken(shortToken()))
	lease, err := c.Hold(context.Background(), freshKey(t), holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	waitDone(t, lease.Context(), 15*time.Second, "lease context once the token expired")
	lost := lostCause(t, lease)
	if lost.Reason != leasehold.LossTokenExpired || !strings.Contains(lost.Message, "static token") || !strings.Contains(lost.Message, "expired") {
		t.Fatalf("loss %q: %s; want token_expired, naming the expired static token", lost.Reason, lost.Message)
	}
}
