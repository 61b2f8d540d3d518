"""Fencing for Python resources (DESIGN S7, §5), as src/guarded/interceptor.ts
does it for TypeScript ones: a grpc server interceptor (blocking and aio)
that reads the three fencing headers, runs the ``leasehold_fence`` SQL
function of migrations/fence in the resource's own PostgreSQL (psycopg 3) in
a transaction, and runs the handler inside that transaction, so the
handler's writes commit together with the check or not at all. A
``CheckFence`` call alone is not atomic with the write; this is.

A refusal is ABORTED with the guarded store's details (ErrorInfo reason
``STALE_FENCING_TOKEN``, metadata ``presented_token`` and ``highest_token``);
bad or missing headers are INVALID_ARGUMENT naming the header.

Given the lease server (``leases=``, a LeaseClient), the interceptor runs
the guarded store's grant check (src/guarded/live-check.ts): a call whose
token would raise the session's fence must present the newest token the
lease server granted for that session (``CheckFence``), so nobody who
reaches the service can poison a fence with 2^63−1. ``live=`` checks every
call instead (live mode).

Errors are classified as the TypeScript interceptor does
(src/postgres/database-errors.ts), wherever they happened, in the fence
check or in the handler: database trouble (a lock timeout, a serialization
failure or deadlock, a server shutting down or refusing connections, a
standby, a lost connection) is UNAVAILABLE with ErrorInfo
``DATABASE_UNAVAILABLE`` (metadata ``sql_state``), a statement timeout
DEADLINE_EXCEEDED: retrying may succeed. The handler's own status
(``context.abort``) passes unchanged; any other error (a unique violation, a
syntax error, a bug) propagates, and grpc answers UNKNOWN: retrying cannot help.

Without gRPC, :func:`fenced_write` does a fenced write in one transaction::

    with psycopg.connect(url) as conn, fenced_write(conn, key, token) as tx:
        tx.connection.execute("UPDATE documents SET body = %s WHERE …", (body,))

Needs the ``fence`` extra (``pip install 'leasehold[fence]'``).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
)
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import grpc.aio
import psycopg
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ._metadata import ACCOUNT_ID_HEADER, FENCING_TOKEN_HEADER, SESSION_ID_HEADER
from .errors import (
    DATABASE_UNAVAILABLE,
    ERROR_DOMAIN,
    INVALID_ARGUMENT,
    STALE_FENCING_TOKEN,
    InvalidArgumentError,
    LeaseholdError,
    LeaseNotHeldError,
    StaleFencingTokenError,
    UnavailableError,
)
from .types import CheckFenceResult, SessionKey

# grpc-stubs makes the interceptor bases generic; at run time they are not.
if TYPE_CHECKING:
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
    _AioServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.ServerInterceptor
    _AioServerInterceptor = grpc.aio.ServerInterceptor

#: The SQLSTATE ``leasehold_fence`` raises for a stale token (DETAIL: the highest token).
STALE_TOKEN_SQLSTATE = "LHF01"
MAX_TOKEN = 9_223_372_036_854_775_807
MAX_ID_LENGTH = 128
_ID = re.compile(r"^[A-Za-z0-9._:@+=-]+$")
_TOKEN = re.compile(r"^\d{1,19}$")


@dataclass(frozen=True, slots=True)
class FenceClaim:
    """The session and token a request claims to write with."""

    key: SessionKey
    token: int


@dataclass(frozen=True, slots=True)
class FencedCall:
    """What a fenced handler finds in :func:`current_fenced_call`."""

    claim: FenceClaim
    #: The highest token seen for the session once this call's token passed.
    highest_token: int
    #: The connection whose open transaction ran the check (the session's
    #: fence row is locked until it ends): make the guarded writes on it.
    connection: Any


_current: contextvars.ContextVar[FencedCall | None] = contextvars.ContextVar(
    "leasehold_fenced_call", default=None
)


def current_fenced_call() -> FencedCall:
    """The fenced call being handled (inside a handler the interceptor guards)."""
    call = _current.get()
    if call is None:
        raise RuntimeError("no fenced call: the fencing interceptor did not run for this handler")
    return call


def _clip(text: str) -> str:
    return text if len(text) <= 40 else text[:40] + "…"


def _check_id(name: str, value: str, max_length: int) -> str:
    if not value:
        raise InvalidArgumentError(f"{name}: is required", name, "is required")
    if len(value) > max_length:
        rule = f"must be at most {max_length} characters, got {len(value)}"
        raise InvalidArgumentError(f"{name}: {rule}", name, rule)
    if not _ID.match(value):
        rule = "may contain only letters, digits and . _ : @ + = -"
        raise InvalidArgumentError(f"{name}: {rule}", name, rule)
    return value


def read_fence_claim(
    metadata: Iterable[tuple[str, str | bytes]] | None, max_id_length: int = MAX_ID_LENGTH
) -> FenceClaim:
    """Reads and checks the three fencing headers; InvalidArgumentError names the header."""
    values: dict[str, str] = {}
    for name, value in metadata or ():
        if isinstance(value, str):
            values.setdefault(name.lower(), value)
    text = values.get(FENCING_TOKEN_HEADER, "")
    if not text:
        raise InvalidArgumentError(
            f"{FENCING_TOKEN_HEADER}: is required", FENCING_TOKEN_HEADER, "is required"
        )
    if not _TOKEN.match(text) or int(text) > MAX_TOKEN:
        rule = f"must be a decimal int64 fencing token, got {_clip(text)!r}"
        raise InvalidArgumentError(f"{FENCING_TOKEN_HEADER}: {rule}", FENCING_TOKEN_HEADER, rule)
    token = int(text)
    if token <= 0:
        rule = f"must be a positive fencing token, got {token}"
        raise InvalidArgumentError(f"{FENCING_TOKEN_HEADER}: {rule}", FENCING_TOKEN_HEADER, rule)
    account = _check_id(ACCOUNT_ID_HEADER, values.get(ACCOUNT_ID_HEADER, ""), max_id_length)
    session = _check_id(SESSION_ID_HEADER, values.get(SESSION_ID_HEADER, ""), max_id_length)
    return FenceClaim(SessionKey(account, session), token)


def _fence_error(error: psycopg.Error, token: int) -> Exception:
    diag = error.diag
    if error.sqlstate == STALE_TOKEN_SQLSTATE and (diag.message_detail or "").isdigit():
        return _stale(token, int(diag.message_detail or "0"))
    return error


_FENCE_SQL = "SELECT leasehold_fence(%s, %s, %s)"


def fence(conn: psycopg.Connection[Any], key: SessionKey, token: int) -> int:
    """S7: accepts ``token`` for ``key`` when it is at least the highest this
    resource has seen, records it and returns the new highest; otherwise
    raises StaleFencingTokenError. Call it inside the write's transaction,
    before the write: the session's fence row stays locked until it ends."""
    if token <= 0:
        rule = f"must be a positive fencing token, got {token}"
        raise InvalidArgumentError(f"fencing_token: {rule}", "fencing_token", rule)
    try:
        row = conn.execute(_FENCE_SQL, (key.account_id, key.session_id, token)).fetchone()
    except psycopg.Error as error:
        raise _fence_error(error, token) from error
    if row is None:
        raise RuntimeError("leasehold_fence returned no row")
    return int(row[0])


