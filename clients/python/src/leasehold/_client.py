"""What the blocking and the asyncio client share, doing no I/O:
configuration, one unary call per RPC (``rpc``: request, deadline and
result, written once for both clients), and a held lease's state and
accessors behind the client's guard (httpx's ``BaseClient``).

``client.py`` and ``aio.py`` add the I/O: channels, sending a ``Call``
(``_send``), streams, timers, and waiting. The guard hook is ``_guard()``:
the blocking client's reentrant lock, which its timer and stream threads
hold while they call in; nothing for the asyncio client, whose callbacks
all run on its one event loop.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import logging
import time
from collections.abc import Callable, Coroutine, Generator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    TypedDict,
    TypeVar,
    overload,
)

import grpc

from ._core import (
    Grant,
    HoldCore,
    KeepAliveChannel,
    KeepAliveEvent,
    LeaseTiming,
    OnEnd,
    OnMessage,
    SendAcquire,
    Stream,
    Timer,
    grant_of,
    lease_timing,
    release_timeout,
)
from ._failover import Answered, Pause, Send, failover_flow
from ._gen.leasehold.v1 import lease_pb2, lease_pb2_grpc
from ._keeper import KeeperCore, KeeperLease, KeepStream, OnKeepEnd, OnKeepMessage
from ._metadata import Auth, Metadata, Token, fencing_metadata
from ._tls import ClientTls, credentials_of
from .errors import DeadlineExceededError, LeaseholdError, LeaseLostError
from .types import (
    CheckFenceResult,
    GetResult,
    HandoffRequest,
    HandoffResult,
    HistoryResult,
    Lease,
    ListResult,
    ReleaseFailure,
    RevokeKeeperResult,
    RevokeResult,
    SessionKey,
    acquire_result,
    as_key,
    as_timedelta,
    check_fence_result,
    duration,
    get_result,
    handoff_result,
    history_result,
    lease_from,
    list_result,
    normalize_run_id,
    release_result,
    renew_result,
    revoke_keeper_result,
    revoke_result,
    seconds,
)

if TYPE_CHECKING:
    from ._election import BaseLeadership, BaseObserver
    from .aio import AsyncLeaseClient
    from .client import LeaseClient
    from .types import AcquireResult, Leader, StopReason

log = logging.getLogger("leasehold")

DEFAULT_TIMEOUT = 10.0

# A fresh connection per KeepAlive stream: grpc shares subchannels between
# channels of the same target, and a stalled connection would stall the
# reopened stream too.
FRESH_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]

Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")
P = ParamSpec("P")
HoldT = TypeVar("HoldT", bound="BaseHold")
KeeperT = TypeVar("KeeperT", bound="BaseKeeper[Any]")
KeeperHoldT = TypeVar("KeeperHoldT", bound="BaseKeeperHold")
LeadershipT = TypeVar("LeadershipT", bound="BaseLeadership[Any]")
ObserverT = TypeVar("ObserverT", bound="BaseObserver")


class HoldOptions(TypedDict, total=False):
    """The keyword arguments of ``hold()``, which ``run_exclusive`` passes on."""

    ttl: timedelta | float
    wait: timedelta | float | None
    holder: str | None
    run_id: str | None
    safety_margin: timedelta | float | None
    renew_interval: timedelta | float | None


@dataclass(frozen=True, slots=True)
class ClientRuntime:
    """What a client's KeepAlive channel and holds run on (``_core.Runtime``):
    the monotonic clock, and the client's own timers and streams."""

    call_later: Callable[[float, Callable[[], None]], Timer]
    open_stream: Callable[[str, OnMessage, OnEnd], Stream]
    #: A Keep stream (a keeper's), over a fresh connection as a KeepAlive stream's.
    open_keep: Callable[[str, OnKeepMessage, OnKeepEnd], KeepStream]

    def now(self) -> float:
        return time.monotonic()


def normalize_addresses(addresses: str | Sequence[str]) -> list[str]:
    """``host:port`` targets; an ``http://`` or ``https://`` prefix is dropped."""
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            for prefix in ("http://", "https://", "grpc://"):
                part = part.removeprefix(prefix)
            part = part.rstrip("/")
            if not part:
                continue
            if ":" not in part:
                raise ValueError(f"server address must be host:port, got {item!r}")
            out.append(part)
    if not out:
        raise ValueError("at least one server address (host:port) is required")
    return out


