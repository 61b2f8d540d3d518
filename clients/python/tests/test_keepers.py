"""Keepers (docs/keepers.md, K1, K2, L2) against real servers, with the
blocking client and then the asyncio client: one heartbeat for many leases,
a stalled heartbeat stopping every lease before the database deadline, a
re-attach on another instance keeping every lease, the lock-delay visible,
and which holds a revoke ends. The keeper's core on a fake clock is in
test_keeper_core.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from test_async import AsyncClients, aclients, until
from test_blocking import ACCOUNT, Clients, Proxies, events_of, key

from leasehold import (
    AsyncKeeperHold,
    HandoffRequest,
    InvalidArgumentError,
    KeeperHold,
    LeaseClient,
    LeaseLostError,
    NotAcquiredError,
)
from support import Server, lease_server, wait_for

__all__ = ["aclients"]  # the fixture, imported for this file's async tests

#: Leases on one keeper in the heartbeat test.
LEASES = 20


def assert_held_by(admin: LeaseClient, hold: KeeperHold | AsyncKeeperHold, keeper_id: str) -> None:
    """The database's view: the session is held by this hold's run, with
    its token, on the keeper."""
    state = admin.get(hold.key)
    assert state.held and state.lease is not None, hold.key
    assert state.lease.run_id == hold.run_id
    assert state.lease.fencing_token == hold.fencing_token
    assert state.lease.keeper_id == keeper_id


# Keeper: one heartbeat keeps every lease on it; close releases them all


def test_k1_one_heartbeat_keeps_every_lease_on_the_keeper_and_close_releases_them_all(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """K1: 20 leases on one keeper outlive three TTLs with no renewal of
    their own (no KeepAlive stream opened): the keeper's heartbeats, one per
    third of the TTL whatever the number of leases, keep them all. Leaving
    the keeper's block releases every one (History: RELEASED, not EXPIRED)."""
    client = clients(server.address, token=token())
    ttl = 1.5
    with client.keeper(ACCOUNT, ttl=ttl, holder="k1") as k:
        holds = [k.hold(key("k1")).__enter__() for _ in range(LEASES)]
        started, beats = time.monotonic(), k.heartbeats
        assert not k.lost.wait(3 * ttl)  # the keeper's loss, or three TTLs
        elapsed, sent = time.monotonic() - started, k.heartbeats - beats
        assert client.keepalive_streams == 0
        # At most one heartbeat per interval for all 20 leases (a timer
        # late under load sends fewer), never one per lease.
        assert 3 <= sent <= elapsed / (ttl / 3) + 3
        for h in holds:
            assert not h.lost.is_set()
            assert_held_by(admin, h, k.keeper_id)
    for h in holds:
        assert not admin.get(h.key).held
        assert events_of(admin, h.key, h.run_id) == ["ACQUIRED", "RELEASED"]
        with pytest.raises(LeaseLostError) as ended:
            h.check()
        assert ended.value.loss_reason == "released"
        h.__exit__(None, None, None)  # nothing left to release
        assert h.released is None