async def fence_async(conn: psycopg.AsyncConnection[Any], key: SessionKey, token: int) -> int:
    """:func:`fence` on an asyncio connection."""
    if token <= 0:
        rule = f"must be a positive fencing token, got {token}"
        raise InvalidArgumentError(f"fencing_token: {rule}", "fencing_token", rule)
    try:
        cursor = await conn.execute(_FENCE_SQL, (key.account_id, key.session_id, token))
        row = await cursor.fetchone()
    except psycopg.Error as error:
        raise _fence_error(error, token) from error
    if row is None:
        raise RuntimeError("leasehold_fence returned no row")
    return int(row[0])


@contextmanager
def fenced_write(
    conn: psycopg.Connection[Any], key: SessionKey, token: int
) -> Iterator[FencedCall]:
    """One transaction: the fence check, then the block's writes on
    ``conn``. Commits when the block ends, rolls back when it raises; a
    stale token raises StaleFencingTokenError before the block runs."""
    with conn.transaction():
        highest = fence(conn, key, token)
        yield FencedCall(FenceClaim(key, token), highest, conn)


@asynccontextmanager
async def fenced_write_async(
    conn: psycopg.AsyncConnection[Any], key: SessionKey, token: int
) -> AsyncIterator[FencedCall]:
    """:func:`fenced_write` on an asyncio connection."""
    async with conn.transaction():
        highest = await fence_async(conn, key, token)
        yield FencedCall(FenceClaim(key, token), highest, conn)


_HIGHEST_SQL = (
    "SELECT highest_token FROM leasehold_fences WHERE account_id = %s AND session_id = %s"
)


