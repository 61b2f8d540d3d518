package leasehold_test

import (
	"context"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	leasehold "leasehold.dev/go"
	"leasehold.dev/go/internal/testenv"
)

// Measured, never asserted: this process's CPU (user + system, all
// threads) per renewal and per acquire→release cycle, at a fixed load,
// beside the TypeScript client's figures (bench/client-streams.ts,
// bench/client-transport.ts). Run without -race:
//
//	LEASEHOLD_GO_TEST_FLAGS="-run ^$ -bench . -benchtime 1x" npx vitest run \
//	  --config vitest.polyglot.config.ts test/polyglot/go-client.test.ts

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// 5,000 leases on one KeepAlive stream, renewed 4,000 times a second in
// all (each every 1.25 s), over a 10 s window: CPU per answered renewal,
// the answers counted by the server.
func BenchmarkRenewalCPU(b *testing.B) {
	const leases, every, window = 5000, 1250 * time.Millisecond, 10 * time.Second
	s := testenv.StartServer(b, "--max-leases-per-stream", "5000")
	c, err := leasehold.Dial(context.Background(), []string{s.Addr}, leasehold.WithToken(testenv.Token(account, time.Hour)), leasehold.WithMaxLeasesPerStream(leases))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	o := leasehold.HoldOptions{TTL: 10 * time.Second, RenewInterval: every}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for i := range leases {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			key := leasehold.SessionKey{AccountID: account, SessionID: "bench-renew-" + leasehold.NewRunID()[:8] + "-" + strconv.Itoa(i)}
			if _, err := c.Hold(context.Background(), key, o); err != nil {
				b.Error(err)
			}
		})
	}
	wg.Wait()
	// Let the renewals spread over their interval before measuring.
	time.Sleep(2 * every)
	for b.Loop() {
		renewed0, cpu0 := s.Metric(b, "leasehold_lease_renewals_total", nil), cpuTime()
		time.Sleep(window)
		cpu, renewed := cpuTime()-cpu0, s.Metric(b, "leasehold_lease_renewals_total", nil)-renewed0
		b.ReportMetric(float64(cpu.Microseconds())/renewed, "cpu-µs/renewal")
		b.ReportMetric(renewed/window.Seconds(), "renewals/s")
	}
}

// Acquire → release cycles, 8 at a time, each a Hold (Acquire, KeepAlive
// registration) and a Release: CPU per cycle.
func BenchmarkCycleCPU(b *testing.B) {
	const cycles, parallel = 4000, 8
	c, err := leasehold.Dial(context.Background(), []string{shared.Addr}, leasehold.WithToken(testenv.Token(account, time.Hour)))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	o := leasehold.HoldOptions{TTL: 10 * time.Second}
	for b.Loop() {
		cpu0, start := cpuTime(), time.Now()
		var wg sync.WaitGroup
		for w := range parallel {
			wg.Go(func() {
				key := leasehold.SessionKey{AccountID: account, SessionID: "bench-cycle-" + strconv.Itoa(w)}
				for range cycles / parallel {
					l, err := c.Hold(context.Background(), key, o)
					if err != nil {
						b.Error(err)
						return
					}
					if err := l.Release(context.Background()); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		elapsed, cpu := time.Since(start), cpuTime()-cpu0
		b.ReportMetric(float64(cpu.Microseconds())/cycles, "cpu-µs/cycle")
		b.ReportMetric(cycles/elapsed.Seconds(), "cycles/s")
	}
}
