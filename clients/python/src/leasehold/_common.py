"""Configuration shared by the blocking and the asyncio client: addresses,
credentials, the bearer token, outgoing metadata, request building, and a
unary call's attempts across instances."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import grpc

from ._gen.leasehold.v1 import lease_pb2
from .errors import (
    LeaseholdError,
    LeaseLostError,
    UnauthenticatedError,
    UnavailableError,
    from_rpc_error,
)
from .types import (
    AcquireResult,
    CheckFenceResult,
    Event,
    GetResult,
    HandoffResult,
    HistoryResult,
    Lease,
    ListResult,
    RevokeResult,
    SessionKey,
    Snapshot,
    duration,
    event_from,
    lease_from,
    optional_lease,
)

_otel_propagate: Any
try:  # Optional: the active OpenTelemetry context's traceparent goes out with calls.
    from opentelemetry import propagate as _otel_propagate
except ImportError:  # pragma: no cover - depends on the environment
    _otel_propagate = None

log = logging.getLogger("leasehold")

Token = str | Callable[[], str] | None
Metadata = tuple[tuple[str, str], ...]

#: The headers a call made on behalf of a lease carries (DESIGN §5).
FENCING_TOKEN_HEADER = "leasehold-fencing-token"
ACCOUNT_ID_HEADER = "leasehold-account-id"
SESSION_ID_HEADER = "leasehold-session-id"

DEFAULT_TIMEOUT = 10.0

# A fresh connection per KeepAlive stream: grpc shares subchannels between
# channels of the same target, and a stalled connection would stall the
# reopened stream too.
FRESH_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


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


def as_key(key: SessionKey | tuple[str, str]) -> SessionKey:
    if isinstance(key, SessionKey):
        return key
    if isinstance(key, tuple) and len(key) == 2:
        return SessionKey(str(key[0]), str(key[1]))
    raise TypeError(f"key must be a SessionKey(account_id=…, session_id=…), got {key!r}")


def seconds(name: str, value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a datetime.timedelta or seconds, got {value!r}")
    return float(value)


def as_timedelta(name: str, value: timedelta | float) -> timedelta:
    s = seconds(name, value)
    assert s is not None
    return timedelta(seconds=s)


class Auth:
    """The bearer token: a string, or a callable returning the current one."""

    def __init__(self, token: Token) -> None:
        if token is not None and not isinstance(token, str) and not callable(token):
            raise TypeError("token must be a string or a callable returning one")
        self.token = token

    @property
    def refreshable(self) -> bool:
        return callable(self.token)

    def metadata(self) -> Metadata:
        token = self.token
        if token is None:
            value = None
        elif isinstance(token, str):
            value = token
        else:
            try:
                value = token()
            except Exception as error:
                raise UnauthenticatedError(f"the token callable failed: {error!r}") from error
        md: list[tuple[str, str]] = []
        if value:
            md.append(("authorization", f"Bearer {value}"))
        if _otel_propagate is not None:
            carrier: dict[str, str] = {}
            _otel_propagate.inject(carrier)
            md.extend(carrier.items())
        return tuple(md)


def fencing_metadata(key: SessionKey, token: int) -> Metadata:
    return (
        (FENCING_TOKEN_HEADER, str(token)),
        (ACCOUNT_ID_HEADER, key.account_id),
        (SESSION_ID_HEADER, key.session_id),
    )


def describe_holder(lease: Lease | None) -> str:
    if lease is None:
        return "another run"
    who = json_str(lease.holder) if lease.holder else "another run"
    return (
        f"{who} (run {lease.run_id}, token {lease.fencing_token}), "
        f"{lease.remaining.total_seconds():.1f}s left"
    )


def json_str(text: str) -> str:
    import json

    return json.dumps(text)


def released_error() -> LeaseLostError:
    return LeaseLostError("the hold ended and released its lease", "released")


# Requests and results, one pair per method.


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


def acquire_result(r: lease_pb2.AcquireResponse) -> AcquireResult:
    return AcquireResult(
        r.acquired,
        optional_lease(r.lease, r.HasField("lease")),
        optional_lease(r.current, r.HasField("current")),
    )


def renew_request(
    key: SessionKey, run_id: str, ttl: timedelta | float | None
) -> lease_pb2.RenewRequest:
    request = lease_pb2.RenewRequest(key=key.to_proto(), run_id=run_id)
    if ttl is not None:
        request.ttl.CopyFrom(duration(as_timedelta("ttl", ttl)))
    return request


def release_request(key: SessionKey, run_id: str) -> lease_pb2.ReleaseRequest:
    return lease_pb2.ReleaseRequest(key=key.to_proto(), run_id=run_id)


def log_release_failure(key: SessionKey, run_id: str, error: Exception) -> None:
    """A hold's release failed: logged, never raised over the body's own
    exception (the lease then ends at its deadline)."""
    log.warning(
        "leasehold: release of %s/%s run %s failed: %s",
        key.account_id,
        key.session_id,
        run_id,
        error,
    )


def get_result(r: lease_pb2.GetResponse) -> GetResult:
    return GetResult(r.held, optional_lease(r.lease, r.HasField("lease")))


def list_result(r: lease_pb2.ListResponse) -> ListResult:
    return ListResult([lease_from(lease) for lease in r.leases], r.next_page_token)


def handoff_result(r: lease_pb2.RequestHandoffResponse) -> HandoffResult:
    return HandoffResult(r.delivered, optional_lease(r.current, r.HasField("current")))


def history_result(r: lease_pb2.HistoryResponse) -> HistoryResult:
    return HistoryResult([event_from(e) for e in r.events], r.next_page_token)


def check_fence_result(r: lease_pb2.CheckFenceResponse) -> CheckFenceResult:
    return CheckFenceResult(r.current, r.highest_token)


def revoke_result(r: lease_pb2.RevokeResponse) -> RevokeResult:
    return RevokeResult(r.revoked, optional_lease(r.lease, r.HasField("lease")))


def watch_item(r: lease_pb2.WatchResponse) -> Snapshot | Event:
    if r.WhichOneof("kind") == "snapshot":
        at = r.snapshot.at
        return Snapshot(
            [lease_from(lease) for lease in r.snapshot.leases],
            event_from(lease_pb2.Event(at=at)).at if r.snapshot.HasField("at") else None,
        )
    return event_from(r.event)


#: Unary calls that change nothing when sent twice: reads, and writes keyed
#: by the caller's run id (S5: a Release can only end that run's own lease;
#: sent again after it succeeded it answers released=false). Revoke and
#: RequestHandoff are not among them: a second Revoke could end a lease
#: granted in between, a second RequestHandoff records a second request.
_IDEMPOTENT = frozenset({"Renew", "Release", "Get", "List", "History", "CheckFence"})


def attempt_plan(method: str, request: Any, count: int, start: int) -> list[int]:
    """The address indexes a unary call tries, in order, on UNAVAILABLE: each
    address once from the preferred one, then, for an idempotent call, each
    again. A connection reset under a call (a proxy or load balancer cutting
    it) fails that call once though the same address answers the next one;
    with a single address there is nowhere else to go. Acquire is idempotent
    only with a run id chosen by the client (same run id, same token)."""
    first = [(start + i) % count for i in range(count)]
    idempotent = method in _IDEMPOTENT or (method == "Acquire" and bool(request.run_id))
    return first + first if idempotent else first


# Before an idempotent call's second round, which asks addresses already
# tried: a connection reset under the first attempt may not yet be seen by
# the channel, whose next call would then go out on the dead connection
# (seen as "sendmsg: Broken pipe"). A pause of this length, as a gRPC retry
# policy's backoff, lets it close the connection and dial again.
SECOND_ROUND_PAUSE_S = 0.1


def second_round_pause(position: int, count: int, remaining: float) -> float:
    """Seconds to wait before the attempt at `position` of a plan over
    `count` addresses: a pause at the start of the second round, within
    what remains of the call's deadline; none otherwise."""
    if position != count:
        return 0.0
    return max(0.0, min(SECOND_ROUND_PAUSE_S, remaining / 2))