def _idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def highest_seen(conn: psycopg.Connection[Any], key: SessionKey) -> int:
    """The highest token this resource has seen for ``key`` (0 when none).
    A plain read, no lock: on a connection that was idle, the transaction
    the read opened is ended, so nothing stays open across what comes next
    (the grant check's call to the lease server)."""
    idle = _idle(conn)
    row = conn.execute(_HIGHEST_SQL, (key.account_id, key.session_id)).fetchone()
    if idle and not _idle(conn):
        conn.rollback()
    return int(row[0]) if row is not None else 0


async def highest_seen_async(conn: psycopg.AsyncConnection[Any], key: SessionKey) -> int:
    """:func:`highest_seen` on an asyncio connection."""
    idle = _idle(conn)
    cursor = await conn.execute(_HIGHEST_SQL, (key.account_id, key.session_id))
    row = await cursor.fetchone()
    if idle and not _idle(conn):
        await conn.rollback()
    return int(row[0]) if row is not None else 0


class FenceChecker(Protocol):
    """What the grant check needs of the lease server: LeaseClient's
    ``check_fence``."""

    def check_fence(
        self, key: SessionKey, fencing_token: int, *, timeout: timedelta | float | None = None
    ) -> CheckFenceResult: ...


class AsyncFenceChecker(Protocol):
    """:class:`FenceChecker` of the asyncio interceptor: AsyncLeaseClient's
    ``check_fence``."""

    async def check_fence(
        self, key: SessionKey, fencing_token: int, *, timeout: timedelta | float | None = None
    ) -> CheckFenceResult: ...


def _unconfirmed(error: LeaseholdError) -> UnavailableError:
    # Whatever the lease server said (its UNAUTHENTICATED between the two
    # servers too), the token could not be confirmed; the caller may retry.
    return UnavailableError(
        f"the lease server could not confirm the fencing token: {error.message}"
    )


def _grant_verdict(highest: int, token: int) -> None:
    """The grant check's answer: ``token`` must be the newest token granted
    for the session, valid lease or not. One below it belongs to a replaced
    run (stale); one above it was never granted (LEASE_NOT_HELD not_found)."""
    if highest == token:
        return
    if highest > token:
        raise _stale(token, highest)
    raise LeaseNotHeldError(
        f"lease not held: fencing token {token} was never granted for this session "
        f"(the newest grant is {highest})",
        "not_found",
    )


def _stale(token: int, highest: int) -> StaleFencingTokenError:
    return StaleFencingTokenError(
        f"fencing token {token} is stale: the highest token seen is {highest}",
        token,
        highest,
        {"presented_token": str(token), "highest_token": str(highest)},
    )


def grant_check(leases: FenceChecker, key: SessionKey, token: int, timeout: float = 2.0) -> None:
    """The grant check alone: raises unless ``token`` is the newest token the
    lease server (``leases``) granted for ``key``; UnavailableError when it
    cannot answer. The interceptor asks it only for a token above the
    highest the resource has seen (:func:`highest_seen`)."""
    try:
        answer = leases.check_fence(key, token, timeout=timeout)
    except LeaseholdError as error:
        raise _unconfirmed(error) from error
    _grant_verdict(answer.highest_token, token)


async def grant_check_async(
    leases: AsyncFenceChecker, key: SessionKey, token: int, timeout: float = 2.0
) -> None:
    """:func:`grant_check` with an AsyncLeaseClient."""
    try:
        answer = await leases.check_fence(key, token, timeout=timeout)
    except LeaseholdError as error:
        raise _unconfirmed(error) from error
    _grant_verdict(answer.highest_token, token)


def live_check(client: Any, timeout: float = 2.0) -> Callable[[SessionKey, int], None]:
    """Live mode for the blocking interceptor: also asks the lease server
    (``client``, a LeaseClient with the fence scope) that the token is the
    valid lease's, so a holder whose lease expired is refused even when
    nobody replaced it."""

    def check(key: SessionKey, token: int) -> None:
        try:
            answer = client.check_fence(key, token, timeout=timeout)
        except LeaseholdError as error:
            raise _unconfirmed(error) from error
        _live_verdict(answer.current, answer.highest_token, token)

    return check


def _live_verdict(current: bool, highest: int, token: int) -> None:
    if current:
        return
    if highest > token:
        raise _stale(token, highest)
    cause = "expired" if highest == token else "not_found"
    raise LeaseNotHeldError(f"lease not held: {cause}", cause)


