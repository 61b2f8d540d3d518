package testenv

import (
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy forwards TCP connections to a target. Stall holds every byte in
// both directions (a frozen route: nothing arrives, nothing says so), on
// connections open and to come; Cut closes every open connection (a cut
// stream: the peer learns at once); DropAnswers swallows what the target
// sends back; Delay holds each answer chunk for a while; DropNextRequest
// resets the connection that carries the next call before the target sees it;
// Refuse cuts every connection and closes each new one at once (an
// instance out of reach), until Admit.
type Proxy struct {
	Addr     string
	target   string
	listener net.Listener

	mu       sync.Mutex
	cond     *sync.Cond
	stalled  bool
	drop     bool
	delay    time.Duration
	conns    map[net.Conn]struct{}
	accepted int
	dropped  int
	closed   bool
	refusing bool
	wg       sync.WaitGroup

	// Requests still to drop (DropNextRequest), and how many were.
	dropRequests, droppedRequests int
}

// StartProxy listens on a free loopback port and forwards to target.
func StartProxy(tb testing.TB, target string) *Proxy {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &Proxy{Addr: l.Addr().String(), target: target, listener: l, conns: map[net.Conn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	tb.Cleanup(p.Close)
	return p
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.listener.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			in.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			in.Close()
			out.Close()
			return
		}
		p.accepted++
		if p.refusing {
			p.mu.Unlock()
			resetOnClose(in)
			in.Close()
			out.Close()
			continue
		}
		p.conns[in], p.conns[out] = struct{}{}, struct{}{}
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(in, out, false)
		go p.pipe(out, in, true)
	}
}

func (p *Proxy) pipe(from, to net.Conn, answers bool) {
	defer p.wg.Done()
	defer func() {
		from.Close()
		to.Close()
		p.mu.Lock()
		delete(p.conns, from)
		delete(p.conns, to)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32*1024)
	for {
		n, err := from.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for p.stalled && !p.closed {
				p.cond.Wait()
			}
			closed, drop, delay := p.closed, p.drop && answers, time.Duration(0)
			if answers {
				delay = p.delay
			}
			if drop {
				p.dropped += n
			}
			reset := !answers && p.dropRequests > 0 && n >= requestBytes
			if reset {
				p.dropRequests--
				p.droppedRequests++
			}
			p.mu.Unlock()
			if closed {
				return
			}
			if reset {
				// The deferred Close sends RST, not FIN: the client sees a
				// reset connection; the target never sees the call's bytes.
				resetOnClose(from)
				resetOnClose(to)
				return
			}
			if delay > 0 {
				time.Sleep(delay)
			}
			if !drop {
				if _, werr := to.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// requestBytes: HTTP/2 frames a client sends on its own (PING 17 bytes,
// WINDOW_UPDATE 13, SETTINGS ack 9) are shorter; a call's HEADERS and DATA
// are longer (as in the Python client's test proxy).
const requestBytes = 64

func resetOnClose(c net.Conn) {
	if tcp, ok := c.(*net.TCPConn); ok {
		_ = tcp.SetLinger(0)
	}
}

// DropNextRequest makes the next chunk a client sends that is long enough
// to be a call (not a ping or a window update) reset its connection,
// both ways, instead of reaching the target: the client sees the reset,
// the server never sees the call.
func (p *Proxy) DropNextRequest() {
	p.mu.Lock()
	p.dropRequests = 1
	p.mu.Unlock()
}

// DroppedRequests is how many requests DropNextRequest has dropped.
func (p *Proxy) DroppedRequests() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.droppedRequests
}

// Stall holds every byte from now on, until Resume.
func (p *Proxy) Stall() {
	p.mu.Lock()
	p.stalled = true
	p.mu.Unlock()
}

// Resume lets bytes through again.
func (p *Proxy) Resume() {
	p.mu.Lock()
	p.stalled = false
	p.cond.Broadcast()
	p.mu.Unlock()
}

// DropAnswers swallows (or, with false, forwards again) what the target sends.
func (p *Proxy) DropAnswers(drop bool) {
	p.mu.Lock()
	p.drop = drop
	p.mu.Unlock()
}

// Delay holds each chunk the target sends for d before forwarding it.
func (p *Proxy) Delay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// Dropped is how many answer bytes were swallowed.
func (p *Proxy) Dropped() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropped
}

// Accepted is how many connections the proxy has taken.
func (p *Proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// Cut closes every open connection; new ones are still accepted.
func (p *Proxy) Cut() {
	p.mu.Lock()
	conns := make([]net.Conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// Refuse cuts every open connection and, until Admit, closes every new one
// as soon as it is accepted (counted in Accepted): the client's calls and
// streams through the proxy fail at once.
func (p *Proxy) Refuse() {
	p.mu.Lock()
	p.refusing = true
	p.mu.Unlock()
	p.Cut()
}

// Admit forwards new connections again after Refuse.
func (p *Proxy) Admit() {
	p.mu.Lock()
	p.refusing = false
	p.mu.Unlock()
}

// Close stops the proxy and its connections and waits for its goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.cond.Broadcast()
	p.mu.Unlock()
	p.listener.Close()
	p.Cut()
	p.wg.Wait()
}
