// Command election is one replica of a service that must run on exactly
// one replica at a time (a scheduler, a cron, a compactor), built on the Go
// client (leasehold.dev/go, clients/go): it campaigns in an election, does
// the leader's work while it leads — every write fenced with the term — and
// campaigns again when its term ends. Start it three times and stop the
// leader (Ctrl-C, kill -STOP, a cut network): another one takes over, with
// a higher term, only after the old one has stopped acting.
//
//	examples/go/gen/bin/election --server 127.0.0.1:7070 --name replica-1
//
// LEASEHOLD_TOKEN is the bearer token (a JWT for the account) when the
// servers require one.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	leasehold "leasehold.dev/go"
)

func main() {
	servers := flag.String("server", "127.0.0.1:7070", "the instances' addresses, comma-separated")
	account := flag.String("account", "acme", "the account")
	election := flag.String("election", "scheduler", "the election's name (a session id of the account)")
	name := flag.String("name", fmt.Sprintf("replica-%d", os.Getpid()), "this replica's advertised value")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var opts []leasehold.Option
	if token := os.Getenv("LEASEHOLD_TOKEN"); token != "" {
		opts = append(opts, leasehold.WithToken(token))
	}
	client, err := leasehold.Dial(ctx, strings.Split(*servers, ","), opts...)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	key := leasehold.SessionKey{AccountID: *account, SessionID: *election}
	err = client.RunElection(ctx, key, *name, leasehold.ElectionOptions{
		CampaignOptions: leasehold.CampaignOptions{
			TTL:              5 * time.Second,
			OnStartedLeading: func(term int64) { fmt.Printf("%s: leading, term %d\n", *name, term) },
			// Called exactly once per term, whatever ended it; before a
			// successor can be granted, unless an operator revoked the term
			// (fences refuse the old term then).
			OnStoppedLeading: func(term int64, why leasehold.StopReason) {
				fmt.Printf("%s: stopped leading term %d (%s)\n", *name, term, why.Kind)
			},
		},
		OnNewLeader: func(l leasehold.Leader) {
			fmt.Printf("%s: the leader is %s, term %d\n", *name, l.Value, l.Term)
		},
	}, lead)
	if err != nil {
		log.Fatal(err)
	}
}

// lead is the leader's work: it runs until the term ends, and never past it.
func lead(ctx context.Context, l *leasehold.Leadership) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		// A write to a fenced resource carries the term:
		// leasehold.WithLease(ctx, l.Lease()) on a gRPC client with
		// leasehold.UnaryFencingInterceptor(), or FencingMetadata(l.Lease())
		// for the headers. Both refuse once the term is over (L2).
		md, err := leasehold.FencingMetadata(l.Lease())
		if err != nil {
			return nil // the term ended: RunElection campaigns again
		}
		fmt.Printf("%s: tick as leader, term %s\n", l.Value(), md.Get(leasehold.FencingTokenHeader)[0])
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
