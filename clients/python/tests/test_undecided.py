"""A KeepAlive renewal the database did not decide (docs/streams.md,
"Database trouble"), for both clients, against a server of its own whose
renewal statements time out (statement_timeout 150 ms) long before a hold's
stall watch (its renewal interval, 500 ms) would fire. A table lock held
through a direct PostgreSQL connection holds every renewal statement up until
it times out: the server answers each renewal `undecided`. As
test/run-exclusive.test.ts does for the TypeScript client and
keepalive_undecided_test.go for the Go client."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import grpc
import psycopg
from test_async import AsyncClients, aclients, until
from test_blocking import Clients, key

from leasehold import KeepAliveEvent, SessionKey
from support import lease_server, wait_for

__all__ = ["aclients"]

SLOW = ("--statement-timeout", "150ms", "--lock-timeout", "30s")
LOCK = "LOCK TABLE leases IN SHARE MODE"


@contextmanager
def renewals_locked(database_url: str) -> Iterator[None]:
    """Writes to the leases table wait for this transaction; reads do not."""
    with psycopg.connect(database_url) as conn:
        conn.execute(LOCK)
        try:
            yield
        finally:
            conn.rollback()


@asynccontextmanager
async def renewals_locked_async(database_url: str) -> AsyncIterator[None]:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await conn.execute(LOCK)
        try:
            yield
        finally:
            await conn.rollback()


def server_side_left(database_url: str, k: SessionKey) -> float:
    """Seconds until the lease's server-side deadline, on the database clock."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM leases"
            " WHERE account_id = %s AND session_id = %s",
            (k.account_id, k.session_id),
        ).fetchone()
    assert row is not None
    left: float = row[0]
    return left


class Events:
    """The client's KeepAlive events, appended from its timer thread or loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KeepAliveEvent] = []

    def __call__(self, event: KeepAliveEvent) -> None:
        with self._lock:
            self._events.append(event)

    def of(self, *types: str) -> list[KeepAliveEvent]:
        with self._lock:
            return [e for e in self._events if e.type in types]


def assert_undecided_and_one_stream(events: Events, run_id: str) -> None:
    first = events.of("renewal_undecided")[0]
    assert first.run_id == run_id
    assert first.error is not None
    assert first.error.code == grpc.StatusCode.UNAVAILABLE
    assert first.error.reason == "DATABASE_UNAVAILABLE"
    assert first.error.metadata.get("sql_state") == "57014"
    # One stream throughout: opened once, never failed.
    assert [e.type for e in events.of("open", "failed")] == ["open"]


def test_l2_an_undecided_renewal_keeps_the_stream_and_the_lease_then_is_renewed(
    database_url: str, secret: str, token: Callable[..., str], clients: Clients
) -> None:
    """L2: renewals answered undecided keep the stream (no reconnect) and the
    hold; its lease's deadline does not move; a renewal once the database is
    back renews it."""
    own = lease_server(database_url, secret, *SLOW)
    try:
        events = Events()
        c = clients(own.address, token=token(), on_event=events)
        k = key("undecided")
        with c.hold(k, ttl=2.5, renew_interval=0.5) as h:
            with renewals_locked(database_url):
                # Every renewal from the first undecided one on is held up by
                # the lock; two more rounds span more than one renewal
                # interval, which the stall watch took for a stalled stream.
                wait_for(
                    "a renewal answered undecided", lambda: len(events.of("renewal_undecided")) >= 1
                )
                before = h.lease.expires_at
                wait_for(
                    "two more renewals answered undecided",
                    lambda: len(events.of("renewal_undecided")) >= 3,
                )
                during = h.lease.expires_at
                stored = c.get(k).lease
            assert not h.lost.is_set()
            assert during == before
            assert stored is not None and stored.run_id == h.run_id
            assert stored.expires_at == before
            wait_for("a renewal once the database is back", lambda: h.lease.expires_at != before)
            h.check()
        assert_undecided_and_one_stream(events, h.run_id)
    finally:
        own.stop()


def test_l2_a_database_that_stays_slow_ends_the_hold_at_its_local_deadline(
    database_url: str, secret: str, token: Callable[..., str], clients: Clients
) -> None:
    """L2: with every renewal undecided, the hold is lost at its local
    deadline, before the server-side one, on the same stream."""
    own = lease_server(database_url, secret, *SLOW)
    try:
        events = Events()
        c = clients(own.address, token=token(), on_event=events)
        k = key("undecided-lost")
        with c.hold(k, ttl=2.0, safety_margin=0.5) as h, renewals_locked(database_url):
            assert h.lost.wait(10)
            left = server_side_left(database_url, k)
        assert h.loss_reason == "deadline"
        assert left > 0
        assert_undecided_and_one_stream(events, h.run_id)
    finally:
        own.stop()


async def test_l2_async_an_undecided_renewal_keeps_the_stream_and_the_lease_then_is_renewed(
    database_url: str, secret: str, token: Callable[..., str], aclients: AsyncClients
) -> None:
    own = lease_server(database_url, secret, *SLOW)
    try:
        events = Events()
        c = aclients(own.address, token=token(), on_event=events)
        k = key("aundecided")
        async with c.hold(k, ttl=2.5, renew_interval=0.5) as h:
            async with renewals_locked_async(database_url):
                await until(
                    "a renewal answered undecided", lambda: len(events.of("renewal_undecided")) >= 1
                )
                before = h.lease.expires_at
                await until(
                    "two more renewals answered undecided",
                    lambda: len(events.of("renewal_undecided")) >= 3,
                )
                during = h.lease.expires_at
                stored = (await c.get(k)).lease
            assert not h.lost.is_set()
            assert during == before
            assert stored is not None and stored.run_id == h.run_id
            assert stored.expires_at == before
            await until("a renewal once the database is back", lambda: h.lease.expires_at != before)
            h.check()
        assert_undecided_and_one_stream(events, h.run_id)
    finally:
        own.stop()


async def test_l2_async_a_database_that_stays_slow_ends_the_hold_at_its_local_deadline(
    database_url: str, secret: str, token: Callable[..., str], aclients: AsyncClients
) -> None:
    own = lease_server(database_url, secret, *SLOW)
    try:
        events = Events()
        c = aclients(own.address, token=token(), on_event=events)
        k = key("aundecided-lost")
        async with (
            c.hold(k, ttl=2.0, safety_margin=0.5) as h,
            renewals_locked_async(database_url),
        ):
            await until("the hold to be lost", h.lost.is_set)
            left = server_side_left(database_url, k)
        assert h.loss_reason == "deadline"
        assert left > 0
        assert_undecided_and_one_stream(events, h.run_id)
    finally:
        own.stop()
