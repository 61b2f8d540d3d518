package leasehold

import (
	"slices"
	"sync"
	"time"
)

// fakeClock is a clock that moves only when a test says (Advance, Set).
// Its timers run their functions on the goroutine that moves it, in time
// order, so a test knows everything due has run when Advance returns.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
	// afterFuncs counts AfterFunc calls: how many timers were armed.
	afterFuncs int
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
}

type fakeTimer struct {
	clock  *fakeClock
	at     time.Time
	f      func()
	period time.Duration // a ticker's
	ch     chan time.Time
	active bool
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.afterFuncs++
	t := &fakeTimer{clock: c, at: c.now.Add(d), f: f, active: true}
	c.timers = append(c.timers, t)
	return t
}

func (c *fakeClock) NewTicker(d time.Duration) ticker {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clock: c, at: c.now.Add(d), period: d, ch: make(chan time.Time, 1), active: true}
	c.timers = append(c.timers, t)
	return fakeTicker{t}
}

// Set moves the clock to at without running what is due: the instant
// between a deadline passing and its timer firing.
func (c *fakeClock) Set(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = at
}

// Advance moves the clock by d, running every timer due on the way in
// time order, the clock standing at each one's instant while it runs.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	end := c.now.Add(d)
	for {
		next := c.nextDueLocked(end)
		if next == nil {
			break
		}
		c.now = later(c.now, next.at)
		if next.period > 0 {
			next.at = next.at.Add(next.period)
			select {
			case next.ch <- c.now:
			default:
			}
			continue
		}
		next.active = false
		c.mu.Unlock()
		next.f()
		c.mu.Lock()
	}
	c.now = later(c.now, end)
	c.mu.Unlock()
}

// pending is when the armed timers (not tickers) are due, in time order.
func (c *fakeClock) pending() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	var at []time.Time
	for _, t := range c.timers {
		if t.active && t.period == 0 {
			at = append(at, t.at)
		}
	}
	slices.SortFunc(at, time.Time.Compare)
	return at
}

func (c *fakeClock) nextDueLocked(end time.Time) *fakeTimer {
	var next *fakeTimer
	for _, t := range c.timers {
		if t.active && !t.at.After(end) && (next == nil || t.at.Before(next.at)) {
			next = t
		}
	}
	return next
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	was := t.active
	t.at, t.active = t.clock.now.Add(d), true
	return was
}

func (t *fakeTimer) Stop() bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	was := t.active
	t.active = false
	return was
}

// fakeTicker is a fakeTimer with a period, delivering on its channel.
type fakeTicker struct{ *fakeTimer }

func (t fakeTicker) C() <-chan time.Time { return t.ch }

func (t fakeTicker) Stop() { t.fakeTimer.Stop() }
