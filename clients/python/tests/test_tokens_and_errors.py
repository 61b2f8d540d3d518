"""Bearer tokens that expire mid-hold, and every documented error as its
class, for the blocking client (the asyncio client's are in test_async.py)."""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import pytest

from leasehold import (
    CanceledError,
    DeadlineExceededError,
    InvalidArgumentError,
    KeepAliveEvent,
    LeaseClient,
    LeaseLostError,
    LeaseNotHeldError,
    NotAcquiredError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SessionKey,
    UnauthenticatedError,
    UnavailableError,
)
from leasehold.errors import from_status
from support import Server, TcpProxy, fresh_session, lease_server, wait_for

ACCOUNT = "acct-py"
# The server accepts a token this long past its exp (src/auth/authn.ts).
SERVER_CLOCK_TOLERANCE = 5.0

Clients = Callable[..., LeaseClient]
Proxies = Callable[[str], TcpProxy]


def key(label: str) -> SessionKey:
    return SessionKey(ACCOUNT, fresh_session(label))


def exp_of(jwt: str) -> float:
    """The token's `exp` claim, as the server reads it."""
    body = jwt.split(".")[1]
    return float(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["exp"])


def expired_on_server(exp: float) -> bool:
    return time.time() > exp + SERVER_CLOCK_TOLERANCE + 0.5


