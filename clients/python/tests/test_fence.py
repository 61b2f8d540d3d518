"""S7 for Python resources: the fencing interceptor (blocking and aio) and
the fenced-write helper, on the resource's own PostgreSQL (the fence
function of migrations/fence), against tokens the lease server granted."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from contextlib import asynccontextmanager
from typing import Any

import grpc
import grpc.aio
import psycopg
import pytest
import pytest_asyncio
from test_blocking import TTL, key

from leasehold import (
    ACCOUNT_ID_HEADER,
    FENCING_TOKEN_HEADER,
    SESSION_ID_HEADER,
    AsyncLeaseClient,
    InvalidArgumentError,
    LeaseClient,
    LeaseNotHeldError,
    StaleFencingTokenError,
    UnavailableError,
)
from leasehold._gen.leasehold.guarded.v1 import guarded_pb2, guarded_pb2_grpc
from leasehold.errors import DATABASE_UNAVAILABLE, from_rpc_error
from leasehold.fence import (
    MAX_TOKEN,
    AsyncFencingInterceptor,
    FencingInterceptor,
    current_fenced_call,
    fenced_write,
)
from leasehold.types import SessionKey
from support import Server, require_env


@pytest.fixture(scope="module")
def fence_db() -> str:
    url = require_env("LEASEHOLD_TEST_FENCE_DATABASE_URL")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """CREATE TABLE IF NOT EXISTS py_fenced_writes (
                 id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 account_id text NOT NULL, session_id text NOT NULL,
                 header_token bigint NOT NULL, value text NOT NULL)"""
        )
    return url


def rows(url: str, k: SessionKey) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return [
            (int(r[0]), str(r[1]))
            for r in conn.execute(
                "SELECT header_token, value FROM py_fenced_writes "
                "WHERE account_id = %s AND session_id = %s ORDER BY id",
                (k.account_id, k.session_id),
            )
        ]


def record(conn: Any, request: guarded_pb2.PutRequest) -> None:
    call = current_fenced_call()
    conn.execute(
        "INSERT INTO py_fenced_writes (account_id, session_id, header_token, value) "
        "VALUES (%s, %s, %s, %s)",
        (
            call.claim.key.account_id,
            call.claim.key.session_id,
            call.claim.token,
            request.value.decode(),
        ),
    )


class Store(guarded_pb2_grpc.GuardedStoreServiceServicer):
    """Put records what it was given on the interceptor's transaction."""

    def Put(self, request: guarded_pb2.PutRequest, context: Any) -> guarded_pb2.PutResponse:
        call = current_fenced_call()
        record(call.connection, request)
        return guarded_pb2.PutResponse(highest_token=call.highest_token)


class AsyncStore(guarded_pb2_grpc.GuardedStoreServiceServicer):
    async def Put(self, request: guarded_pb2.PutRequest, context: Any) -> guarded_pb2.PutResponse:
        call = current_fenced_call()
        await call.connection.execute(
            "INSERT INTO py_fenced_writes (account_id, session_id, header_token, value) "
            "VALUES (%s, %s, %s, %s)",
            (
                call.claim.key.account_id,
                call.claim.key.session_id,
                call.claim.token,
                request.value.decode(),
            ),
        )
        return guarded_pb2.PutResponse(highest_token=call.highest_token)


