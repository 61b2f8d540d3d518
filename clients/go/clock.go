package leasehold

import "time"

// clock is where the lease's deadlines, renewals and the KeepAlive
// stream's stall watch and backoff read and wait on time, so that unit
// tests move it by hand (client-go's LeaderElector keeps a clock.Clock for
// the same reason). Waits bounded by a context's deadline stay on the real
// clock, which is the one a context's deadline is on.
type clock interface {
	Now() time.Time
	// AfterFunc calls f once d has passed, never before it returns: its
	// caller may hold a lock f takes (the real clock calls f on a
	// goroutine of its own, the tests' fake as it is moved).
	AfterFunc(d time.Duration, f func()) timer
	NewTicker(d time.Duration) ticker
}

// timer is the part of *time.Timer the client uses.
type timer interface {
	Reset(d time.Duration) bool
	Stop() bool
}

// ticker is a *time.Ticker behind a method, so that a fake can have one.
type ticker interface {
	C() <-chan time.Time
	Stop()
}

// realClock is the time package: the clock of every Dial.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) timer { return time.AfterFunc(d, f) }

func (realClock) NewTicker(d time.Duration) ticker { return realTicker{time.NewTicker(d)} }

type realTicker struct{ t *time.Ticker }

func (t realTicker) C() <-chan time.Time { return t.t.C }

func (t realTicker) Stop() { t.t.Stop() }