def test_l2_a_token_that_expires_mid_hold_is_refreshed_and_the_lease_kept(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """L2: the token callable's tokens live one second; once the first has
    expired the stream is cut, and it reopens with a fresh token from the
    callable: the lease is kept (same run, same token)."""
    k = key("refresh")
    proxy = proxies(server.address)
    issued: list[float] = []

    def short_lived() -> str:
        issued.append(time.time() + 1)
        return token(expires_in=1)

    c = clients(proxy.address, token=short_lived)
    with c.hold(k, ttl=3.0, safety_margin=1.0) as h:
        first_exp = issued[0]
        wait_for(
            "the first token to expire on the server", lambda: expired_on_server(first_exp), 15
        )
        calls = len(issued)
        proxy.cut()
        wait_for("the stream to reopen with a fresh token", lambda: len(issued) > calls)
        renewed_from = h.lease.expires_at
        wait_for("a renewal over the reopened stream", lambda: h.lease.expires_at != renewed_from)
        h.check()
        state = admin.get(k)
        assert state.lease is not None
        assert (state.lease.run_id, state.lease.fencing_token) == (h.run_id, h.fencing_token)
    assert h.released is True


def test_l2_a_static_token_that_expired_loses_the_lease_saying_why(
    server: Server, token: Callable[..., str], clients: Clients, proxies: Proxies
) -> None:
    """L2: with a static token, a stream that must reopen after the token
    expired cannot: the hold is lost at once with reason token_expired."""
    k = key("static")
    proxy = proxies(server.address)
    exp = time.time() + 1
    c = clients(proxy.address, token=token(expires_in=1))
    with c.hold(k, ttl=30.0) as h:
        wait_for("the token to expire on the server", lambda: expired_on_server(exp), 15)
        proxy.cut()
        assert h.lost.wait(10)
        assert h.loss_reason == "token_expired"
        assert h.remaining() == timedelta(0)
        assert c._keepalive.placed == {}


def test_l2_the_servers_own_expired_token_end_calls_the_token_callable_again_and_keeps_the_lease(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """L2, DESIGN §7: with no proxy and nothing cut, the server itself ends
    the KeepAlive stream with UNAUTHENTICATED (failure expired) once the
    stream's token expired; the client calls the token callable again for
    the reopened stream, and the lease is kept: renewed over the new stream,
    same run and fencing token."""
    k = key("server-end")
    issued: list[float] = []
    events: list[tuple[KeepAliveEvent, float, int]] = []

    def short_lived() -> str:
        text = token(expires_in=1)
        issued.append(exp_of(text))
        return text

    def seen(event: KeepAliveEvent) -> None:
        events.append((event, time.time(), len(issued)))

    c = clients(server.address, token=short_lived, on_event=seen)
    with c.hold(k, ttl=3.0, safety_margin=1.0) as h:
        ended, ended_at, calls = wait_for(
            "the server to end the stream for its expired token",
            lambda: next((e for e in events if e[0].type == "failed"), None),
            20,
        )
        assert isinstance(ended.error, UnauthenticatedError)
        assert ended.error.failure == "expired"
        assert ended.retry_in is not None  # reopened, not final
        # The server's expiry timer, not anything sooner: no token it saw had expired before.
        assert ended_at >= issued[0] + SERVER_CLOCK_TOLERANCE
        wait_for("the token callable to be called for the reopen", lambda: len(issued) > calls)
        wait_for(
            "the reopened stream",
            lambda: any(e.type == "open" and t > ended_at for e, t, _ in events),
        )
        renewed_from = h.lease.expires_at
        wait_for("a renewal over the reopened stream", lambda: h.lease.expires_at != renewed_from)
        h.check()
        assert h.loss_reason is None
        state = admin.get(k)
        assert state.lease is not None
        assert (state.lease.run_id, state.lease.fencing_token) == (h.run_id, h.fencing_token)
    assert h.released is True


def test_l2_a_static_token_loses_the_lease_when_the_server_ends_its_stream_at_expiry(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """L2, DESIGN §7: with a static token, the server's own UNAUTHENTICATED
    end of the stream at the token's expiry (nothing cut) loses the hold at
    once, long before its 30 s TTL, with reason token_expired and a message
    saying a static token cannot be renewed; no release is sent (DESIGN §6),
    so the server still counts the run's lease."""
    k = key("server-static")
    events: list[KeepAliveEvent] = []
    static = token(expires_in=1)
    c = clients(server.address, token=static, on_event=events.append)
    with c.hold(k, ttl=30.0) as h:
        assert h.lost.wait(20)
        assert time.time() >= exp_of(static) + SERVER_CLOCK_TOLERANCE  # ended for its expiry
        assert h.loss_reason == "token_expired"
        failed = [e for e in events if e.type == "failed"]
        assert len(failed) == 1 and failed[0].retry_in is None  # final: no reopen
        assert isinstance(failed[0].error, UnauthenticatedError)
        assert failed[0].error.failure == "expired"
        with pytest.raises(LeaseLostError) as lost:
            h.check()
        assert lost.value.loss_reason == "token_expired"
        assert "static token cannot be renewed" in str(lost.value)
    assert h.released is None
    state = admin.get(k)
    assert state.lease is not None and state.lease.run_id == h.run_id


def test_bad_input_raises_an_error_naming_what_failed(
    database_url: str,
    secret: str,
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """Every documented error as its class, each naming what failed."""
    c = clients(server.address, token=token())
    k = key("errors")

    # A wrong address: nothing listens there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    nowhere = clients([dead, dead.replace("127.0.0.1", "localhost")], token=token(), timeout=2)
    with pytest.raises(UnavailableError) as unavailable:
        nowhere.get(k)
    # Get is idempotent: each address, then each once more.
    assert [a for a, _ in unavailable.value.attempts] == nowhere.addresses * 2
    assert dead in str(unavailable.value)

    # An expired token.
    expired = clients(server.address, token=token(expires_in=-60))
    with pytest.raises(UnauthenticatedError) as unauthenticated:
        expired.get(k)
    assert unauthenticated.value.failure == "expired"

    # A TTL the server refuses, and a run id that is not a UUID.
    with pytest.raises(InvalidArgumentError) as invalid:
        c.acquire(k, ttl=timedelta(hours=2))
    assert invalid.value.field == "ttl"
    with pytest.raises(InvalidArgumentError) as bad_run:
        c.release(k, "not-a-uuid")
    assert bad_run.value.field == "run_id"

    # Renewing a lease the run does not hold.
    with pytest.raises(LeaseNotHeldError) as not_held:
        c.renew(k, "0b0b0b0b-0000-4000-8000-000000000000")
    assert not_held.value.loss_cause == "not_found"

    # Held by another run.
    held = c.acquire(k, ttl=30)
    assert held.acquired and held.lease is not None
    with pytest.raises(NotAcquiredError) as not_acquired:
        c.hold(k, ttl=3).__enter__()
    assert not_acquired.value.current is not None
    assert not_acquired.value.current.run_id == held.lease.run_id

    # Revoke without the admin scope.
    with pytest.raises(PermissionDeniedError):
        c.revoke(k, reason="not mine to revoke")

    admin.revoke(k, reason="test over")

    # A call that runs out of its deadline: the server's answers are held.
    proxy = proxies(server.address)
    slow = clients(proxy.address, token=token())
    slow.get(k)
    proxy.stall()
    with pytest.raises(DeadlineExceededError):
        slow.get(k, timeout=0.3)

    # A bound of the server, named.
    bounded = lease_server(database_url, secret, "--max-leases-per-account", "1")
    try:
        b = clients(bounded.address, token=token("acct-py-bounded"))
        assert b.acquire(SessionKey("acct-py-bounded", fresh_session("one")), ttl=30).acquired
        with pytest.raises(ResourceExhaustedError) as exhausted:
            b.acquire(SessionKey("acct-py-bounded", fresh_session("two")), ttl=30)
        assert exhausted.value.limit == "max-leases-per-account"
        assert exhausted.value.max == 1
    finally:
        bounded.stop()

    # CANCELLED as its class (no server sends it: a cancelled call's status).
    assert isinstance(from_status(grpc.StatusCode.CANCELLED, "cancelled", None), CanceledError)


def test_l2_a_server_gone_mid_hold_ends_the_hold_at_its_deadline_naming_it(
    database_url: str,
    secret: str,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
) -> None:
    """L2: the only instance stops mid-hold; the hold is lost at its local
    deadline (never reported held after it), and the reason names the
    instance and what it did."""
    k = key("gone")
    doomed = lease_server(database_url, secret)
    try:
        c = clients(doomed.address, token=token())
        with c.hold(k, ttl=2.0, safety_margin=0.5) as h:
            doomed.stop()
            assert h.lost.wait(10)
            with pytest.raises(LeaseLostError) as lost:
                h.check()
            assert lost.value.loss_reason == "deadline"
            assert doomed.address in lost.value.message
            assert h.remaining() == timedelta(0)
        assert h.released is None
    finally:
        doomed.stop()
