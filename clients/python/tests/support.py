"""Test support: `leasehold` servers as processes, bearer tokens, a TCP
proxy that can stall, drop or cut what passes, and waiting on conditions
with a deadline (never a guessed sleep)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import select
import socket
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[3]
CLI = ROOT / "bin" / "leasehold.js"
NODE = os.environ.get("LEASEHOLD_TEST_NODE", "node")


def require_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: run these suites with `npm run test:polyglot` "
            "(test/polyglot/python-client.test.ts gives them their databases)"
        )
    return value


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(secret: str, account: str, *, expires_in: float = 600, scope: str | None = None) -> str:
    """An HS256 JWT as the server verifies it (sub names the account)."""
    now = int(time.time())
    claims: dict[str, object] = {"sub": account, "iat": now - 60, "exp": int(now + expires_in)}
    if scope is not None:
        claims["scope"] = scope
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims).encode())
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


class Server:
    """A `leasehold` server command as its own process, on port 0.

    ``waiters``: its log is read at debug level, and every waiting Acquire it
    queues is counted per session (``waiting_acquires``), as the server's
    waiters log them ("acquire waiting")."""

    def __init__(
        self, argv: list[str], env: dict[str, str] | None = None, *, waiters: bool = False
    ) -> None:
        self.argv = argv
        self._queued: dict[tuple[str, str], int] = {}
        self._queued_lock = threading.Lock()
        self.process = subprocess.Popen(
            [NODE, str(CLI), *argv],
            cwd=ROOT,
            env={
                **os.environ,
                "LEASEHOLD_LOG_LEVEL": "debug" if waiters else "warn",
                **(env or {}),
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if waiters else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if waiters:
            threading.Thread(target=self._read_log, daemon=True).start()
        assert self.process.stderr is not None
        seen = b""
        deadline = time.monotonic() + 60
        while True:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError(f"{argv[0]} exited before serving: {seen.decode()}")
            seen += line
            m = re.search(rb"serving on https?://(\S+)", line)
            if m:
                self.address = m.group(1).decode()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not start: {seen.decode()}")
        # Keep draining stderr so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for _ in self.process.stderr:
            pass

    def _read_log(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if b"acquire waiting" not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("msg") == "acquire waiting":
                with self._queued_lock:
                    k = (str(entry.get("accountId")), str(entry.get("sessionId")))
                    self._queued[k] = self._queued.get(k, 0) + 1

    def waiting_acquires(self, account_id: str, session_id: str) -> int:
        """Waiting Acquires of the session this server has queued so far."""
        with self._queued_lock:
            return self._queued.get((account_id, session_id), 0)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def lease_server(database_url: str, secret: str, *args: str, waiters: bool = False) -> Server:
    return Server(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--min-ttl",
            "50ms",
            "--shutdown-grace",
            "1s",
            "--database-url",
            database_url,
            *args,
        ],
        {"LEASEHOLD_JWT_SECRET": secret},
        waiters=waiters,
    )


#: The guarded store's own account at the lease server.
STORE_ACCOUNT = "guarded-store"
FENCE_SCOPE = "leasehold:fence"


def guarded_server(database_url: str, secret: str, lease_address: str) -> Server:
    """The guarded store as a deployment starts it: the lease server's JWT
    secret to verify its callers, --lease-url naming the lease server that
    confirms a write raising a session's fence, and its own token for that
    server with the fence scope."""
    return Server(
        [
            "guarded",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--shutdown-grace",
            "1s",
            "--database-url",
            database_url,
            "--lease-url",
            f"http://{lease_address}",
        ],
        {
            "LEASEHOLD_JWT_SECRET": secret,
            "LEASEHOLD_LEASE_TOKEN": jwt(
                secret, STORE_ACCOUNT, expires_in=24 * 3600, scope=FENCE_SCOPE
            ),
        },
    )


class TcpProxy:
    """Forwards connections to a target; can stall them (hold every byte and
    keep the sockets open), drop them (reset, and refuse new ones), drop
    the next answer (reset the connection that carries it, after the server
    made it), or delay every answer (``answer_lag``)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.mode = "pass"
        self.accepted = 0
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        self._drop_answers = 0
        self.dropped_answers = 0
        self._drop_requests = 0
        self.dropped_requests = 0
        #: Seconds the next chunk from the server is held before it is passed on.
        self.answer_delay = 0.0
        #: Seconds every chunk from the server is held before it is passed
        #: on, in order, without holding up the chunks behind it.
        self.answer_lag = 0.0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "drop":
                self.accepted += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                self.accepted += 1
                _reset(client)
                continue
            # Counted once cut() can reach it: a test that waits for a
            # connection and then cuts must cut that one too.
            with self._lock:
                self._pairs.append((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        held: dict[socket.socket, list[bytes]] = {client: [], upstream: []}
        other = {client: upstream, upstream: client}
        live = [client, upstream]
        # Answers delayed by answer_lag: (when due, bytes), in arrival order.
        lagging: deque[tuple[float, bytes]] = deque()
        try:
            while not self._closed:
                wait = 0.05
                if lagging:
                    wait = min(wait, max(0.0, lagging[0][0] - time.monotonic()))
                readable, _, _ = select.select(live, [], [], wait)
                if self.mode == "drop":
                    break
                while lagging and lagging[0][0] <= time.monotonic() and self.mode == "pass":
                    client.sendall(lagging.popleft()[1])
                if self.mode == "pass":
                    for src, chunks in held.items():
                        while chunks:
                            other[src].sendall(chunks.pop(0))
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        if self.mode == "stall":
                            live.remove(src)  # a stalled peer notices nothing, not even a close
                            continue
                        return
                    if src is client and self._drop_requests > 0 and len(data) >= _REQUEST_BYTES:
                        self._drop_requests -= 1
                        self.dropped_requests += 1
                        return  # reset below: the request never reaches the server
                    if src is upstream and self._drop_answers > 0:
                        self._drop_answers -= 1
                        self.dropped_answers += 1
                        return  # reset below: the answer never reaches the client
                    if src is upstream and (self.answer_lag > 0 or lagging) and self.mode == "pass":
                        lagging.append((time.monotonic() + self.answer_lag, data))
                        continue
                    if self.mode == "stall" or (src is upstream and self.answer_delay > 0):
                        if src is upstream and self.answer_delay > 0 and self.mode != "stall":
                            delay, self.answer_delay = self.answer_delay, 0.0
                            time.sleep(delay)  # this answer arrives late
                            other[src].sendall(data)
                            continue
                        held[src].append(data)
                    else:
                        other[src].sendall(data)
        except (OSError, ValueError):
            pass  # a socket closed under select: the connection is gone
        finally:
            _reset(client)
            _reset(upstream)
            with self._lock:
                if (client, upstream) in self._pairs:
                    self._pairs.remove((client, upstream))

    @property
    def open(self) -> int:
        with self._lock:
            return len(self._pairs)

    def stall(self) -> None:
        self.mode = "stall"

    def pass_(self) -> None:
        self.mode = "pass"

    def drop(self) -> None:
        self.mode = "drop"

    def cut(self) -> None:
        """Resets every open connection once; new ones pass."""
        with self._lock:
            pairs = list(self._pairs)
        for client, upstream in pairs:
            _reset(client)
            _reset(upstream)

    def drop_next_answer(self) -> None:
        """The next bytes the server sends reset their connection instead."""
        self._drop_answers = 1

    def drop_next_request(self) -> None:
        """The next request the client sends (bytes enough for a call, not an
        HTTP/2 ping or window update) resets its connection instead: the
        client sees the reset, the server never sees the call."""
        self._drop_requests = 1

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()


#: HTTP/2 control frames a client sends on its own (PING 17 bytes, WINDOW_UPDATE
#: 13, SETTINGS ack 9) are shorter; a unary call's HEADERS and DATA are longer.
_REQUEST_BYTES = 64


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    except OSError:
        pass


def wait_for(what: str, predicate: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Polls ``predicate`` until it returns something other than None/False."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s")
        time.sleep(0.01)


def fresh_session(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


def keepalive_streams_ended(address: str) -> int:
    """KeepAlive streams the server has finished serving, from its /metrics
    (leasehold_rpc_duration_seconds counts a stream when it ends)."""
    import urllib.request

    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    total = 0
    for line in body.splitlines():
        m = re.match(r"leasehold_rpc_duration_seconds_count\{([^}]*)\} (\d+)", line)
        if m and re.search(r'method="[^"]*KeepAlive"', m.group(1)):
            total += int(m.group(2))
    return total


def metric(address: str, series: str) -> float:
    """One series of the server's /metrics, e.g.
    ``leasehold_lease_losses_total{reason="released"}``; 0 when absent."""
    import urllib.request

    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line[len(series) + 1 :])
    return 0.0
