// Package testenv runs the real servers the Go client's tests talk to:
// `leasehold serve` and `leasehold guarded serve` as child processes on the
// PostgreSQL databases test/polyglot/go-client.test.ts made for the run,
// bearer tokens they accept, and a TCP proxy that can stall, cut, delay
// and swallow a connection's bytes.
package testenv

import (
	"bufio"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Secret is the HS256 secret every test server verifies tokens with.
const Secret = "leasehold-go-client-tests-hs256-secret-0123456789"

// Env is what the driver hands the tests in environment variables.
type Env struct {
	// LeaseDB is the lease servers' database; StoreDB the guarded store's;
	// FenceDB the Go fence interceptor's own (migrations/fence applied).
	LeaseDB, StoreDB, FenceDB string
	// Node runs CLI, the repository's bin/leasehold.js.
	Node, CLI string
}

var env Env

// Load reads the environment test/polyglot/go-client.test.ts sets.
func Load() error {
	vars := map[string]*string{
		"LEASEHOLD_TEST_LEASE_DATABASE_URL": &env.LeaseDB,
		"LEASEHOLD_TEST_STORE_DATABASE_URL": &env.StoreDB,
		"LEASEHOLD_TEST_FENCE_DATABASE_URL": &env.FenceDB,
		"LEASEHOLD_TEST_NODE":               &env.Node,
		"LEASEHOLD_TEST_CLI":                &env.CLI,
	}
	var missing []string
	for name, field := range vars {
		*field = os.Getenv(name)
		if *field == "" {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s not set: these tests run against real servers and PostgreSQL, which `npm run test:polyglot` (test/polyglot/go-client.test.ts) starts", strings.Join(missing, ", "))
	}
	return nil
}

// Get returns the loaded environment.
func Get() Env { return env }

// Token is a bearer token for account, valid for ttl, with the given scopes.
func Token(account string, ttl time.Duration, scopes ...string) string {
	enc := base64.RawURLEncoding
	header := enc.EncodeToString([]byte(`{"alg":"HS256","typ":"JWT"}`))
	claims := map[string]any{"sub": account, "iat": time.Now().Unix(), "exp": time.Now().Add(ttl).Unix()}
	if len(scopes) > 0 {
		claims["scope"] = strings.Join(scopes, " ")
	}
	body, _ := json.Marshal(claims)
	payload := enc.EncodeToString(body)
	mac := hmac.New(sha256.New, []byte(Secret))
	mac.Write([]byte(header + "." + payload))
	return header + "." + payload + "." + enc.EncodeToString(mac.Sum(nil))
}

// Server is a leasehold server process.
type Server struct {
	// Addr is host:port.
	Addr string
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	log  strings.Builder
}

var servingOn = regexp.MustCompile(`serving on https?://(\S+)`)

func start(argv []string, extraEnv ...string) (*Server, error) {
	cmd := exec.Command(env.Node, append([]string{env.CLI}, argv...)...)
	cmd.Env = append(os.Environ(), "LEASEHOLD_JWT_SECRET="+Secret, "LEASEHOLD_LOG_LEVEL=warn")
	cmd.Env = append(cmd.Env, extraEnv...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	// The JSON log (pino) goes to stdout: kept with stderr in Log.
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %v: %w", argv, err)
	}
	s := &Server{cmd: cmd, done: make(chan struct{})}
	addr := make(chan string, 1)
	logged := make(chan struct{})
	go func() {
		defer close(logged)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			s.mu.Lock()
			s.log.WriteString(sc.Text() + "\n")
			s.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			s.mu.Lock()
			s.log.WriteString(line + "\n")
			s.mu.Unlock()
			if m := servingOn.FindStringSubmatch(line); m != nil {
				select {
				case addr <- strings.TrimSuffix(m[1], "/"):
				default:
				}
			}
		}
		<-logged // Wait closes the pipes: every read of them first
		_ = cmd.Wait()
		close(s.done)
	}()
	select {
	case s.Addr = <-addr:
		return s, nil
	case <-s.done:
		return nil, fmt.Errorf("%v exited before serving:\n%s", argv, s.Log())
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-s.done
		return nil, fmt.Errorf("%v did not serve within 60s:\n%s", argv, s.Log())
	}
}

func started(tb testing.TB, s *Server, err error) *Server {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.Stop)
	return s
}