def acquire_request(
    key: SessionKey,
    run_id: str,
    ttl: timedelta | float,
    wait: timedelta | float | None,
    holder: str,
) -> lease_pb2.AcquireRequest:
    request = lease_pb2.AcquireRequest(
        key=key.to_proto(), run_id=run_id, ttl=duration(as_timedelta("ttl", ttl)), holder=holder
    )
    wait_s = seconds("wait", wait)
    if wait_s is not None and wait_s > 0:
        request.wait.CopyFrom(duration(timedelta(seconds=wait_s)))
    return request


def release_request(key: SessionKey, run_id: str) -> lease_pb2.ReleaseRequest:
    return lease_pb2.ReleaseRequest(key=key.to_proto(), run_id=run_id)


@dataclass(frozen=True, slots=True)
class Call(Generic[Request, Response, Result]):
    """One unary call of LeaseService, as both clients send it."""

    #: The RPC's name: the failover plan (``_failover.attempt_plan``) and errors use it.
    name: str
    #: The stub's method for it (``grpc.aio``'s of the same name for the asyncio client).
    method: Callable[
        [lease_pb2_grpc.LeaseServiceStub], grpc.UnaryUnaryMultiCallable[Request, Response]
    ]
    request: Request
    #: What the response becomes for the caller.
    result: Callable[[Response], Result]
    #: The call's one deadline, every attempt included (None: the client's).
    timeout: float | None = None


def _same(response: Response) -> Response:
    return response


class rpc(Generic[P, Result]):
    """A method of ``BaseClient`` describing one unary call (a ``Call``)
    becomes that RPC's method of both clients: ``LeaseClient`` sends the
    call and returns its result, ``AsyncLeaseClient`` returns a coroutine
    of it. Wrapping a new RPC is one such method."""

    def __init__(self, describe: Callable[Concatenate[Any, P], Call[Any, Any, Result]]) -> None:
        self.describe = describe
        self.__doc__ = describe.__doc__
        self.__name__ = describe.__name__

        def unbound(client: BaseClient[Any, Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
            return client._bind(describe)(*args, **kwargs)

        # Read on the class (help(), inspect), an unbound method's parameters.
        self._unbound = _presented(unbound, describe, inspect.signature(describe))

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Callable[..., Any]: ...

    @overload
    def __get__(self, client: LeaseClient, owner: type[Any]) -> Callable[P, Result]: ...

    @overload
    def __get__(
        self, client: AsyncLeaseClient, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, Result]]: ...

    def __get__(self, client: BaseClient[Any, Any, Any, Any] | None, owner: type[Any]) -> Any:
        if client is None:
            return self._unbound
        signature = inspect.signature(functools.partial(self.describe, client))
        return _presented(client._bind(self.describe), self.describe, signature)


def _presented(
    method: Callable[..., Any], describe: Callable[..., Any], signature: inspect.Signature
) -> Callable[..., Any]:
    """``method`` named and documented as ``describe``, with its parameters;
    it returns the call's result, not the Call."""
    functools.update_wrapper(method, describe)
    del method.__wrapped__  # type: ignore[attr-defined]
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        return_annotation=inspect.Signature.empty
    )
    return method