async def test_k1_async_one_heartbeat_keeps_every_lease_and_close_releases_them_all(
    server: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    client = aclients(server.address, token=token())
    ttl = 1.5
    async with client.keeper(ACCOUNT, ttl=ttl, holder="ak1") as k:
        holds = [await k.hold(key("ak1")).__aenter__() for _ in range(LEASES)]
        started, beats = time.monotonic(), k.heartbeats
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(k.lost.wait(), 3 * ttl)
        assert not k.lost.is_set()
        elapsed, sent = time.monotonic() - started, k.heartbeats - beats
        assert client.keepalive_streams == 0
        assert 3 <= sent <= elapsed / (ttl / 3) + 3
        for h in holds:
            assert not h.lost.is_set()
            assert_held_by(admin, h, k.keeper_id)
    for h in holds:
        assert not admin.get(h.key).held
        assert events_of(admin, h.key, h.run_id) == ["ACQUIRED", "RELEASED"]


# Keeper: a stalled heartbeat stops every lease before the database deadline

STALL_TTL = 10.0  # margin 1 s: the database's view is read inside it


def test_l2_a_stalled_heartbeat_stops_every_lease_before_the_database_deadline(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """L2, K1: every route of the keeper stalls (its re-attach stalls too);
    the keeper and its three holds are lost together, at the local deadline,
    while the database still counts every lease valid. Nothing is sent after
    the loss: the leases expire, none is released."""
    proxy = proxies(server.address)
    client = clients(proxy.address, token=token())
    with client.keeper(ACCOUNT, ttl=STALL_TTL, holder="stalled") as k:
        holds = [k.hold(key("stall")).__enter__() for _ in range(3)]
        proxy.stall()
        assert k.lost.wait(3 * STALL_TTL)
        assert all(h.lost.is_set() for h in holds)
        for h in holds:
            state = admin.get(h.key)
            assert state.held and state.lease is not None and state.lease.run_id == h.run_id
            assert state.lease.remaining.total_seconds() > 0
        assert k.loss_reason == "deadline"
        for h in holds:
            assert h.loss_reason == "deadline"
            with pytest.raises(LeaseLostError):
                h.fencing_metadata()
    assert k.close_error is None
    proxy.pass_()
    for h in holds:
        assert "RELEASED" not in events_of(admin, h.key, h.run_id)


async def test_l2_async_a_stalled_heartbeat_stops_every_lease_and_cancels_its_task(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """L2: as above with the asyncio client; the work of the keeper's
    run_exclusive is cancelled the moment the keeper is lost, and
    LeaseLostError is raised, while the database still counts it valid."""
    proxy = proxies(server.address)
    client = aclients(proxy.address, token=token())
    async with client.keeper(ACCOUNT, ttl=STALL_TTL, holder="astalled") as k:
        other = await k.hold(key("astall")).__aenter__()
        seen: list[AsyncKeeperHold] = []

        async def work(h: AsyncKeeperHold) -> None:
            seen.append(h)
            proxy.stall()
            await asyncio.Event().wait()  # until cancelled

        with pytest.raises(LeaseLostError) as lost:
            await k.run_exclusive(key("astall"), work)
        assert lost.value.loss_reason == "deadline"
        assert k.lost.is_set() and other.lost.is_set()
        for h in (other, *seen):
            state = admin.get(h.key)
            assert state.held and state.lease is not None and state.lease.run_id == h.run_id
    proxy.pass_()


# Keeper: a cut stream or a stopped instance: re-attach to the same keeper
# on another instance, every lease kept

REATTACH_TTL = 2.0


def test_k1_a_stopped_instance_reattach_on_another_keeps_every_lease(
    server: Server,
    database_url: str,
    secret: str,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
) -> None:
    """The keeper's instance stops (graceful shutdown ends its streams
    UNAVAILABLE); the keeper re-attaches to the other configured instance
    with the same id, and every lease is kept past the deadline it had when
    the instance stopped: same run, same token, not lost."""
    own = lease_server(database_url, secret)
    try:
        client = clients([own.address, server.address], token=token())
        with client.keeper(ACCOUNT, ttl=REATTACH_TTL, holder="moving") as k:
            holds = [k.hold(key("moving")).__enter__() for _ in range(3)]
            own.stop()
            assert not k.lost.wait(2 * REATTACH_TTL)
            for h in holds:
                assert not h.lost.is_set()
                assert_held_by(admin, h, k.keeper_id)
        for h in holds:
            assert events_of(admin, h.key, h.run_id) == ["ACQUIRED", "RELEASED"]
    finally:
        own.stop()


async def test_k1_async_a_cut_stream_reattaches_on_another_instance_keeping_every_lease(
    servers: list[Server],
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """Every connection to the keeper's instance is reset and refused (a
    proxy in front of it); the keeper re-attaches to the second instance,
    and every lease is kept past the deadline it had when cut."""
    proxy = proxies(servers[0].address)
    client = aclients([proxy.address, servers[1].address], token=token())
    async with client.keeper(ACCOUNT, ttl=REATTACH_TTL, holder="acut") as k:
        holds = [await k.hold(key("acut")).__aenter__() for _ in range(3)]
        proxy.drop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(k.lost.wait(), 2 * REATTACH_TTL)
        assert not k.lost.is_set()
        for h in holds:
            assert not h.lost.is_set()
            assert_held_by(admin, h, k.keeper_id)


# Keeper: lock-delay visible (a refused acquire and Get say until when)

LOCK_DELAY = 30.0


def test_k2_lock_delay_visible_to_a_keepers_refused_acquire(
    server: Server, token: Callable[..., str], clients: Clients, proxies: Proxies
) -> None:
    """K2: a keeper with a 30 s lock-delay expires (its every route stalls).
    Another keeper's hold of its key is refused for the lease until the
    database deadline, then for the lock-delay: no lease blocks it, and the
    refusal says until when (an instant ahead, on the database clock)."""
    proxy = proxies(server.address)
    client = clients(proxy.address, token=token())
    other = clients(server.address, token=token())
    k_lease = key("delay")
    with client.keeper(ACCOUNT, ttl=1.0, lock_delay=LOCK_DELAY, holder="delayed") as k:
        k.hold(k_lease).__enter__()
        proxy.stall()
        assert k.lost.wait(10)
    with other.keeper(ACCOUNT, ttl=5) as k2:
        deadline = time.monotonic() + 20
        while True:
            with pytest.raises(NotAcquiredError) as refused, k2.hold(k_lease):
                pass
            if refused.value.current is None:
                break
            assert time.monotonic() < deadline, "the keeper's lease did not expire"
    until = refused.value.lock_delay_until
    assert until is not None and until > datetime.now(UTC)
    assert "lock-delay" in refused.value.message
    proxy.pass_()


def test_k2_lock_delay_visible_to_a_refused_acquire_and_to_get(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """K2: a keeper with a 30 s lock-delay expires (its every route
    stalls). Once the database deadline has passed, Get says the session is
    not held and until when the delay runs; another run's Acquire (unary,
    and a hold) is refused with the same instant, and no lease blocks it."""
    proxy = proxies(server.address)
    client = clients(proxy.address, token=token())
    other = clients(server.address, token=token())
    k_lease = key("delay")
    with client.keeper(ACCOUNT, ttl=1.0, lock_delay=LOCK_DELAY, holder="delayed") as k:
        k.hold(k_lease).__enter__()
        proxy.stall()
        assert k.lost.wait(10)
    state = admin.get(k_lease)
    deadline = time.monotonic() + 20
    while state.held:  # the database's deadline, a TTL after the last heartbeat
        assert time.monotonic() < deadline, "the keeper's lease did not expire"
        assert k.lost.is_set()
        state = admin.get(k_lease)
    until_get = state.lock_delay_until
    assert until_get is not None and until_get > datetime.now(UTC)
    result = other.acquire(k_lease, ttl=5)
    assert not result.acquired and result.current is None
    assert result.lock_delay_until == until_get
    with pytest.raises(NotAcquiredError) as refused, other.hold(k_lease, ttl=5):
        pass
    assert refused.value.lock_delay_until == until_get
    assert refused.value.current is None
    assert "lock-delay" in refused.value.message
    proxy.pass_()


async def test_k2_async_lock_delay_visible_to_a_keepers_refused_acquire(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """K2: a key of an expired keeper in its lock-delay is refused to
    another keeper's hold too, which names until when."""
    proxy = proxies(server.address)
    client = aclients(proxy.address, token=token())
    other = aclients(server.address, token=token())
    k_lease = key("adelay")
    async with client.keeper(ACCOUNT, ttl=1.0, lock_delay=LOCK_DELAY) as k:
        await k.hold(k_lease).__aenter__()
        proxy.stall()
        await asyncio.wait_for(k.lost.wait(), 10)
    async with other.keeper(ACCOUNT, ttl=5) as k2:
        # Refused for the lease until the database deadline, then for the delay.
        deadline = time.monotonic() + 20
        while True:
            with pytest.raises(NotAcquiredError) as refused:
                async with k2.hold(k_lease):
                    pass
            if refused.value.current is None:
                break
            assert refused.value.current.run_id != ""
            assert time.monotonic() < deadline, "the keeper's lease did not expire"
    until_refused = refused.value.lock_delay_until
    assert until_refused is not None and until_refused > datetime.now(UTC)
    assert "lock-delay" in refused.value.message
    assert admin.get(k_lease).lock_delay_until == until_refused
    result = await other.acquire(k_lease, ttl=5)
    assert not result.acquired and result.lock_delay_until == until_refused
    proxy.pass_()


# Keeper: the keeper lost (expiry, revoke) ends every lease on it at once;
# a revoke of one lease ends only that one


def test_k1_revoking_one_lease_ends_only_it_revoking_the_keeper_ends_every_hold_at_once(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """An admin revoke of one lease reaches its hold over the stream
    (lease_lost): only that hold is lost, the keeper and its other holds go
    on. RevokeKeeper then ends the keeper: by the time its ``lost`` is set,
    every remaining hold's is set too (loss reason ``revoked``)."""
    client = clients(server.address, token=token())
    with client.keeper(ACCOUNT, ttl=3, holder="revoked") as k:
        holds = [k.hold(key("revoke")).__enter__() for _ in range(3)]
        revoked = admin.revoke(holds[0].key, reason="one lease")
        assert revoked.revoked
        assert holds[0].lost.wait(10)
        assert holds[0].loss_reason == "revoked"
        assert not k.lost.is_set()
        assert not holds[1].lost.is_set() and not holds[2].lost.is_set()
        assert_held_by(admin, holds[1], k.keeper_id)
        result = admin.revoke_keeper(ACCOUNT, k.keeper_id, reason="the whole keeper")
        assert result.revoked and result.leases_revoked == 2
        assert k.lost.wait(10)
        assert holds[1].lost.is_set() and holds[2].lost.is_set()
        assert k.loss_reason == "revoked"
        assert [h.loss_reason for h in holds] == ["revoked"] * 3
    for h in holds:
        assert not admin.get(h.key).held
        assert events_of(admin, h.key, h.run_id)[-1] == "REVOKED"


async def test_k1_async_revoking_the_keeper_cancels_the_work_of_every_hold(
    server: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """The asyncio client: a revoke of one lease cancels only its work;
    RevokeKeeper cancels the work of every other hold on the keeper."""
    client = aclients(server.address, token=token())
    async with client.keeper(ACCOUNT, ttl=3, holder="arevoked") as k:
        started: list[AsyncKeeperHold] = []

        async def work(h: AsyncKeeperHold) -> None:
            started.append(h)
            await asyncio.Event().wait()  # until cancelled

        tasks = [asyncio.ensure_future(k.run_exclusive(key("arevoke"), work)) for _ in range(3)]
        await until("three holds at work", lambda: len(started) == 3)
        admin.revoke(started[0].key, reason="one lease")
        with pytest.raises(LeaseLostError):
            await tasks[0]
        assert not any(t.done() for t in tasks[1:])
        admin.revoke_keeper(ACCOUNT, k.keeper_id, reason="the whole keeper")
        outcomes = await asyncio.gather(*tasks[1:], return_exceptions=True)
        assert all(isinstance(o, LeaseLostError) for o in outcomes)
        assert all(o.loss_reason == "revoked" for o in outcomes if isinstance(o, LeaseLostError))
        assert k.lost.is_set()


def test_a_handoff_request_reaches_only_its_keepers_hold_whose_listener_may_release_it(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """RequestHandoff reaches the hold it names over the keeper's stream,
    not the keeper's other hold; its listener, called on the stream's
    reader thread, ends the hold there, and the Release goes out at once
    (not waited for on the thread that reads its answer)."""
    client = clients(server.address, token=token())
    asker = clients(server.address, token=token())
    with client.keeper(ACCOUNT, ttl=3, holder="desktop") as k:
        asked = k.hold(key("handoff")).__enter__()
        other = k.hold(key("handoff")).__enter__()
        returned = threading.Event()

        def hand_off(request: HandoffRequest) -> None:
            asked.__exit__(None, None, None)
            returned.set()

        asked.on_handoff(hand_off)
        result = asker.request_handoff(asked.key, requester_holder="browser", reason="here")
        assert result.delivered
        assert asked.handoff_requested.wait(10)
        assert asked.handoff_requests[0].requester_holder == "browser"
        wait_for("the handed-off lease's release", lambda: not admin.get(asked.key).held)
        assert events_of(admin, asked.key, asked.run_id)[-1] == "RELEASED"
        assert returned.wait(10)
        assert asked.release_error is None  # not a wait timed out on the reader thread
        assert not other.handoff_requested.is_set() and not other.lost.is_set()
        assert not k.lost.is_set()
        assert_held_by(admin, other, k.keeper_id)


def test_a_keeper_the_server_refuses_raises_the_error_naming_the_field(
    server: Server, token: Callable[..., str], clients: Clients
) -> None:
    """Bad input: a lock-delay above the server's --max-lock-delay is
    refused at the open, INVALID_ARGUMENT naming the field (no keeper); the
    client's own checks name theirs before anything is sent."""
    client = clients(server.address, token=token())
    with (
        pytest.raises(InvalidArgumentError) as refused,
        client.keeper(ACCOUNT, ttl=3, lock_delay=2 * 24 * 3600),
    ):
        pass
    assert refused.value.field == "open.lock_delay"
    with pytest.raises(ValueError, match="ttl must be a positive duration"):
        client.keeper(ACCOUNT, ttl=0)
    with pytest.raises(ValueError, match="lock_delay must be at least 0"):
        client.keeper(ACCOUNT, ttl=3, lock_delay=-1)
    with pytest.raises(ValueError, match="account_id must not be empty"):
        client.keeper("", ttl=3)
