"""The asyncio client's stories (issue 26, "Prove it"), the same as the
blocking client's in test_blocking.py, on AsyncLeaseClient."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

import pytest
import pytest_asyncio
from test_blocking import (
    MARGIN,
    RUNS,
    TTL,
    assert_released_not_lost,
    counters,
    events_of,
    key,
    put,
)

from leasehold import (
    AsyncHold,
    AsyncLeaseClient,
    InvalidArgumentError,
    LateGrantError,
    LeaseClient,
    LeaseLostError,
    NotAcquiredError,
    StaleFencingTokenError,
    UnauthenticatedError,
    UnavailableError,
)
from support import Server, TcpProxy, keepalive_streams_ended, lease_server

AsyncClients = Callable[..., AsyncLeaseClient]
Proxies = Callable[[str], TcpProxy]


@pytest_asyncio.fixture
async def aclients() -> AsyncIterator[AsyncClients]:
    made: list[AsyncLeaseClient] = []

    def make(*args: object, **kwargs: object) -> AsyncLeaseClient:
        client = AsyncLeaseClient(*args, **kwargs)  # type: ignore[arg-type]
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


async def until(what: str, predicate: Callable[[], object], limit: float = 20.0) -> None:
    """Waits, yielding to the event loop, until ``predicate()`` holds."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {limit}s")
        await asyncio.sleep(0.01)