@pytest.fixture(scope="module")
def sync_store(fence_db: str) -> Iterator[str]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[FencingInterceptor(lambda: psycopg.connect(fence_db))],
    )
    guarded_pb2_grpc.add_GuardedStoreServiceServicer_to_server(Store(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@asynccontextmanager
async def connect_async(url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        yield conn


@pytest_asyncio.fixture
async def async_store(fence_db: str) -> AsyncIterator[str]:
    server = grpc.aio.server(
        interceptors=[AsyncFencingInterceptor(lambda: connect_async(fence_db))]
    )
    guarded_pb2_grpc.add_GuardedStoreServiceServicer_to_server(AsyncStore(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


def put(address: str, k: SessionKey, text: str, metadata: Any) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = guarded_pb2_grpc.GuardedStoreServiceStub(channel)
        request = guarded_pb2.PutRequest(key=k.to_proto(), name="doc", value=text.encode())
        try:
            response = stub.Put(request, metadata=metadata, timeout=10)
            return int(response.highest_token)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e


def stale_late_write_story(
    address: str, fence_db: str, admin: LeaseClient, c: LeaseClient, label: str
) -> None:
    k = key(label)
    with c.hold(k, ttl=TTL) as old:
        t1 = old.fencing_token
        old_headers = old.fencing_metadata()
        assert put(address, k, "old 1", old_headers) == t1
    with c.hold(k, ttl=TTL) as new:
        t2 = new.fencing_token
        assert t2 > t1
        assert put(address, k, "new 1", new.fencing_metadata()) == t2
        # The old run wakes up and writes with the headers it had.
        with pytest.raises(StaleFencingTokenError) as refused:
            put(address, k, "old late", old_headers)
        assert (refused.value.presented, refused.value.highest) == (t1, t2)
        assert refused.value.code == grpc.StatusCode.ABORTED
        assert refused.value.metadata == {"presented_token": str(t1), "highest_token": str(t2)}
    # The refused write left nothing: check and write are one transaction.
    assert rows(fence_db, k) == [(t1, "old 1"), (t2, "new 1")]
    with pytest.raises(InvalidArgumentError) as missing:
        put(address, k, "no token", ())
    assert missing.value.field == FENCING_TOKEN_HEADER


def test_s7_the_blocking_interceptor_refuses_the_old_runs_late_write(
    server: Server,
    fence_db: str,
    sync_store: str,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Callable[..., LeaseClient],
) -> None:
    """S7: a write fenced by its headers alone; the newer run's token
    raises the fence; the old run's late write is ABORTED
    STALE_FENCING_TOKEN with the guarded store's details, and not written."""
    c = clients(server.address, token=token())
    stale_late_write_story(sync_store, fence_db, admin, c, "pyfence")


async def test_s7_the_aio_interceptor_refuses_the_old_runs_late_write(
    server: Server,
    fence_db: str,
    async_store: str,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Callable[..., LeaseClient],
) -> None:
    """S7, as above, on a grpc.aio server."""
    c = clients(server.address, token=token())
    await asyncio.to_thread(stale_late_write_story, async_store, fence_db, admin, c, "pyafence")


# The grant check: given the lease server, the interceptor raises a
# session's fence only to the newest token the lease server granted for it.


def serve_sync(fence_db: str, leases: LeaseClient) -> tuple[grpc.Server, str]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[FencingInterceptor(lambda: psycopg.connect(fence_db), leases=leases)],
    )
    guarded_pb2_grpc.add_GuardedStoreServiceServicer_to_server(Store(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def granted_store(
    fence_db: str, server: Server, token: Callable[..., str], clients: Callable[..., LeaseClient]
) -> Iterator[str]:
    """The blocking interceptor given the lease server: the grant check is on."""
    grpc_server, address = serve_sync(fence_db, clients(server.address, token=token()))
    yield address
    grpc_server.stop(None)


@pytest_asyncio.fixture
async def async_granted_store(
    fence_db: str, server: Server, token: Callable[..., str]
) -> AsyncIterator[str]:
    leases = AsyncLeaseClient(server.address, token=token())
    grpc_server = grpc.aio.server(
        interceptors=[AsyncFencingInterceptor(lambda: connect_async(fence_db), leases=leases)]
    )
    guarded_pb2_grpc.add_GuardedStoreServiceServicer_to_server(AsyncStore(), grpc_server)  # type: ignore[abstract]
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    yield f"127.0.0.1:{port}"
    await grpc_server.stop(None)
    await leases.close()


def forged(k: SessionKey, token: int) -> tuple[tuple[str, str], ...]:
    """Fencing headers with a token of the sender's choosing."""
    return (
        (FENCING_TOKEN_HEADER, str(token)),
        (ACCOUNT_ID_HEADER, k.account_id),
        (SESSION_ID_HEADER, k.session_id),
    )


def fence_of(url: str, k: SessionKey) -> int | None:
    """The highest token the resource has seen for the session (None: none)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT highest_token FROM leasehold_fences WHERE account_id = %s AND session_id = %s",
            (k.account_id, k.session_id),
        ).fetchone()
    return None if row is None else int(row[0])


def never_granted(address: str, k: SessionKey, token: int) -> None:
    with pytest.raises(LeaseNotHeldError) as refused:
        put(address, k, f"forged {token}", forged(k, token))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.loss_cause == "not_found"


def poisoning_story(address: str, fence_db: str, c: LeaseClient, label: str) -> None:
    k = key(label)
    # 2^63−1 from someone who merely reaches the service, before any write:
    # refused, and the fence is not raised (nothing was recorded at all).
    never_granted(address, k, MAX_TOKEN)
    assert fence_of(fence_db, k) is None
    with c.hold(k, ttl=TTL) as first:
        t1 = first.fencing_token
        assert put(address, k, "real 1", first.fencing_metadata()) == t1
        # Now that the resource has seen t1: 2^63−1 and t1 + 1 (never
        # granted) are refused; t1 stays the fence, and the run writes on.
        never_granted(address, k, MAX_TOKEN)
        never_granted(address, k, t1 + 1)
        assert fence_of(fence_db, k) == t1
        assert put(address, k, "real 2", first.fencing_metadata()) == t1
        old_headers = first.fencing_metadata()
    # A replaced run whose token the resource has not seen: the lease
    # server's newer grant makes it stale (ABORTED, the lease server's
    # highest token).
    with c.hold(k, ttl=TTL) as second:
        t2 = second.fencing_token
    with c.hold(k, ttl=TTL) as third:
        t3 = third.fencing_token
        with pytest.raises(StaleFencingTokenError) as stale:
            put(address, k, "replaced", forged(k, t2))
        assert (stale.value.presented, stale.value.highest) == (t2, t3)
        # The next real run raises the fence to its own token.
        assert put(address, k, "real 3", third.fencing_metadata()) == t3
        with pytest.raises(StaleFencingTokenError):
            put(address, k, "old late", old_headers)
    assert fence_of(fence_db, k) == t3
    assert rows(fence_db, k) == [(t1, "real 1"), (t1, "real 2"), (t3, "real 3")]


def test_s7_the_blocking_interceptor_given_the_lease_server_refuses_a_token_never_granted(
    server: Server,
    fence_db: str,
    granted_store: str,
    token: Callable[..., str],
    clients: Callable[..., LeaseClient],
) -> None:
    """S7, DESIGN §7: given the lease server, the interceptor confirms a token
    that would raise the fence with CheckFence: 2^63−1 (or any token never
    granted) is FAILED_PRECONDITION LEASE_NOT_HELD not_found and does not
    raise the fence, a replaced run's token is ABORTED; the real runs'
    writes pass before and after."""
    c = clients(server.address, token=token())
    poisoning_story(granted_store, fence_db, c, "pyfence-poison")


async def test_s7_the_aio_interceptor_given_the_lease_server_refuses_a_token_never_granted(
    server: Server,
    fence_db: str,
    async_granted_store: str,
    token: Callable[..., str],
    clients: Callable[..., LeaseClient],
) -> None:
    """S7, DESIGN §7, as above, on a grpc.aio server with an AsyncLeaseClient."""
    c = clients(server.address, token=token())
    await asyncio.to_thread(poisoning_story, async_granted_store, fence_db, c, "pyafence-poison")


def test_s7_the_grant_check_while_the_lease_server_is_unreachable(
    fence_db: str, token: Callable[..., str], clients: Callable[..., LeaseClient]
) -> None:
    """S7: with the lease server unreachable, a write at or below the highest
    token the resource has seen needs no CheckFence and goes on; one that
    would raise the fence is UNAVAILABLE and writes nothing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    grpc_server, address = serve_sync(fence_db, clients(nobody, token=token()))
    try:
        k = key("pyfence-unreachable")
        with psycopg.connect(fence_db) as conn, fenced_write(conn, k, 40):
            pass
        assert put(address, k, "at the fence", forged(k, 40)) == 40
        with pytest.raises(UnavailableError) as unconfirmed:
            put(address, k, "above the fence", forged(k, 41))
        assert unconfirmed.value.code == grpc.StatusCode.UNAVAILABLE
        assert "the lease server could not confirm the fencing token" in unconfirmed.value.message
        assert fence_of(fence_db, k) == 40
        assert rows(fence_db, k) == [(40, "at the fence")]
    finally:
        grpc_server.stop(None)


def test_s7_fenced_write_commits_with_the_check_or_not_at_all(fence_db: str) -> None:
    """S7: fenced_write runs the check and the block in one transaction; a
    stale token raises before the block, and a block that raises rolls the
    fence back with its writes."""
    k = key("helper")
    with psycopg.connect(fence_db) as conn:
        with fenced_write(conn, k, 5) as call:
            assert call.highest_token == 5
            conn.execute(
                "INSERT INTO py_fenced_writes (account_id, session_id, header_token, value) "
                "VALUES (%s, %s, %s, %s)",
                (k.account_id, k.session_id, 5, "five"),
            )
        with pytest.raises(RuntimeError), fenced_write(conn, k, 9):
            raise RuntimeError("the write failed")
        with pytest.raises(StaleFencingTokenError) as stale, fenced_write(conn, k, 4):
            raise AssertionError("the block of a stale token must not run")
        assert (stale.value.presented, stale.value.highest) == (4, 5)
    assert rows(fence_db, k) == [(5, "five")]


# The fence check's errors, one rule with the TypeScript and Go interceptors:
# database trouble (here a lock timeout) is UNAVAILABLE DATABASE_UNAVAILABLE
# wherever it happened, a handler's bug is not, the handler's own status
# passes unchanged.


def answering_db(fence_db: str) -> None:
    with psycopg.connect(fence_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS py_fence_names (name text PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS py_fence_rows (id int PRIMARY KEY, n int NOT NULL)"
        )
        conn.execute("INSERT INTO py_fence_rows VALUES (1, 0) ON CONFLICT DO NOTHING")


# The statements of a handler's answers, by the request's value.
_DUPLICATE = "INSERT INTO py_fence_names VALUES (%s)"
_LOCKED_ROW = "UPDATE py_fence_rows SET n = n + 1 WHERE id = 1"
# A statement far longer than the statement_timeout set before it.
_STATEMENT_TIMEOUT = "SET LOCAL statement_timeout = '100ms'"
_SLOW = "SELECT pg_sleep(30)"
# The server ends the handler's connection under it (57P01, then EOF).
_TERMINATED = "SELECT pg_terminate_backend(pg_backend_pid())"


class Answering(guarded_pb2_grpc.GuardedStoreServiceServicer):
    """Put answers what its request's value names, on the fence's transaction."""

    def Put(self, request: guarded_pb2.PutRequest, context: Any) -> guarded_pb2.PutResponse:
        call = current_fenced_call()
        conn = call.connection
        match request.value.decode():
            case "duplicate":
                # A bug of the handler's: the same name twice.
                conn.execute(_DUPLICATE, (request.name,))
                conn.execute(_DUPLICATE, (request.name,))
            case "locked row":
                conn.execute(_LOCKED_ROW)
            case "slow":
                conn.execute(_STATEMENT_TIMEOUT)
                conn.execute(_SLOW)
            case "terminated":
                conn.execute(_TERMINATED)
            case "missing":
                context.abort(grpc.StatusCode.NOT_FOUND, f"document {request.name!r} not found")
        return guarded_pb2.PutResponse(highest_token=call.highest_token)


class AsyncAnswering(guarded_pb2_grpc.GuardedStoreServiceServicer):
    async def Put(self, request: guarded_pb2.PutRequest, context: Any) -> guarded_pb2.PutResponse:
        call = current_fenced_call()
        conn = call.connection
        match request.value.decode():
            case "duplicate":
                await conn.execute(_DUPLICATE, (request.name,))
                await conn.execute(_DUPLICATE, (request.name,))
            case "locked row":
                await conn.execute(_LOCKED_ROW)
            case "slow":
                await conn.execute(_STATEMENT_TIMEOUT)
                await conn.execute(_SLOW)
            case "terminated":
                await conn.execute(_TERMINATED)
            case "missing":
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"document {request.name!r} not found"
                )
        return guarded_pb2.PutResponse(highest_token=call.highest_token)


# lock_timeout: a row held by an uncommitted transaction fails the
# handler's statement quickly (S8), as database trouble.
_LOCK_TIMEOUT = "-c lock_timeout=300"


@pytest.fixture
def answering_store(fence_db: str) -> Iterator[str]:
    answering_db(fence_db)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[FencingInterceptor(lambda: psycopg.connect(fence_db, options=_LOCK_TIMEOUT))],
    )
    guarded_pb2_grpc.add_GuardedStoreServiceServicer_to_server(Answering(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@asynccontextmanager
async def connect_async_locking(url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(url, options=_LOCK_TIMEOUT) as conn:
        yield conn


@pytest_asyncio.fixture
async def async_answering_store(fence_db: str) -> AsyncIterator[str]:
    answering_db(fence_db)
    server = grpc.aio.server(
        interceptors=[AsyncFencingInterceptor(lambda: connect_async_locking(fence_db))]
    )
    guarded_pb2_grpc.add_GuardedStoreServiceServicer_to_server(AsyncAnswering(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


def answer(address: str, k: SessionKey, token: int, value: str) -> grpc.RpcError | None:
    """The error of a Put fenced with ``token`` whose handler answers ``value``."""
    metadata = (
        (FENCING_TOKEN_HEADER, str(token)),
        (ACCOUNT_ID_HEADER, k.account_id),
        (SESSION_ID_HEADER, k.session_id),
    )
    with grpc.insecure_channel(address) as channel:
        stub = guarded_pb2_grpc.GuardedStoreServiceStub(channel)
        request = guarded_pb2.PutRequest(key=k.to_proto(), name=k.session_id, value=value.encode())
        try:
            stub.Put(request, metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error
    return None


def handlers_errors_story(address: str, fence_db: str, label: str) -> None:
    k = key(label)
    assert answer(address, k, 5, "ok") is None

    # A handler's bug (a unique violation) is not UNAVAILABLE: retrying
    # cannot help. It propagates, and grpc answers UNKNOWN.
    bug = answer(address, k, 5, "duplicate")
    assert bug is not None
    assert bug.code() == grpc.StatusCode.UNKNOWN, (bug.code(), bug.details())
    assert not isinstance(from_rpc_error(bug), UnavailableError)

    # The handler's own status passes unchanged.
    missing = answer(address, k, 5, "missing")
    assert missing is not None
    assert (missing.code(), missing.details()) == (
        grpc.StatusCode.NOT_FOUND,
        f"document {k.session_id!r} not found",
    )

    # S8: the handler's statement waits on a row held by an uncommitted
    # transaction until lock_timeout: database trouble, UNAVAILABLE.
    with psycopg.connect(fence_db) as holder:
        holder.execute("SELECT n FROM py_fence_rows WHERE id = 1 FOR UPDATE")
        locked = answer(address, k, 5, "locked row")
        holder.rollback()
    assert locked is not None
    assert locked.code() == grpc.StatusCode.UNAVAILABLE, (locked.code(), locked.details())
    unavailable = from_rpc_error(locked)
    assert isinstance(unavailable, UnavailableError)
    assert (unavailable.reason, unavailable.metadata) == (
        DATABASE_UNAVAILABLE,
        {"sql_state": "55P03"},
    )
    # Once the row is free the same call succeeds.
    assert answer(address, k, 5, "locked row") is None

    # The handler's statement past statement_timeout: DEADLINE_EXCEEDED.
    slow = answer(address, k, 5, "slow")
    assert slow is not None
    assert slow.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (slow.code(), slow.details())

    # The handler's connection ended by the server: UNAVAILABLE.
    terminated = answer(address, k, 5, "terminated")
    assert terminated is not None
    assert terminated.code() == grpc.StatusCode.UNAVAILABLE, (
        terminated.code(),
        terminated.details(),
    )
    assert from_rpc_error(terminated).reason == DATABASE_UNAVAILABLE

    # S7: a stale token stays ABORTED STALE_FENCING_TOKEN.
    stale = answer(address, k, 4, "ok")
    assert stale is not None
    refused = from_rpc_error(stale)
    assert isinstance(refused, StaleFencingTokenError)
    assert (refused.presented, refused.highest) == (4, 5)


def test_s7_s8_the_blocking_interceptor_answers_database_trouble_unavailable_and_a_bug_not(
    fence_db: str, answering_store: str
) -> None:
    """S7, S8: a handler's unique violation is UNKNOWN, not UNAVAILABLE; its
    statement that hits lock_timeout is UNAVAILABLE DATABASE_UNAVAILABLE
    (sql_state 55P03), one past statement_timeout DEADLINE_EXCEEDED, its
    connection ended by the server UNAVAILABLE; its NOT_FOUND passes
    unchanged; a stale token is ABORTED."""
    handlers_errors_story(answering_store, fence_db, "pyfence-errors")


async def test_s7_s8_the_aio_interceptor_answers_database_trouble_unavailable_and_a_bug_not(
    fence_db: str, async_answering_store: str
) -> None:
    """S7, S8, as above, on a grpc.aio server."""
    await asyncio.to_thread(
        handlers_errors_story, async_answering_store, fence_db, "pyafence-errors"
    )