class BaseClient(Generic[HoldT, KeeperT, LeadershipT, ObserverT]):
    """The no-I/O half of ``LeaseClient`` and ``AsyncLeaseClient``."""

    _hold_type: type[HoldT]
    _keeper_type: type[KeeperT]
    _leadership_type: type[LeadershipT]
    _observer_type: type[ObserverT]

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: Token = None,
        root_certificates: bytes | None = None,
        tls: ClientTls | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        max_leases_per_stream: int = 1000,
        on_event: Callable[[KeepAliveEvent], None] | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.addresses = normalize_addresses(addresses)
        self._auth = Auth(token)
        self._tls = credentials_of(tls, root_certificates)
        # The credentials' generation the unary channels were made with.
        self._tls_generation = self._tls.current()[0] if self._tls is not None else 0
        self._timeout = seconds("timeout", timeout) or DEFAULT_TIMEOUT
        self._options = list(channel_options)
        self._preferred = 0
        self._closed = False
        self._holds: set[HoldT] = set()
        self._keepers: set[KeeperT] = set()
        self._runtime = self._open_runtime()
        self._keepalive = KeepAliveChannel(
            self._runtime,
            self.addresses,
            max_leases_per_stream=max_leases_per_stream,
            # A stream ended at its certificate's expiry reopens with the
            # files read again, as one ended at its token's with a fresh token.
            refreshable_token=self._auth.refreshable
            or (token is None and self._tls is not None and self._tls.presents_certificate),
            on_event=on_event,
        )

    # The I/O half's hooks

    def _open_runtime(self) -> ClientRuntime:
        """Sets up the client's own I/O state; the runtime its KeepAlive
        channel and holds run on (clock, timers, streams)."""
        raise NotImplementedError

    def _guard(self) -> AbstractContextManager[object]:
        """Held around every use of the shared state (holds, the KeepAlive channel)."""
        raise NotImplementedError

    def _bind(self, describe: Callable[..., Call[Any, Any, Any]]) -> Callable[..., Any]:
        """The public method of an ``rpc``: sends the call ``describe`` makes."""
        raise NotImplementedError

    def _stub(self, address: str) -> Any:
        """The LeaseService stub of ``address`` (``grpc``'s, or ``grpc.aio``'s)."""
        raise NotImplementedError

    def _make_channel(self, address: str, *, fresh: bool = False) -> Any:
        """A channel to ``address`` (``grpc``'s, or ``grpc.aio``'s)."""
        raise NotImplementedError

    def _open_keepalive(
        self, address: str, requests: Any, method: str = "KeepAlive"
    ) -> tuple[Any, Any]:
        """A KeepAlive (or a keeper's Keep) stream of ``requests`` over a
        fresh channel: the channel and the call."""
        metadata = self._auth.metadata()
        channel = self._make_channel(address, fresh=True)
        stub = lease_pb2_grpc.LeaseServiceStub(channel)
        return channel, getattr(stub, method)(requests, metadata=metadata)

    def _channel_options(self, fresh: bool) -> list[tuple[str, Any]]:
        """The channel's options; ``fresh``: a connection of its own (a KeepAlive stream's)."""
        return [*self._options, *FRESH_CONNECTION] if fresh else list(self._options)

    def _failover(
        self, call: Call[Request, Response, Any]
    ) -> Generator[Pause | Send, Response | None, Answered[Response]]:
        """The call's attempts across the instances, within its one deadline."""
        limit = call.timeout if call.timeout is not None else self._timeout
        return failover_flow(call.name, call.request, self.addresses, self._preferred, limit)

    def _answered(self, call: Call[Any, Response, Result], answered: Answered[Response]) -> Result:
        """The call's result; the instance that answered is tried first next time."""
        self._preferred = answered.index
        return call.result(answered.response)

    def _metadata(self) -> Metadata:
        """The call's outgoing metadata; raises when the client is closed."""
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._auth.metadata()

    # LeaseService, one method per unary RPC

    @rpc
    def acquire(
        self,
        key: SessionKey,
        *,
        ttl: timedelta | float,
        wait: timedelta | float | None = None,
        holder: str = "",
        run_id: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> Call[lease_pb2.AcquireRequest, lease_pb2.AcquireResponse, AcquireResult]:
        """Acquire once (no renewals). A random run id is chosen when none is
        given, so a retry of this request is idempotent (same token)."""
        request = acquire_request(as_key(key), normalize_run_id(run_id), ttl, wait, holder)
        limit = seconds("timeout", timeout) or self._timeout + (seconds("wait", wait) or 0)
        return Call("Acquire", lambda stub: stub.Acquire, request, acquire_result, limit)

    @rpc
    def renew(
        self,
        key: SessionKey,
        run_id: str,
        *,
        ttl: timedelta | float | None = None,
        timeout: timedelta | float | None = None,
    ) -> Call[lease_pb2.RenewRequest, lease_pb2.RenewResponse, Lease]:
        """Renews the run's lease once (``hold()`` renews on its own)."""
        request = lease_pb2.RenewRequest(
            key=as_key(key).to_proto(), run_id=normalize_run_id(run_id)
        )
        if ttl is not None:
            request.ttl.CopyFrom(duration(as_timedelta("ttl", ttl)))
        return Call("Renew", lambda stub: stub.Renew, request, renew_result, _limit(timeout))

    @rpc
    def release(
        self, key: SessionKey, run_id: str, *, timeout: timedelta | float | None = None
    ) -> Call[lease_pb2.ReleaseRequest, lease_pb2.ReleaseResponse, bool]:
        """Ends the run's lease: True when it was held, False when there was nothing to end."""
        request = release_request(as_key(key), normalize_run_id(run_id))
        return Call("Release", lambda stub: stub.Release, request, release_result, _limit(timeout))

    @rpc
    def get(
        self, key: SessionKey, *, timeout: timedelta | float | None = None
    ) -> Call[lease_pb2.GetRequest, lease_pb2.GetResponse, GetResult]:
        """The authoritative state of one session."""
        request = lease_pb2.GetRequest(key=as_key(key).to_proto())
        return Call("Get", lambda stub: stub.Get, request, get_result, _limit(timeout))

    @rpc
    def list(
        self,
        account_id: str,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: timedelta | float | None = None,
    ) -> Call[lease_pb2.ListRequest, lease_pb2.ListResponse, ListResult]:
        """The valid leases of one account, a page at a time."""
        request = lease_pb2.ListRequest(
            account_id=account_id, page_size=page_size, page_token=page_token
        )
        return Call("List", lambda stub: stub.List, request, list_result, _limit(timeout))

    @rpc
    def request_handoff(
        self,
        key: SessionKey,
        *,
        requester_holder: str = "",
        reason: str = "",
        timeout: timedelta | float | None = None,
    ) -> Call[lease_pb2.RequestHandoffRequest, lease_pb2.RequestHandoffResponse, HandoffResult]:
        """Asks the session's holder to finish and release (nothing is taken away)."""
        request = lease_pb2.RequestHandoffRequest(
            key=as_key(key).to_proto(), requester_holder=requester_holder, reason=reason
        )
        return Call(
            "RequestHandoff",
            lambda stub: stub.RequestHandoff,
            request,
            handoff_result,
            _limit(timeout),
        )

    @rpc
    def history(
        self,
        key: SessionKey,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: timedelta | float | None = None,
    ) -> Call[lease_pb2.HistoryRequest, lease_pb2.HistoryResponse, HistoryResult]:
        """The session's audit trail, newest first."""
        request = lease_pb2.HistoryRequest(
            key=as_key(key).to_proto(), page_size=page_size, page_token=page_token
        )
        return Call("History", lambda stub: stub.History, request, history_result, _limit(timeout))

    @rpc
    def check_fence(
        self, key: SessionKey, fencing_token: int, *, timeout: timedelta | float | None = None
    ) -> Call[lease_pb2.CheckFenceRequest, lease_pb2.CheckFenceResponse, CheckFenceResult]:
        """Whether ``fencing_token`` is the session's valid lease's, and the highest granted."""
        request = lease_pb2.CheckFenceRequest(
            key=as_key(key).to_proto(), fencing_token=fencing_token
        )
        return Call(
            "CheckFence", lambda stub: stub.CheckFence, request, check_fence_result, _limit(timeout)
        )

    @rpc
    def revoke(
        self, key: SessionKey, *, reason: str, timeout: timedelta | float | None = None
    ) -> Call[lease_pb2.RevokeRequest, lease_pb2.RevokeResponse, RevokeResult]:
        """Ends the session's valid lease whatever its run (admin scope; audited)."""
        request = lease_pb2.RevokeRequest(key=as_key(key).to_proto(), reason=reason)
        return Call("Revoke", lambda stub: stub.Revoke, request, revoke_result, _limit(timeout))

    @rpc
    def revoke_keeper(
        self,
        account_id: str,
        keeper_id: str,
        *,
        reason: str,
        timeout: timedelta | float | None = None,
    ) -> Call[lease_pb2.RevokeKeeperRequest, lease_pb2.RevokeKeeperResponse, RevokeKeeperResult]:
        """Ends a keeper and every lease on it, whatever its holder (admin
        scope; audited; no lock-delay)."""
        request = lease_pb2.RevokeKeeperRequest(
            account_id=account_id, keeper_id=keeper_id, reason=reason
        )
        return Call(
            "RevokeKeeper",
            lambda stub: stub.RevokeKeeper,
            request,
            revoke_keeper_result,
            _limit(timeout),
        )

    @rpc
    def leader(
        self, account_id: str, election: str, *, timeout: timedelta | float | None = None
    ) -> Call[lease_pb2.GetRequest, lease_pb2.GetResponse, Leader | None]:
        """The current leader of an election (value, term, run id), or None
        when nobody leads (a Get of the election's session)."""
        from ._election import leader_result

        request = lease_pb2.GetRequest(key=SessionKey(account_id, election).to_proto())
        return Call("Get", lambda stub: stub.Get, request, leader_result, _limit(timeout))

    def _open_watch(
        self,
        key: SessionKey,
        *,
        include_renewals: bool,
        timeout: timedelta | float | None = None,
    ) -> Any:
        """A Watch call to the instance that answered last (``grpc``'s can
        be cancelled from any thread, ``grpc.aio``'s from the event loop)."""
        request = lease_pb2.WatchRequest(
            key=as_key(key).to_proto(), include_renewals=include_renewals
        )
        stub: Any = self._stub(self.addresses[self._preferred])
        return stub.Watch(
            request, timeout=seconds("timeout", timeout), metadata=self._auth.metadata()
        )

    # Holding a lease

    def hold(
        self,
        key: SessionKey,
        *,
        ttl: timedelta | float = timedelta(seconds=10),
        wait: timedelta | float | None = None,
        holder: str | None = None,
        run_id: str | None = None,
        safety_margin: timedelta | float | None = None,
        renew_interval: timedelta | float | None = None,
    ) -> HoldT:
        """A lease held for a ``with`` block (``async with`` for the asyncio
        client): acquired on entry, kept alive, released on exit (never after
        loss). See :class:`Hold`."""
        return self._hold_type(
            self,
            as_key(key),
            lease_timing(ttl, safety_margin, renew_interval),
            seconds("wait", wait) or 0.0,
            holder or "",
            normalize_run_id(run_id),
        )

    def keeper(
        self,
        account_id: str,
        *,
        ttl: timedelta | float,
        lock_delay: timedelta | float = 0,
        holder: str | None = None,
        keeper_id: str | None = None,
    ) -> KeeperT:
        """A keeper for a ``with`` block (``async with`` for the asyncio
        client): one Keep stream whose heartbeat (every ``ttl``/3) keeps
        every lease held on it (``k.hold(key)``); leaving the block closes
        it, releasing them all. ``lock_delay``: after the keeper *expires*,
        none of its keys is granted to another run before it has passed
        (K2). ``keeper_id``: a UUID (a new one when None). See :class:`Keeper`."""
        ttl_s = seconds("ttl", ttl)
        if ttl_s is None or not ttl_s > 0:
            raise ValueError(f"ttl must be a positive duration, got {ttl!r}")
        delay = seconds("lock_delay", lock_delay) or 0.0
        if delay < 0:
            raise ValueError(f"lock_delay must be at least 0, got {lock_delay!r}")
        if not account_id:
            raise ValueError("account_id must not be empty")
        return self._keeper_type(
            self,
            account_id,
            lease_timing(ttl_s, None, ttl_s * KEEPER_HEARTBEAT_FRACTION),
            delay,
            holder or "",
            normalize_run_id(keeper_id),
        )

    # Leader election (E1)

    def campaign(
        self,
        account_id: str,
        election: str,
        *,
        value: str,
        ttl: timedelta | float | None = None,
        safety_margin: timedelta | float | None = None,
        renew_interval: timedelta | float | None = None,
        keeper: KeeperT | None = None,
        timeout: timedelta | float | None = None,
        wait_chunk: timedelta | float = 60.0,
        on_started_leading: Callable[[int], None] | None = None,
        on_stopped_leading: Callable[[int, StopReason], None] | None = None,
    ) -> LeadershipT:
        """A campaign for a ``with`` block (``async with`` for the asyncio
        client): entering waits (FIFO on the server) until this candidate
        leads the election ``SessionKey(account_id, election)``; leaving
        resigns. ``value`` (at most 64 characters) is advertised as the
        lease's holder label. ``ttl`` (default 10 s), ``safety_margin`` and
        ``renew_interval`` are the leader's lease's, as ``hold()`` takes
        them; on a ``keeper`` the keeper's apply instead (leave them out).
        ``timeout``: give up after this long (NotAcquiredError naming the
        leader); default never. ``wait_chunk``: the longest single waiting
        Acquire (keep it at or below the server's ``--max-wait``); the
        campaign asks again, with the same run id, when one runs out.
        ``on_started_leading(term)`` is called before entering returns;
        ``on_stopped_leading(term, reason)`` exactly once per term, whatever
        ended it. See :class:`Leadership`."""
        return self._leadership_type(
            self,
            account_id,
            election,
            value=value,
            ttl=ttl,
            safety_margin=safety_margin,
            renew_interval=renew_interval,
            keeper=keeper,
            timeout=timeout,
            wait_chunk=wait_chunk,
            run_id=normalize_run_id(None),
            on_started_leading=on_started_leading,
            on_stopped_leading=on_stopped_leading,
        )

    def observe(
        self, account_id: str, election: str, *, reconnect_delay: timedelta | float = 0.1
    ) -> ObserverT:
        """The changes of an election, to iterate (``async for`` for the
        asyncio client): the current leader first, then every change in
        order (``ElectionChange``: elected, proclaimed, ended), without gaps
        across a reconnect or a failover to another instance, until
        ``close()`` (or leaving its ``with`` block). ``reconnect_delay``:
        the first backoff before the Watch opens again (doubling to 2 s,
        jittered). See :class:`ElectionObserver`."""
        delay = seconds("reconnect_delay", reconnect_delay)
        if delay is None or delay < 0:
            raise ValueError(f"reconnect_delay must be at least 0, got {reconnect_delay!r}")
        return self._observer_type(self, SessionKey(account_id, election), delay)

    @staticmethod
    def _release_failures(holds: Sequence[BaseHold]) -> builtins.list[ReleaseFailure]:
        """What ``close()`` returns: the holds whose release failed."""
        return [
            ReleaseFailure(h.key, h.run_id, h.release_error)
            for h in holds
            if h.release_error is not None
        ]

    @property
    def keepalive_streams(self) -> int:
        """KeepAlive streams open now."""
        with self._guard():
            return self._keepalive.open_streams


#: A keeper heartbeats every third of its TTL (docs/keepers.md).
KEEPER_HEARTBEAT_FRACTION = 1 / 3


def _limit(timeout: timedelta | float | None) -> float | None:
    return seconds("timeout", timeout)


class _Flag(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...


class _LeaseState(Protocol):
    """What a hold's body reads: a lease of its own (``HoldCore``) or one
    on a keeper (``KeeperLease``)."""

    @property
    def lease(self) -> lease_pb2.Lease: ...

    def loss_reason(self) -> str | None: ...

    def remaining(self) -> float: ...

    def check(self) -> None: ...


class BaseHold:
    """The no-I/O half of ``Hold`` and ``AsyncHold``: its state, and what the
    body reads, each behind the client's guard."""

    lost: _Flag
    handoff_requested: _Flag
    #: How a body enters the hold, for the error of a hold not entered yet.
    _usage = "with client.hold(key) as h"

    def __init__(
        self,
        client: BaseClient[Any, Any, Any, Any],
        key: SessionKey,
        timing: LeaseTiming,
        wait: float,
        holder: str,
        run_id: str,
    ) -> None:
        self._client = client
        self.key = key
        self.run_id = run_id
        self.holder = holder
        self._timing = timing
        self._wait = wait
        self._core: HoldCore | None = None
        self.fencing_token = 0
        #: Set when the lease is lost (never by the hold's own release).
        self.lost = self._new_flag()
        #: Set when another holder asked for the session (``handoff_requests`` has them).
        self.handoff_requested = self._new_flag()
        self.handoff_requests: list[HandoffRequest] = []
        self._handoff_listeners: list[Callable[[HandoffRequest], None]] = []
        #: The release's answer: True released, False nothing to release, None not sent.
        self.released: bool | None = None
        #: Why the release failed, when it did (the lease then ends at its deadline).
        self.release_error: Exception | None = None
        self._finished = False
        #: True when a waited grant came too late to trust and was confirmed
        #: by an idempotent re-acquire (same run id, same token).
        self.confirmed = False
        #: Told once when the lease is lost (reason, message), after ``lost``
        #: is set: a leadership's term ends there. Called with the guard held.
        self._on_loss: Callable[[str, str], None] | None = None

    def _new_flag(self) -> _Flag:
        raise NotImplementedError

    # Acquiring and releasing, for the I/O half

    def _acquire_call(
        self, step: SendAcquire
    ) -> Call[lease_pb2.AcquireRequest, lease_pb2.AcquireResponse, lease_pb2.AcquireResponse]:
        if step.confirming:
            self.confirmed = True
        request = acquire_request(self.key, self.run_id, self._timing.ttl, step.wait, self.holder)
        limit = step.wait + self._client._timeout
        return Call("Acquire", lambda stub: stub.Acquire, request, _same, limit)

    def _grant(self, response: lease_pb2.AcquireResponse, sent_at: float, arrived: float) -> Grant:
        return grant_of(self.key, response, sent_at, arrived, self._timing.margin)

    def _release_timeout(self) -> float:
        return release_timeout(self._client._timeout, self._timing)

    def _release_call(self) -> Call[lease_pb2.ReleaseRequest, lease_pb2.ReleaseResponse, bool]:
        request = release_request(self.key, self.run_id)
        return Call(
            "Release", lambda stub: stub.Release, request, release_result, self._release_timeout()
        )

    def _release_failed(self, error: Exception) -> None:
        """A hold's release failed: logged, never raised over the body's own
        exception (the lease then ends at its deadline)."""
        self.release_error = error
        log.warning(
            "leasehold: release of %s/%s run %s failed: %s",
            self.key.account_id,
            self.key.session_id,
            self.run_id,
            error,
        )

    def _start(self, grant: Grant) -> None:
        """The grant is kept alive from now on."""
        self.fencing_token = grant.lease.fencing_token
        client = self._client
        with client._guard():
            self._core = HoldCore(
                client._runtime,
                client._keepalive,
                self.key,
                self.run_id,
                self._timing,
                grant.lease,
                grant.deadline,
                self._on_lost,
                self._on_handoff,
            )
            client._holds.add(self)

    def _stop_renewing(self, wake: Callable[[], None]) -> tuple[HoldCore | None, bool]:
        """The hold is ending: its core (None when it was never held or has
        ended already) and whether a renewal is on the way (``wake`` is
        called once none is: ``HoldCore.renewal_settled``)."""
        with self._client._guard():
            if self._finished or self._core is None:
                return None, False
            core = self._core
            self._finished = True
            self._client._holds.discard(self)
            return core, not core.renewal_settled(wake)

    def _end(self, core: HoldCore) -> bool:
        """Stops keeping the lease alive; True when it is to be released
        (it was not lost)."""
        with self._client._guard():
            core.end()
            return core.loss is None

    # Called with the client's guard held

    def _on_lost(self, reason: str, message: str) -> None:
        self.lost.set()
        if self._on_loss is not None:
            self._on_loss(reason, message)

    def _on_handoff(self, request: HandoffRequest) -> None:
        self.handoff_requests.append(request)
        self.handoff_requested.set()
        for listener in list(self._handoff_listeners):
            listener(request)

    # For the body

    def _held(self) -> _LeaseState | None:
        """What the body's accessors read: the hold's own lease state."""
        return self._core

    def _state(self) -> _LeaseState:
        state = self._held()
        if state is None:
            raise RuntimeError(f"the lease is not held yet: use `{self._usage}`")
        return state

    @property
    def lease(self) -> Lease:
        """The lease as last confirmed by the server."""
        with self._client._guard():
            return lease_from(self._state().lease)

    @property
    def loss_reason(self) -> str | None:
        """Why the lease was lost (see LeaseLostError), or None."""
        with self._client._guard():
            return self._state().loss_reason()

    def remaining(self) -> timedelta:
        """Time to the local deadline, read from the monotonic clock now."""
        with self._client._guard():
            return timedelta(seconds=self._state().remaining())

    def check(self) -> None:
        """Raises LeaseLostError when the lease is lost or its local deadline
        has passed (read from the clock now, whatever the timer thread or the
        event loop did), or when the hold has ended."""
        with self._client._guard():
            self._state().check()

    def on_handoff(self, listener: Callable[[HandoffRequest], None]) -> Callable[[], None]:
        """Calls ``listener`` (on a client thread, or the event loop) for every
        handoff request, including those that came before. Returns a function
        that removes it."""
        with self._client._guard():
            self._handoff_listeners.append(listener)
            earlier = list(self.handoff_requests)
        for request in earlier:
            listener(request)

        def remove() -> None:
            with self._client._guard():
                if listener in self._handoff_listeners:
                    self._handoff_listeners.remove(listener)

        return remove

    def fencing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The three fencing headers as gRPC metadata. Raises LeaseLostError
        once the lease is lost: a call for a lost lease is never sent."""
        self.check()
        return fencing_metadata(self.key, self.fencing_token)

    def fencing_headers(self) -> dict[str, str]:
        """The three fencing headers for an HTTP client (raises once lost)."""
        return dict(self.fencing_metadata())


class BaseKeeper(Generic[KeeperHoldT]):
    """The no-I/O half of ``Keeper`` and ``AsyncKeeper``: its settings, its
    state, and what the body reads, each behind the client's guard."""

    lost: _Flag
    #: How a body enters the keeper, for the error of a keeper not entered yet.
    _usage = "with client.keeper(account_id, ttl=…) as k"

    def __init__(
        self,
        client: BaseClient[Any, Any, Any, Any],
        account_id: str,
        timing: LeaseTiming,
        lock_delay: float,
        holder: str,
        keeper_id: str,
    ) -> None:
        self._client = client
        self.account_id = account_id
        #: The keeper's id: chosen here, so a re-attach names the same keeper.
        self.keeper_id = keeper_id
        self.holder = holder
        self.ttl = timedelta(seconds=timing.ttl)
        self.lock_delay = timedelta(seconds=lock_delay)
        self._timing = timing
        self._core: KeeperCore | None = None
        self._finished = False
        #: Set when the keeper is lost (expired, revoked, its local deadline
        #: passed): every lease on it is lost at that moment too.
        self.lost = self._new_flag()
        #: Why closing the keeper failed, when it did (its leases then end
        #: at its deadline, and its lock-delay applies).
        self.close_error: Exception | None = None
        self._holds: set[BaseHold] = set()

    def _new_flag(self) -> _Flag:
        raise NotImplementedError

    def _make_core(self) -> KeeperCore:
        client = self._client
        self._core = KeeperCore(
            client._runtime,
            client.addresses,
            account_id=self.account_id,
            keeper_id=self.keeper_id,
            holder=self.holder,
            timing=self._timing,
            lock_delay=self.lock_delay.total_seconds(),
            notify=self._on_lost,
            refreshable_token=client._keepalive.refreshable_token,
        )
        return self._core

    def _on_lost(self, reason: str, message: str) -> None:
        self.lost.set()

    def _closing(self) -> KeeperCore | None:
        """The keeper is being closed: its core (None when never opened or
        closed already); its holds end without a release of their own."""
        with self._client._guard():
            if self._finished or self._core is None:
                return None
            self._finished = True
            self._client._keepers.discard(self)
            for h in list(self._holds):
                h._finished = True
            self._holds.clear()
            return self._core

    def _close_failed(self, error: Exception) -> None:
        self.close_error = error
        log.warning("leasehold: close of keeper %s failed: %s", self.keeper_id, error)

    # For the body

    def _state(self) -> KeeperCore:
        if self._core is None:
            raise RuntimeError(f"the keeper is not open yet: use `{self._usage}`")
        return self._core

    @property
    def loss_reason(self) -> str | None:
        """Why the keeper was lost (``expired``, ``revoked``, ``deadline``,
        ``renewal_failed``, …), or None."""
        with self._client._guard():
            core = self._state()
            core.check_deadline()
            return core.loss[0] if core.loss else None

    @property
    def heartbeats(self) -> int:
        """Heartbeats sent so far (each re-attach counts as one)."""
        with self._client._guard():
            return self._state().heartbeats_sent

    def remaining(self) -> timedelta:
        """Time to the keeper's local deadline, read from the monotonic clock now."""
        with self._client._guard():
            return timedelta(seconds=self._state().remaining())

    def check(self) -> None:
        """Raises LeaseLostError when the keeper is lost or its local
        deadline has passed (read from the clock now)."""
        with self._client._guard():
            core = self._state()
            core.check_deadline()
            if core.loss is not None:
                raise LeaseLostError(core.loss[1], core.loss[0])

    def hold(
        self,
        key: SessionKey,
        *,
        wait: timedelta | float | None = None,
        holder: str | None = None,
        run_id: str | None = None,
    ) -> KeeperHoldT:
        """A lease held on this keeper for a ``with`` block (``async with``
        for the asyncio client), with the API of :meth:`LeaseClient.hold`:
        acquired on entry (over the keeper's stream), kept by the keeper's
        heartbeat, released on exit (never after loss). Lost when the
        keeper is lost or its local deadline passes, or when the lease alone
        is revoked."""
        return self._hold_type(
            self,
            as_key(key),
            seconds("wait", wait) or 0.0,
            holder if holder is not None else self.holder,
            normalize_run_id(run_id),
        )

    _hold_type: type[KeeperHoldT]


class BaseKeeperHold(BaseHold):
    """The no-I/O half of ``KeeperHold`` and ``AsyncKeeperHold``."""

    def __init__(
        self, keeper: BaseKeeper[Any], key: SessionKey, wait: float, holder: str, run_id: str
    ) -> None:
        super().__init__(keeper._client, key, keeper._timing, wait, holder, run_id)
        self._keeper = keeper
        self._lease: KeeperLease | None = None

    def _held(self) -> _LeaseState | None:
        return self._lease

    def _acquire_timeout(self) -> float:
        return self._wait + self._client._timeout

    def _adopt(self, answer: KeeperLease | LeaseholdError | None) -> None:
        """The acquire's answer (None: none came in time): the lease is held
        from now on, or its error raised. Called with the client's guard held."""
        if answer is None:
            raise DeadlineExceededError(
                f"no answer to the keeper's Acquire within {self._acquire_timeout():.1f}s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        if isinstance(answer, LeaseholdError):
            raise answer
        self._lease = answer
        self.fencing_token = answer.lease.fencing_token
        answer.notify = self._on_lost
        answer.on_handoff = self._on_handoff
        self._keeper._holds.add(self)
        if answer.loss is not None:
            # Lost between its grant and now (the keeper's deadline, a revoke).
            self._on_lost(*answer.loss)

    def _ending(self, done: Callable[[Any], None]) -> bool:
        """The hold is ending: True when its Release was sent (``done`` gets
        the answer); False when there is nothing to send (lost, the keeper
        ended, or ended already)."""
        with self._client._guard():
            if self._finished or self._lease is None:
                return False
            self._finished = True
            self._keeper._holds.discard(self)
            return self._lease.keeper.release(self._lease, done)

    def _released(self, answer: Any) -> None:
        """The Release's answer (None: none came in time)."""
        if answer is None:
            self._release_failed(
                DeadlineExceededError(
                    "no answer to the keeper's Release", grpc.StatusCode.DEADLINE_EXCEEDED
                )
            )
        elif isinstance(answer, Exception):
            self._release_failed(answer)
        else:
            self.released = bool(answer.release.released)