async def test_s1_two_holders_race_and_exactly_one_wins(
    server: Server, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """S1: two async clients hold one session at once; exactly one wins."""
    k = key("arace")
    a, b = aclients(server.address, token=token()), aclients(server.address, token=token())
    holds = [a.hold(k, ttl=TTL, holder="a"), b.hold(k, ttl=TTL, holder="b")]
    outcomes = await asyncio.gather(*(h.__aenter__() for h in holds), return_exceptions=True)
    winners = [o for o in outcomes if isinstance(o, AsyncHold)]
    losers = [o for o in outcomes if isinstance(o, NotAcquiredError)]
    assert len(winners) == 1 and len(losers) == 1
    assert losers[0].current is not None and losers[0].current.run_id == winners[0].run_id
    await winners[0].__aexit__(None, None, None)


async def test_l2_s6_s7_stalled_winner_is_cancelled_before_the_database_deadline_and_fenced(
    server: Server,
    store: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """L2: every route of the holder stalls; run_exclusive cancels the work's
    task at the local deadline and raises LeaseLostError while the database
    still counts the lease valid. S6, S7: the other takes over with a larger
    token and the old token's late write is refused. No release after loss
    (History)."""
    k = key("astall")
    proxy = proxies(server.address)
    old = aclients(proxy.address, token=token())
    new = aclients(server.address, token=token())
    seen: dict[str, object] = {}

    async def work(h: AsyncHold) -> None:
        seen["hold"] = h
        put(store, k, h.fencing_token, "old: first", bearer=token())
        proxy.stall()
        try:
            while True:
                seen["last_write"] = time.monotonic()
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            seen["cancelled_at"] = time.monotonic()
            raise

    with pytest.raises(LeaseLostError) as lost:
        await old.run_exclusive(k, work, ttl=TTL, safety_margin=MARGIN)
    assert lost.value.loss_reason == "deadline"
    h = seen["hold"]
    assert isinstance(h, AsyncHold)
    assert "cancelled_at" in seen
    state = admin.get(k)
    assert state.held and state.lease is not None and state.lease.run_id == h.run_id
    assert state.lease.remaining.total_seconds() > 0
    assert h.released is None
    async with new.hold(k, ttl=TTL, wait=30) as h2:
        assert h2.fencing_token > h.fencing_token
        put(store, k, h2.fencing_token, "new: first", bearer=token())
        with pytest.raises(StaleFencingTokenError) as refused:
            put(store, k, h.fencing_token, "old: late", bearer=token())
        assert (refused.value.presented, refused.value.highest) == (
            h.fencing_token,
            h2.fencing_token,
        )
    assert "RELEASED" not in events_of(admin, k, h.run_id)


async def test_l2_a_blocked_event_loop_still_sees_the_deadline(
    server: Server, token: Callable[..., str], aclients: AsyncClients, proxies: Proxies
) -> None:
    """L2: a body that blocks the event loop past the local deadline is told
    by check() and remaining(), which read the clock themselves."""
    k = key("blocked")
    proxy = proxies(server.address)
    c = aclients(proxy.address, token=token())
    async with c.hold(k, ttl=1.0, safety_margin=0.3) as h:
        proxy.stall()
        deadline = time.monotonic() + h.remaining().total_seconds()
        while time.monotonic() <= deadline:
            time.sleep(0.05)  # noqa: ASYNC251 - blocks the loop on purpose: no timer runs
        assert h.remaining() == timedelta(0)
        with pytest.raises(LeaseLostError) as lost:
            h.check()
        assert lost.value.loss_reason == "deadline"
        assert h.lost.is_set()


async def test_l2_a_cut_stream_alone_reconnects_and_keeps_the_lease(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    k = key("acut")
    proxy = proxies(server.address)
    c = aclients(proxy.address, token=token())
    async with c.hold(k, ttl=TTL, safety_margin=MARGIN) as h:
        await until("a KeepAlive connection", lambda: proxy.accepted >= 2)
        before = proxy.accepted
        proxy.cut()
        await until("a reconnected stream", lambda: proxy.accepted > before)
        first_deadline = time.monotonic() + TTL
        await until("the first TTL to pass", lambda: time.monotonic() > first_deadline)
        h.check()
        state = admin.get(k)
        assert state.lease is not None
        assert (state.lease.run_id, state.lease.fencing_token) == (h.run_id, h.fencing_token)
    assert h.released is True
    assert events_of(admin, k, h.run_id) == ["ACQUIRED", "RELEASED"]


async def test_s2_a_retry_after_a_dropped_answer_keeps_the_token(
    servers: list[Server],
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    k = key("adropped")
    proxy = proxies(servers[0].address)
    c = aclients([proxy.address, servers[1].address], token=token())
    await c.get(k)
    proxy.drop_next_answer()
    async with c.hold(k, ttl=TTL) as h:
        assert proxy.dropped_answers == 1
        acquired = [e for e in admin.history(k).events if e.type == "ACQUIRED"]
        assert [(e.run_id, e.fencing_token) for e in acquired] == [(h.run_id, h.fencing_token)]


async def test_s5_a_release_whose_connection_is_reset_is_retried_on_the_same_address(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    k = key("arelease-reset")
    proxy = proxies(server.address)
    c = aclients(proxy.address, token=token())
    granted = await c.acquire(k, ttl=30.0)
    assert granted.lease is not None
    run_id = granted.lease.run_id
    proxy.drop_next_request()
    assert await c.release(k, run_id) is True
    assert proxy.dropped_requests == 1
    assert events_of(admin, k, run_id) == ["ACQUIRED", "RELEASED"]
    assert admin.get(k).lease is None


async def test_l2_an_instance_stopped_mid_hold_the_lease_is_kept_through_the_other(
    database_url: str,
    secret: str,
    servers: list[Server],
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
) -> None:
    k = key("afailover")
    doomed = lease_server(database_url, secret)
    try:
        c = aclients([doomed.address, servers[1].address], token=token())
        async with c.hold(k, ttl=TTL, safety_margin=MARGIN) as h:
            await asyncio.to_thread(doomed.stop)
            first_deadline = time.monotonic() + TTL
            await until("the first TTL to pass", lambda: time.monotonic() > first_deadline)
            h.check()
            state = admin.get(k)
            assert state.lease is not None and state.lease.run_id == h.run_id
        assert h.released is True
    finally:
        doomed.stop()


async def test_l1_a_thousand_leases_share_one_stream(
    database_url: str, secret: str, token: Callable[..., str], aclients: AsyncClients
) -> None:
    own = lease_server(database_url, secret)
    try:
        c = aclients(own.address, token=token())
        holds = [c.hold(key("amany"), ttl=10.0) for _ in range(1000)]
        for start in range(0, 1000, 100):
            await asyncio.gather(*(h.__aenter__() for h in holds[start : start + 100]))
        first = {h.run_id: h.lease.expires_at for h in holds}
        await until(
            "a renewal of every lease",
            lambda: all(h.lease.expires_at != first[h.run_id] for h in holds),
            30,
        )
        assert c.keepalive_streams == 1
        assert not any(h.lost.is_set() for h in holds)
        for h in holds:
            await h.__aexit__(None, None, None)
        await until("the stream to end", lambda: keepalive_streams_ended(own.address) >= 1)
        assert keepalive_streams_ended(own.address) == 1
    finally:
        own.stop()


async def test_l2_a_client_past_max_leases_per_stream_opens_another_stream(
    database_url: str, secret: str, token: Callable[..., str], aclients: AsyncClients
) -> None:
    own = lease_server(database_url, secret, "--max-leases-per-stream", "2")
    try:
        events: list[object] = []
        c = aclients(own.address, token=token(), on_event=events.append)
        holds = [c.hold(key("alanes"), ttl=TTL, safety_margin=MARGIN) for _ in range(5)]
        for h in holds:
            await h.__aenter__()
        first_deadline = time.monotonic() + TTL
        await until("the first TTL to pass", lambda: time.monotonic() > first_deadline)
        for h in holds:
            h.check()
        assert c.keepalive_streams == 3
        refused = [
            e
            for e in events
            if getattr(e, "type", "") == "failed"
            and getattr(getattr(e, "error", None), "reason", None) == "LIMIT_EXCEEDED"
        ]
        assert len(refused) == 1
        for h in holds:
            await h.__aexit__(None, None, None)
    finally:
        own.stop()


async def test_l2_tokens_refreshed_on_reopen_and_a_static_expired_token_loses_the_lease(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """L2: a callable token is called again when the stream reopens after
    the first token expired: the lease is kept. A static expired token
    loses the lease at the reopen, with reason token_expired."""
    proxy = proxies(server.address)
    issued: list[float] = []

    def short_lived() -> str:
        issued.append(time.time() + 1)
        return token(expires_in=1)

    refreshed = aclients(proxy.address, token=short_lived)
    static_exp = time.time() + 1
    static = aclients(proxy.address, token=token(expires_in=1))
    async with (
        refreshed.hold(key("arefresh"), ttl=3.0, safety_margin=1.0) as h,
        static.hold(key("astatic"), ttl=30.0) as s,
    ):
        limit = max(issued[0], static_exp) + 5.5
        await until("the first tokens to expire on the server", lambda: time.time() > limit)
        calls = len(issued)
        proxy.cut()
        await until("a fresh token", lambda: len(issued) > calls)
        await asyncio.wait_for(s.lost.wait(), 10)
        assert s.loss_reason == "token_expired"
        renewed_from = h.lease.expires_at
        await until("a renewal on the reopened stream", lambda: h.lease.expires_at != renewed_from)
        h.check()
        state = admin.get(h.key)
        assert state.lease is not None and state.lease.run_id == h.run_id


async def test_l2_work_that_ends_at_once_releases_after_its_renewal_is_answered(
    database_url: str,
    secret: str,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """L2: as test_blocking's: work that ends at once (run_exclusive, and an
    ``async with`` hold) releases after its first renewal is answered, every
    answer 300 ms late; no loss is counted or reported."""
    own = lease_server(database_url, secret)
    try:
        proxy = proxies(own.address)
        c = aclients(proxy.address, token=token())
        before = counters(own.address)
        proxy.answer_lag = 0.3
        holds: list[AsyncHold] = []

        async def work(h: AsyncHold) -> None:
            holds.append(h)

        for _ in range(RUNS):
            await c.run_exclusive(key("arelease-not-loss"), work, ttl=30.0)
        for _ in range(RUNS):
            async with c.hold(key("arelease-not-loss"), ttl=30.0) as h:
                holds.append(h)
        assert_released_not_lost(before, counters(own.address), holds)
    finally:
        await asyncio.to_thread(own.stop)


async def test_s3_handoff_and_late_grant_and_errors_as_classes(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    """S3: a handoff request reaches the async holder. L2: a late grant is
    refused and released. Errors arrive as their classes."""
    c = aclients(server.address, token=token())
    k = key("ahandoff")
    async with c.hold(k, ttl=TTL) as h:
        granted = h.lease.expires_at
        await until("a first renewal on the stream", lambda: h.lease.expires_at != granted)
        assert (await c.request_handoff(k, requester_holder="browser")).delivered
        await asyncio.wait_for(h.handoff_requested.wait(), 10)
        assert h.handoff_requests[0].requester_holder == "browser"
        with pytest.raises(NotAcquiredError):
            await c.hold(k, ttl=TTL).__aenter__()

    proxy = proxies(server.address)
    slow = aclients(proxy.address, token=token())
    late_key = key("alate")
    await slow.get(late_key)
    proxy.answer_delay = 0.8
    with pytest.raises(LateGrantError) as late:
        await slow.hold(late_key, ttl=1.0, safety_margin=0.5).__aenter__()
    assert late.value.late_lease is not None
    assert events_of(admin, late_key, late.value.late_lease.run_id) == ["ACQUIRED", "RELEASED"]

    with pytest.raises(InvalidArgumentError) as invalid:
        await c.acquire(k, ttl=timedelta(hours=2))
    assert invalid.value.field == "ttl"
    with pytest.raises(UnauthenticatedError) as unauthenticated:
        await aclients(server.address, token=token(expires_in=-60)).get(k)
    assert unauthenticated.value.failure == "expired"
    proxy.drop()
    with pytest.raises(UnavailableError) as unavailable:
        await aclients(proxy.address, token=token(), timeout=2).get(k)
    assert proxy.address in str(unavailable.value)


async def test_run_exclusive_returns_the_result_and_releases(
    server: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """The work's result is returned and the lease released; the hold's own
    release is not a loss."""
    c = aclients(server.address, token=token())
    k = key("aresult")
    holds: list[AsyncHold] = []

    async def work(h: AsyncHold) -> int:
        holds.append(h)
        return h.fencing_token

    assert await c.run_exclusive(k, work, ttl=TTL) > 0
    assert holds[0].released is True and not holds[0].lost.is_set()
    assert events_of(admin, k, holds[0].run_id) == ["ACQUIRED", "RELEASED"]
