package leasehold_test

import (
	"context"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	leasehold "leasehold.dev/go"
	leasev1 "leasehold.dev/go/gen/leasehold/v1"
)

type traceKey struct{}

// recorder is a LeaseService that records the headers of each Get.
type recorder struct {
	leasev1.UnimplementedLeaseServiceServer
	seen chan metadata.MD
}

func (r recorder) Get(ctx context.Context, _ *leasev1.GetRequest) (*leasev1.GetResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	r.seen <- md
	return &leasev1.GetResponse{}, nil
}

// The traceparent hook's value goes out with every call, beside the bearer
// token from the token function.
func TestTraceparentAndTokenHeaders(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rec := recorder{seen: make(chan metadata.MD, 1)}
	s := grpc.NewServer()
	leasev1.RegisterLeaseServiceServer(s, rec)
	go func() { _ = s.Serve(l) }()
	defer s.Stop()
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	// The caller's own interceptor, passed through WithDialOptions, sees
	// the call with the client's headers already set.
	var seenByCaller metadata.MD
	callers := grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		seenByCaller, _ = metadata.FromOutgoingContext(ctx)
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	c := dial(t, []string{l.Addr().String()}, leasehold.WithDialOptions(callers),
		leasehold.WithTokenFunc(func(context.Context) (string, error) { return "fresh", nil }),
		leasehold.WithTraceparent(func(ctx context.Context) string {
			v, _ := ctx.Value(traceKey{}).(string)
			return v
		}))
	if _, err := c.Get(context.WithValue(context.Background(), traceKey{}, tp), freshKey(t)); err != nil {
		t.Fatal(err)
	}
	md := <-rec.seen
	if got := md.Get("traceparent"); len(got) != 1 || got[0] != tp {
		t.Fatalf("traceparent %v, want %s", got, tp)
	}
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer fresh" {
		t.Fatalf("authorization %v, want [Bearer fresh]", got)
	}
	if got := seenByCaller.Get("traceparent"); len(got) != 1 || got[0] != tp {
		t.Fatalf("the caller's interceptor saw %v, want traceparent %s", seenByCaller, tp)
	}
}