func serverArgs(args []string) []string {
	return append([]string{"serve", "--listen", "127.0.0.1:0", "--min-ttl", "50ms", "--shutdown-grace", "1s", "--database-url", env.LeaseDB}, args...)
}

// StoreAccount is the guarded store's own account at the lease server: its
// token carries the fence scope CheckFence asks for.
const StoreAccount = "guarded-store"

// startGuarded runs `leasehold guarded serve` as a deployment does: the
// lease server's JWT secret (start sets it for every server) to verify its
// callers, --lease-url naming the lease server that confirms a write raising
// a session's fence, and its own fence-scope token for that server.
func startGuarded(leaseAddr string, args []string) (*Server, error) {
	argv := append([]string{"guarded", "serve", "--listen", "127.0.0.1:0", "--shutdown-grace", "1s", "--database-url", env.StoreDB, "--lease-url", "http://" + leaseAddr}, args...)
	return start(argv, "LEASEHOLD_LEASE_TOKEN="+Token(StoreAccount, 24*time.Hour, "leasehold:fence"))
}

// NewServer runs `leasehold serve` for a whole test binary (TestMain stops it).
func NewServer(args ...string) (*Server, error) { return start(serverArgs(args)) }

// NewGuarded runs `leasehold guarded serve` for a whole test binary, its
// fence confirmed by the lease server at leaseAddr.
func NewGuarded(leaseAddr string, args ...string) (*Server, error) {
	return startGuarded(leaseAddr, args)
}

// StartServer runs `leasehold serve` on the lease database with the test
// defaults (port 0, TTLs from 50ms) and args, stopped at the test's end.
func StartServer(tb testing.TB, args ...string) *Server {
	s, err := start(serverArgs(args))
	return started(tb, s, err)
}

// StartDebugServer is StartServer logging at debug level, so that a test
// can read in Log what the server did that no answer shows (a waiting
// Acquire queued: "acquire waiting", with its session id).
func StartDebugServer(tb testing.TB, args ...string) *Server {
	s, err := start(serverArgs(args), "LEASEHOLD_LOG_LEVEL=debug")
	return started(tb, s, err)
}

// StartGuarded runs `leasehold guarded serve` (monotonic mode) on the store
// database, its fence confirmed by the lease server at leaseAddr.
func StartGuarded(tb testing.TB, leaseAddr string, args ...string) *Server {
	s, err := startGuarded(leaseAddr, args)
	return started(tb, s, err)
}

// Log is what the server wrote on stderr and stdout (its JSON log).
func (s *Server) Log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.String()
}

// Stop ends the server gracefully (SIGTERM: streams end UNAVAILABLE) and
// waits for it to exit.
func (s *Server) Stop() {
	select {
	case <-s.done:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(15 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

// Kill ends the server at once (SIGKILL: no stream is ended, the sockets
// just close) and waits for it to exit.
func (s *Server) Kill() {
	select {
	case <-s.done:
		return
	default:
	}
	_ = s.cmd.Process.Kill()
	<-s.done
}

// Metric sums the samples of a Prometheus metric whose labels include want.
func (s *Server) Metric(tb testing.TB, name string, want map[string]string) float64 {
	tb.Helper()
	resp, err := http.Get("http://" + s.Addr + "/metrics")
	if err != nil {
		tb.Fatalf("GET /metrics = %v, want the metrics", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	total := 0.0
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, name) || strings.HasPrefix(line, "#") {
			continue
		}
		rest := line[len(name):]
		labels := ""
		if strings.HasPrefix(rest, "{") {
			end := strings.Index(rest, "}")
			labels, rest = rest[1:end], rest[end+1:]
		} else if !strings.HasPrefix(rest, " ") {
			continue
		}
		ok := true
		for k, v := range want {
			if !strings.Contains(","+labels+",", ","+k+"=\""+v+"\",") {
				ok = false
			}
		}
		if !ok {
			continue
		}
		value, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		if err == nil {
			total += value
		}
	}
	return total
}

// WaitFor polls cond every 20ms until it holds, failing the test after
// timeout with what. For conditions only observable by asking (a server's
// state, a metric), never as a sleep.
func WaitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("waited %s for %s, want it within that", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
