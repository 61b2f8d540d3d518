package leasehold_test

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
	"leasehold.dev/go/internal/testenv"
)

// expiringServer is a LeaseService that ends every KeepAlive stream after
// its third renewal with what DESIGN §7 says a server sends once the
// stream's token has expired: UNAUTHENTICATED, ErrorInfo cause "expired".
// It ends streams after renewals rather than at a token's expiry, so the
// reopen can be seen token by token: it records the token each stream opened
// with. TestTokenRefreshedMidHold and TestStaticExpiredTokenLosesTheLease
// run the same stories against `leasehold serve`, which ends the stream
// itself at its token's expiry.
type expiringServer struct {
	leasev1.UnimplementedLeaseServiceServer
	// cause is the ErrorInfo cause the stream ends with ("expired" unless a
	// test asks for another).
	cause  string
	mu     sync.Mutex
	tokens []string
}

func (s *expiringServer) Acquire(_ context.Context, req *leasev1.AcquireRequest) (*leasev1.AcquireResponse, error) {
	return &leasev1.AcquireResponse{Acquired: true, Lease: &leasev1.Lease{Key: req.GetKey(), RunId: req.GetRunId(), FencingToken: 1, Remaining: req.GetTtl()}}, nil
}

func (s *expiringServer) Release(context.Context, *leasev1.ReleaseRequest) (*leasev1.ReleaseResponse, error) {
	return &leasev1.ReleaseResponse{Released: true}, nil
}

func (s *expiringServer) KeepAlive(stream grpc.BidiStreamingServer[leasev1.KeepAliveRequest, leasev1.KeepAliveResponse]) error {
	md, _ := metadata.FromIncomingContext(stream.Context())
	s.mu.Lock()
	s.tokens = append(s.tokens, strings.Join(md.Get("authorization"), ","))
	s.mu.Unlock()
	for range 3 {
		req, err := stream.Recv()
		if err != nil {
			return err
		}
		if err := stream.Send(&leasev1.KeepAliveResponse{Key: req.GetKey(), RunId: req.GetRunId(), Result: &leasev1.KeepAliveResponse_Lease{
			Lease: &leasev1.Lease{Key: req.GetKey(), RunId: req.GetRunId(), FencingToken: 1, Remaining: durationpb.New(ttl)},
		}}); err != nil {
			return err
		}
	}
	st, _ := status.New(codes.Unauthenticated, "token refused: "+s.cause).WithDetails(&errdetails.ErrorInfo{
		Reason: leasehold.ReasonUnauthenticated, Domain: leasehold.ErrorDomain, Metadata: map[string]string{"cause": s.cause},
	})
	return st.Err()
}

func (s *expiringServer) streams() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.tokens...)
}

func startExpiring(t *testing.T) (*expiringServer, string) {
	return startRefusing(t, "expired")
}

// startRefusing starts an expiringServer whose streams end UNAUTHENTICATED
// with the given cause.
func startRefusing(t *testing.T, cause string) (*expiringServer, string) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	es := &expiringServer{cause: cause}
	gs := grpc.NewServer()
	leasev1.RegisterLeaseServiceServer(gs, es)
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	return es, l.Addr().String()
}

func TestStreamEndedForAnExpiredTokenReopensWithAFreshOne(t *testing.T) {
	es, addr := startExpiring(t)
	var mu sync.Mutex
	n := 0
	c := dial(t, []string{addr}, leasehold.WithTokenFunc(func(context.Context) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		n++
		return "token-" + strings.Repeat("x", n), nil
	}))
	lease, err := c.Hold(context.Background(), freshKey(t), holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	heldAt := time.Now()
	testenv.WaitFor(t, 20*time.Second, "four streams", func() bool { return len(es.streams()) >= 4 })
	testenv.WaitFor(t, 3*ttl, "past a TTL", func() bool { return time.Since(heldAt) > ttl })
	if err := lease.Err(); err != nil {
		t.Fatalf("Err() = %v, want nil: every stream reopened with a fresh token", err)
	}
	seen := map[string]bool{}
	for _, tok := range es.streams() {
		if seen[tok] {
			t.Fatalf("stream tokens %v, want each used once", es.streams())
		}
		seen[tok] = true
	}
	if err := lease.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestStreamEndedForAnExpiredStaticTokenLosesTheLease(t *testing.T) {
	_, addr := startExpiring(t)
	c := dial(t, []string{addr}, leasehold.WithToken("static"))
	lease, err := c.Hold(context.Background(), freshKey(t), holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	waitDone(t, lease.Context(), 10*time.Second, "lease context")
	lost := lostCause(t, lease)
	if lost.Reason != leasehold.LossTokenExpired || !strings.Contains(lost.Message, "expired") || !strings.Contains(lost.Message, "static token") {
		t.Fatalf("loss %q: %s, want %q naming the expiry and the static token", lost.Reason, lost.Message, leasehold.LossTokenExpired)
	}
	if err := lease.Release(context.Background()); err == nil {
		t.Fatal("Release after the loss = nil, want the *LeaseLostError (nothing sent)")
	}
}

// Only a static token's expiry is token_expired (as in the TypeScript and
// Python clients): a stream that ends UNAUTHENTICATED for another cause
// loses the lease with renewal_failed.
func TestStreamRefusingAStaticTokenForAnotherCauseLosesTheLeaseAsRenewalFailed(t *testing.T) {
	_, addr := startRefusing(t, "bad_signature")
	c := dial(t, []string{addr}, leasehold.WithToken("static"))
	lease, err := c.Hold(context.Background(), freshKey(t), holdOptions)
	if err != nil {
		t.Fatal(err)
	}
	waitDone(t, lease.Context(), 10*time.Second, "lease context")
	lost := lostCause(t, lease)
	if lost.Reason != leasehold.LossRenewalFailed || !strings.Contains(lost.Message, "bad_signature") {
		t.Fatalf("loss %q: %s; want renewal_failed, naming the cause bad_signature", lost.Reason, lost.Message)
	}
}
