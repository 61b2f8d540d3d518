package leasehold

import (
	"context"
	"strconv"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// The request headers that carry a fencing claim to a guarded service
// (docs/fencing.md).
const (
	FencingTokenHeader = "leasehold-fencing-token"
	AccountIDHeader    = "leasehold-account-id"
	SessionIDHeader    = "leasehold-session-id"
)

type leaseKey struct{}

// WithLease marks ctx as made on behalf of lease: the fencing interceptors
// add its three headers to calls made with it, and refuse to send them once
// the lease has ended.
func WithLease(ctx context.Context, lease *Lease) context.Context {
	return context.WithValue(ctx, leaseKey{}, lease)
}

// LeaseFrom returns the lease WithLease put in ctx, or nil.
func LeaseFrom(ctx context.Context) *Lease {
	l, _ := ctx.Value(leaseKey{}).(*Lease)
	return l
}

// FencingMetadata is the three fencing headers of lease, for calls made
// without the interceptors. A lease that has ended has none (L2: a run
// stops presenting itself as the holder): it returns the *LeaseLostError
// once the lease is lost (also when its local deadline has passed and the
// timer has not fired yet), ErrReleased once released.
func FencingMetadata(lease *Lease) (metadata.MD, error) {
	if err := lease.check(); err != nil {
		return nil, err
	}
	return metadata.Pairs(
		FencingTokenHeader, strconv.FormatInt(lease.token, 10),
		AccountIDHeader, lease.key.AccountID,
		SessionIDHeader, lease.key.SessionID,
	), nil
}

// fenced adds the headers of ctx's lease, or says why the call must not be
// sent: a lost lease (L2: a run stops presenting itself as the holder) or
// a released one.
func fenced(ctx context.Context) (context.Context, error) {
	lease := LeaseFrom(ctx)
	if lease == nil {
		return ctx, nil
	}
	if err := lease.check(); err != nil {
		return nil, err
	}
	return metadata.AppendToOutgoingContext(ctx,
		FencingTokenHeader, strconv.FormatInt(lease.token, 10),
		AccountIDHeader, lease.key.AccountID,
		SessionIDHeader, lease.key.SessionID,
	), nil
}

// UnaryFencingInterceptor adds the fencing headers of the lease in a call's
// context (WithLease) to every unary call; calls without one pass
// untouched. A call for a lease that has ended is not sent: it fails with
// the *LeaseLostError (or ErrReleased). Give it to grpc.NewClient with
// grpc.WithChainUnaryInterceptor for the clients of guarded services.
func UnaryFencingInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		ctx, err := fenced(ctx)
		if err != nil {
			return err
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

// StreamFencingInterceptor is UnaryFencingInterceptor for streams.
func StreamFencingInterceptor() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		ctx, err := fenced(ctx)
		if err != nil {
			return nil, err
		}
		return streamer(ctx, desc, cc, method, opts...)
	}
}

// WithBearer adds a bearer token to calls made with ctx on connections the
// client did not make (a guarded store's, say).
func WithBearer(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}