def _status_of(error: LeaseholdError) -> status_pb2.Status:
    """The google.rpc.Status a guarded store answers for ``error``."""
    if isinstance(error, StaleFencingTokenError):
        info = error_details_pb2.ErrorInfo(
            reason=STALE_FENCING_TOKEN,
            domain=ERROR_DOMAIN,
            metadata={"presented_token": str(error.presented), "highest_token": str(error.highest)},
        )
        return _status(grpc.StatusCode.ABORTED, error.message, [info])
    if isinstance(error, InvalidArgumentError):
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=error.field, description=error.rule
                )
            ]
        )
        info = error_details_pb2.ErrorInfo(
            reason=INVALID_ARGUMENT, domain=ERROR_DOMAIN, metadata={"field": error.field}
        )
        return _status(grpc.StatusCode.INVALID_ARGUMENT, error.message, [bad, info])
    if isinstance(error, LeaseholdError):
        details = []
        if error.reason:
            details.append(
                error_details_pb2.ErrorInfo(
                    reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
                )
            )
    return _status(error.code, error.message, details)


# SQLSTATEs that mean "the database cannot answer right now", as opposed to a
# bug in a statement: the set of src/postgres/database-errors.ts.
_UNAVAILABLE_STATES = frozenset(
    {
        "55P03",  # lock_not_available: lock_timeout (S8)
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "53300",  # too_many_connections
        "25P03",  # idle_in_transaction_session_timeout
        "25006",  # read_only_sql_transaction: a standby, or a primary being demoted
    }
)
_STATEMENT_TIMEOUT = "57014"


def _database_trouble(error: psycopg.Error) -> status_pb2.Status | None:
    """The answer for a psycopg error that is database trouble (retrying may
    succeed), or None for one that is a bug (retrying cannot help)."""
    state = error.sqlstate
    if state == _STATEMENT_TIMEOUT:
        return _status(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"the database statement timed out: {error}", []
        )
    # An OperationalError without a SQLSTATE is the connection failing
    # (refused, lost, a pool timeout), not the server rejecting a statement.
    lost = state is None and isinstance(error, psycopg.OperationalError)
    if not (lost or state in _UNAVAILABLE_STATES or (state or "").startswith("08")):
        return None
    info = error_details_pb2.ErrorInfo(
        reason=DATABASE_UNAVAILABLE, domain=ERROR_DOMAIN, metadata={"sql_state": state or ""}
    )
    return _status(
        grpc.StatusCode.UNAVAILABLE,
        f"the database is unavailable ({state or 'connection'}): {error}",
        [info],
    )


def _status(code: grpc.StatusCode, message: str, details: list[Any]) -> status_pb2.Status:
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        packed.append(item)
    return status_pb2.Status(code=code.value[0], message=message, details=packed)


Fenced = Callable[[grpc.HandlerCallDetails], bool]


def _is_fenced(fenced: Fenced | None, details: grpc.HandlerCallDetails) -> bool:
    return fenced is None or fenced(details)


def _not_unary(details: grpc.HandlerCallDetails) -> status_pb2.Status:
    return _status(
        grpc.StatusCode.UNIMPLEMENTED,
        f"{details.method} is not unary: the fencing interceptor cannot guard it",
        [],
    )