def unavailable_message(method: str, attempts: list[tuple[str, str]]) -> str:
    tried = "; ".join(f"{address}: {what}" for address, what in attempts)
    return f"{method}: no server instance could answer (tried {tried})"


class Attempts:
    """One unary call's attempts, for both clients' ``_call``: the address
    indexes of ``attempt_plan`` in order, every one within the call's one
    deadline, and what each instance said when it was UNAVAILABLE."""

    def __init__(
        self, method: str, request: Any, addresses: Sequence[str], preferred: int, limit: float
    ) -> None:
        self.method = method
        self.count = len(addresses)
        self.deadline = time.monotonic() + limit
        self.plan = attempt_plan(method, request, self.count, preferred)
        self.tried: list[tuple[str, str]] = []
        self.last: grpc.RpcError | None = None

    def pause(self, position: int) -> float:
        """Seconds to wait before the attempt at ``position`` of the plan."""
        return second_round_pause(position, self.count, self.deadline - time.monotonic())

    def remaining(self) -> float | None:
        """The next attempt's timeout: what is left of the call's deadline;
        None when nothing is left after a first attempt."""
        left = self.deadline - time.monotonic()
        return None if self.tried and left <= 0 else left

    def failed(self, address: str, e: grpc.RpcError) -> None:
        """Raises the call's error unless the instance was UNAVAILABLE; that
        is kept, and the plan's next address is tried."""
        error = from_rpc_error(e)
        if not isinstance(error, UnavailableError):
            raise error from e
        self.tried.append((address, error.message))
        self.last = e

    def unavailable(self) -> UnavailableError:
        """The error after every attempt failed, naming each instance."""
        return UnavailableError(unavailable_message(self.method, self.tried), attempts=self.tried)


__all__ = ["DEFAULT_TIMEOUT", "Auth", "LeaseholdError", "log"]
