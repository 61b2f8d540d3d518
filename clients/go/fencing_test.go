package leasehold_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"

	leasehold "leasehold.dev/go"
	guardedv1 "leasehold.dev/go/gen/leasehold/guarded/v1"
)

// L2, S7: a run presents its lease's fencing headers only while it holds
// the lease. FencingMetadata gives them for a held lease and refuses a
// lost one (the *LeaseLostError) and a released one (ErrReleased), as the
// TypeScript interceptor and Python's fencing_metadata() do; the
// interceptor sends no call for either.
func TestFencingHeadersOnlyForAHeldLease(t *testing.T) {
	ctx := context.Background()
	c := dial(t, []string{shared.Addr})
	put := guardedStore(t, store.Addr, grpc.WithChainUnaryInterceptor(leasehold.UnaryFencingInterceptor()))
	// A write the guarded store accepts from the lease's run, when sent.
	write := func(lease *leasehold.Lease) error {
		_, err := put.Put(bearer(leasehold.WithLease(ctx, lease)), &guardedv1.PutRequest{
			Key:          key2proto(lease.Key()),
			Name:         "doc",
			Value:        []byte("from run " + lease.RunID()),
			FencingToken: lease.FencingToken(),
		})
		return err
	}

	t.Run("held", func(t *testing.T) {
		key := freshKey(t)
		lease, err := c.Hold(ctx, key, holdOptions)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = lease.Release(ctx) }()
		md, err := leasehold.FencingMetadata(lease)
		if err != nil {
			t.Fatalf("FencingMetadata of a held lease: err = %v, want nil", err)
		}
		want := map[string]string{
			leasehold.FencingTokenHeader: strconv.FormatInt(lease.FencingToken(), 10),
			leasehold.AccountIDHeader:    key.AccountID,
			leasehold.SessionIDHeader:    key.SessionID,
		}
		for name, value := range want {
			if got := md.Get(name); len(got) != 1 || got[0] != value {
				t.Errorf("%s = %v, want %q", name, got, value)
			}
		}
		if err := write(lease); err != nil {
			t.Fatalf("a write through the interceptor for the held lease = %v, want nil", err)
		}
	})

	t.Run("released", func(t *testing.T) {
		lease, err := c.Hold(ctx, freshKey(t), holdOptions)
		if err != nil {
			t.Fatal(err)
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if md, err := leasehold.FencingMetadata(lease); !errors.Is(err, leasehold.ErrReleased) || md != nil {
			t.Fatalf("FencingMetadata of a released lease: %v, %v; want no headers and ErrReleased", md, err)
		}
		// The store would take it (its token is still the highest seen):
		// the interceptor does not send it.
		if err := write(lease); !errors.Is(err, leasehold.ErrReleased) {
			t.Fatalf("a write through the interceptor for the released lease: %v, want ErrReleased before sending", err)
		}
	})

	t.Run("lost", func(t *testing.T) {
		key := freshKey(t)
		lease, err := c.Hold(ctx, key, holdOptions)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := admin(t, shared).Revoke(ctx, key, "test"); err != nil {
			t.Fatal(err)
		}
		waitDone(t, lease.Context(), 10*time.Second, "the revoked lease's Context")
		md, err := leasehold.FencingMetadata(lease)
		var lost *leasehold.LeaseLostError
		if !errors.As(err, &lost) || lost.Reason != leasehold.LossRevoked || md != nil {
			t.Fatalf("FencingMetadata of a revoked lease: %v, %v; want no headers and the *LeaseLostError (revoked)", md, err)
		}
		if err := write(lease); !errors.As(err, &lost) {
			t.Fatalf("a write through the interceptor for the revoked lease: %v, want the *LeaseLostError before sending", err)
		}
	})
}
