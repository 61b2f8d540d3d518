package leasehold_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	leasehold "leasehold.dev/go"
)

// The examples run against the tests' lease server (TestMain starts it):
// shared.Addr stands for your instances' addresses, token(…) for your
// bearer token. Each uses a session of its own.

// Hold takes a session's lease and keeps it alive until Release; a second
// holder is told who holds the session.
func ExampleClient_Hold() {
	ctx := context.Background()
	client, err := leasehold.Dial(ctx, []string{shared.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	key := leasehold.SessionKey{AccountID: account, SessionID: "example-hold-" + leasehold.NewRunID()}
	lease, err := client.Hold(ctx, key, leasehold.HoldOptions{TTL: 10 * time.Second, Holder: "desktop"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("held by", lease.Lease().GetHolder())

	// The browser tries the same session: not acquired, and told who holds it.
	_, err = client.Hold(ctx, key, leasehold.HoldOptions{TTL: 10 * time.Second, Holder: "browser"})
	var held *leasehold.NotAcquiredError
	if errors.As(err, &held) {
		fmt.Println("browser: running on", held.Current.GetHolder())
	}

	// Work under lease.Context(): it ends the moment the lease is lost.
	// Present lease.FencingToken() with every write (WithLease adds it).
	if err := lease.Release(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("after Release:", context.Cause(lease.Context()))
	// Output:
	// held by desktop
	// browser: running on desktop
	// after Release: leasehold: lease released by its run
}

// RunExclusive runs work under the lease and releases it when the work
// returns; the work's context ends the moment the lease is lost, here by
// an administrator's Revoke.
func ExampleClient_RunExclusive() {
	ctx := context.Background()
	client, err := leasehold.Dial(ctx, []string{shared.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	adminClient, err := leasehold.Dial(ctx, []string{shared.Addr}, leasehold.WithToken(token(time.Hour, "leasehold:admin")))
	if err != nil {
		log.Fatal(err)
	}
	defer adminClient.Close()

	key := leasehold.SessionKey{AccountID: account, SessionID: "example-run-exclusive-" + leasehold.NewRunID()}
	o := leasehold.HoldOptions{TTL: 10 * time.Second, Holder: "worker-3"}
	err = client.RunExclusive(ctx, key, o, func(ctx context.Context, lease *leasehold.Lease) error {
		fmt.Println("working as", lease.Lease().GetHolder())
		return nil
	})
	fmt.Println("done:", err)

	err = client.RunExclusive(ctx, key, o, func(work context.Context, lease *leasehold.Lease) error {
		// The administrator's call has a context of its own: the work's
		// ends with the loss this Revoke causes, which may arrive before
		// the Revoke's own answer.
		if _, err := adminClient.Revoke(ctx, key, "maintenance"); err != nil {
			return err
		}
		<-work.Done()
		return context.Cause(work)
	})
	var lost *leasehold.LeaseLostError
	if errors.As(err, &lost) {
		fmt.Println("lost:", lost.Reason)
	}
	fmt.Println(err)
	// Output:
	// working as worker-3
	// done: <nil>
	// lost: revoked
	// leasehold: lease lost: the server reports the lease lost (revoked)
}

// NewKeeper opens one keeper: every lease held on it is kept by its one
// heartbeat, ends with it if it is lost, and is released by its Close.
func ExampleClient_NewKeeper() {
	ctx := context.Background()
	client, err := leasehold.Dial(ctx, []string{shared.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	keeper, err := client.NewKeeper(ctx, account, leasehold.WithKeeperTTL(10*time.Second), leasehold.WithKeeperHolder("worker-7"))
	if err != nil {
		log.Fatal(err)
	}
	var leases []*leasehold.Lease
	for _, name := range []string{"a", "b", "c"} {
		key := leasehold.SessionKey{AccountID: account, SessionID: "example-keeper-" + name + "-" + leasehold.NewRunID()}
		lease, err := keeper.Hold(ctx, key)
		if err != nil {
			log.Fatal(err)
		}
		leases = append(leases, lease)
	}
	for _, lease := range leases {
		fmt.Println("held by", lease.Lease().GetHolder(), "on the keeper:", lease.Lease().GetKeeperId() == keeper.ID())
	}

	// Work under lease.Context(): it ends the moment the lease or its
	// keeper is lost (select on keeper.Done() for the keeper alone).
	if err := keeper.Close(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("keeper:", context.Cause(keeper.Context()))
	fmt.Println("a lease:", context.Cause(leases[0].Context()))
	current, err := client.Get(ctx, leases[0].Key())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("held after Close:", current != nil)
	// Output:
	// held by worker-7 on the keeper: true
	// held by worker-7 on the keeper: true
	// held by worker-7 on the keeper: true
	// keeper: leasehold: keeper closed by its process
	// a lease: leasehold: lease released by its run
	// held after Close: false
}

// Campaign waits until this candidate leads an election (a session key of
// the account), then hands it a term: the grant's fencing token, and a
// Context that ends before the database deadline when leadership is lost.
// A second candidate is granted the moment the first resigns, with a
// higher term.
func ExampleClient_Campaign() {
	ctx := context.Background()
	client, err := leasehold.Dial(ctx, []string{shared.Addr}, leasehold.WithToken(token(time.Hour)))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	election := leasehold.SessionKey{AccountID: account, SessionID: "example-scheduler-" + leasehold.NewRunID()}
	o := leasehold.CampaignOptions{
		TTL: 10 * time.Second,
		// Called exactly once per term, whatever ended it.
		OnStoppedLeading: func(term int64, why leasehold.StopReason) { fmt.Println("stopped leading:", why.Kind) },
	}
	first, err := client.Campaign(ctx, election, "replica-1", o)
	if err != nil {
		log.Fatal(err)
	}
	// Lead under first.Context(); present first.Term() to fences
	// (leasehold.WithLease(ctx, first.Lease()) with the interceptors).
	if err := first.Proclaim(ctx, "replica-1, v2"); err != nil {
		log.Fatal(err)
	}
	leader, err := client.Leader(ctx, election)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("leader:", leader.Value, "same term:", leader.Term == first.Term())

	next := make(chan *leasehold.Leadership)
	go func() {
		second, err := client.Campaign(ctx, election, "replica-2", leasehold.CampaignOptions{TTL: 10 * time.Second})
		if err != nil {
			log.Fatal(err)
		}
		next <- second
	}()
	// The second candidate waits in line (or, arriving after the
	// resignation, is granted at once).
	if err := first.Resign(ctx); err != nil {
		log.Fatal(err)
	}
	second := <-next
	fmt.Println("next leader:", second.Value(), "higher term:", second.Term() > first.Term())
	if err := second.Resign(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// leader: replica-1, v2 same term: true
	// stopped leading: resigned
	// next leader: replica-2 higher term: true
}