class FencingInterceptor(_ServerInterceptor):
    """A blocking grpc server interceptor fencing unary methods.

    ``connection`` returns a context manager yielding a psycopg connection
    of the resource's database (where migrations/fence/0001_fence.sql is
    applied), e.g. ``pool.connection`` of psycopg_pool or
    ``lambda: psycopg.connect(url)``. ``fenced`` picks the methods that need
    a token (default: all).

    ``leases`` (a LeaseClient, whose token needs the lease server's fence
    scope for sessions of other accounts) turns on the grant check: a call
    whose token is above the highest this resource has seen for the session
    is first confirmed with ``CheckFence`` (it must be the newest token
    granted for the session: a higher one is FAILED_PRECONDITION
    LEASE_NOT_HELD ``not_found``, a lower one ABORTED STALE_FENCING_TOKEN);
    UNAVAILABLE, and nothing written, while the lease server cannot answer
    (each ``CheckFence`` waits at most ``lease_timeout`` seconds). Calls at
    or below that highest need no call and go on. Without ``leases`` (or
    ``live``) the interceptor trusts the token in the headers: whoever
    reaches the service can raise a fence to any number. ``live`` (see
    :func:`live_check`) checks every call instead (live mode). Both are
    asked before the transaction, so no row lock is held across a network
    call.
    """

    def __init__(
        self,
        connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
        *,
        fenced: Fenced | None = None,
        leases: FenceChecker | None = None,
        lease_timeout: float = 2.0,
        live: Callable[[SessionKey, int], None] | None = None,
        max_id_length: int = MAX_ID_LENGTH,
    ) -> None:
        self._connection = connection
        self._fenced = fenced
        self._leases = leases
        self._lease_timeout = lease_timeout
        self._live = live
        self._max_id_length = max_id_length

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or not _is_fenced(self._fenced, handler_call_details):
            return handler
        if handler.unary_unary is None:
            refusal = _not_unary(handler_call_details)

            def refuse(request: Any, context: grpc.ServicerContext) -> Any:
                context.abort_with_status(rpc_status.to_status(refusal))

            return grpc.unary_unary_rpc_method_handler(refuse)
        behavior = handler.unary_unary

        def handle(
            conn: psycopg.Connection[Any], claim: FenceClaim, request: Any, context: Any
        ) -> Any:
            with fenced_write(conn, claim.key, claim.token) as call:
                token = _current.set(FencedCall(claim, call.highest_token, call.connection))
                try:
                    return behavior(request, context)
                finally:
                    _current.reset(token)

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                claim = read_fence_claim(context.invocation_metadata(), self._max_id_length)
                if self._live is not None:
                    self._live(claim.key, claim.token)
                elif self._leases is not None:
                    with self._connection() as conn:
                        if claim.token <= highest_seen(conn, claim.key):
                            return handle(conn, claim, request, context)
                    # The connection went back first: none is held across the call.
                    grant_check(self._leases, claim.key, claim.token, self._lease_timeout)
                with self._connection() as conn:
                    return handle(conn, claim, request, context)
            except LeaseholdError as error:
                context.abort_with_status(rpc_status.to_status(_status_of(error)))
            except psycopg.Error as error:
                trouble = _database_trouble(error)
                if trouble is None:
                    raise
                context.abort_with_status(rpc_status.to_status(trouble))

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class AsyncFencingInterceptor(_AioServerInterceptor):
    """The :class:`FencingInterceptor` of a ``grpc.aio`` server.

    ``connection`` returns an async context manager yielding a
    ``psycopg.AsyncConnection`` (``pool.connection`` of psycopg_pool's
    AsyncConnectionPool, or an ``asynccontextmanager`` around
    ``await psycopg.AsyncConnection.connect(url)``); ``leases`` is an
    AsyncLeaseClient (the grant check), ``live`` an async callable, if given.
    """

    def __init__(
        self,
        connection: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]],
        *,
        fenced: Fenced | None = None,
        leases: AsyncFenceChecker | None = None,
        lease_timeout: float = 2.0,
        live: Callable[[SessionKey, int], Awaitable[None]] | None = None,
        max_id_length: int = MAX_ID_LENGTH,
    ) -> None:
        self._connection = connection
        self._fenced = fenced
        self._leases = leases
        self._lease_timeout = lease_timeout
        self._live = live
        self._max_id_length = max_id_length

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or not _is_fenced(self._fenced, handler_call_details):
            return handler
        if handler.unary_unary is None:
            refusal = _not_unary(handler_call_details)

            async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await _abort(context, refusal)

            return grpc.unary_unary_rpc_method_handler(refuse)
        # grpc-stubs types every handler as blocking; an aio server's are coroutines.
        behavior: Any = handler.unary_unary

        async def handle(
            conn: psycopg.AsyncConnection[Any], claim: FenceClaim, request: Any, context: Any
        ) -> Any:
            async with fenced_write_async(conn, claim.key, claim.token) as call:
                token = _current.set(FencedCall(claim, call.highest_token, call.connection))
                try:
                    return await behavior(request, context)
                finally:
                    _current.reset(token)

        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                claim = read_fence_claim(context.invocation_metadata(), self._max_id_length)
                if self._live is not None:
                    await self._live(claim.key, claim.token)
                elif self._leases is not None:
                    async with self._connection() as conn:
                        if claim.token <= await highest_seen_async(conn, claim.key):
                            return await handle(conn, claim, request, context)
                    # The connection went back first: none is held across the call.
                    await grant_check_async(
                        self._leases, claim.key, claim.token, self._lease_timeout
                    )
                async with self._connection() as conn:
                    return await handle(conn, claim, request, context)
            except LeaseholdError as error:
                await _abort(context, _status_of(error))
            except psycopg.Error as error:
                trouble = _database_trouble(error)
                if trouble is None:
                    raise
                await _abort(context, trouble)

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def _abort(context: grpc.aio.ServicerContext[Any, Any], status: status_pb2.Status) -> None:
    code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
    await context.abort(
        code,
        status.message,
        trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),),
    )
