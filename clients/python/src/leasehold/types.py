"""Results of the client's calls as typed dataclasses, their conversion
from the answers, and the keys and durations a caller gives."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from google.protobuf import duration_pb2, timestamp_pb2

from ._gen.leasehold.v1 import lease_pb2


@dataclass(frozen=True, slots=True)
class SessionKey:
    """One logical session of one account."""

    account_id: str
    session_id: str

    def to_proto(self) -> lease_pb2.SessionKey:
        return lease_pb2.SessionKey(account_id=self.account_id, session_id=self.session_id)


@dataclass(frozen=True, slots=True)
class Lease:
    """One grant of a session to a run, as the server last confirmed it."""

    key: SessionKey
    run_id: str
    fencing_token: int
    holder: str
    ttl: timedelta
    acquired_at: datetime | None
    expires_at: datetime | None
    #: Time left when the server made the answer; local deadlines count from it.
    remaining: timedelta
    #: The keeper the lease was acquired on ("" for a lease of its own).
    keeper_id: str = ""


@dataclass(frozen=True, slots=True)
class AcquireResult:
    acquired: bool
    #: The granted lease, when acquired.
    lease: Lease | None
    #: The valid lease that blocked the grant, when not acquired.
    current: Lease | None
    #: When not acquired because the key's last lease was on a keeper that
    #: expired: when its lock-delay ends, on the database clock (K2).
    lock_delay_until: datetime | None = None


@dataclass(frozen=True, slots=True)
class GetResult:
    held: bool
    lease: Lease | None
    #: When not held and the key's last lease was on a keeper that expired:
    #: when its lock-delay ends (K2).
    lock_delay_until: datetime | None = None


@dataclass(frozen=True, slots=True)
class ListResult:
    leases: list[Lease]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class HandoffRequest:
    """Someone asked the run to finish and release (cooperative; nothing is taken away)."""

    requester_holder: str
    reason: str
    requested_at: datetime | None


@dataclass(frozen=True, slots=True)
class HandoffResult:
    delivered: bool
    current: Lease | None


@dataclass(frozen=True, slots=True)
class Event:
    """One change of a session, as Watch and History report it."""

    #: ``ACQUIRED``, ``RELEASED``, ``EXPIRED``, ``REVOKED``, ``HANDOFF_REQUESTED``, ``RENEWED``.
    type: str
    key: SessionKey
    run_id: str
    fencing_token: int
    holder: str
    reason: str
    at: datetime | None
    lease: Lease | None
    requester_holder: str
    id: int


@dataclass(frozen=True, slots=True)
class HistoryResult:
    events: list[Event]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    leases: list[Lease]
    at: datetime | None


@dataclass(frozen=True, slots=True)
class CheckFenceResult:
    current: bool
    highest_token: int


@dataclass(frozen=True, slots=True)
class RevokeResult:
    revoked: bool
    lease: Lease | None


@dataclass(frozen=True, slots=True)
class RevokeKeeperResult:
    #: False when the keeper had already ended.
    revoked: bool
    #: The leases the revoke ended.
    leases_revoked: int


@dataclass(frozen=True, slots=True)
class ReleaseFailure:
    """A lease ``close()`` could not release, and why."""

    key: SessionKey
    run_id: str
    error: Exception = field(compare=False)


@dataclass(frozen=True, slots=True)
class Leader:
    """The leader of an election, as the server last reported it."""

    #: The advertised value (the lease's holder label).
    value: str
    #: The term: the grant's fencing token.
    term: int
    #: The leader's run id.
    run_id: str
    #: When its lease ends unless renewed, on the database clock (None when not reported).
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class ElectionChange:
    """One change of an election, as ``observe()`` yields it.

    ``type`` is ``current`` (the first item: the leader when observing
    began, ``leader`` None when nobody led), ``elected`` (a new term),
    ``proclaimed`` (the leader advertised another value in the same term) or
    ``ended`` (the term ended and nobody leads: ``how`` is ``resigned``,
    ``expired`` or ``revoked``; a term taken over at its expiry shows as the
    next ``elected``)."""

    type: str
    #: The leader after the change (None for ``ended``, and for a ``current`` with none).
    leader: Leader | None
    #: The term the change is about (0 for a ``current`` with no leader).
    term: int
    #: How an ``ended`` term ended; "" for the other types.
    how: str = ""


@dataclass(frozen=True, slots=True)
class StopReason:
    """Why a term ended: ``resigned`` (resign(), the leadership's block
    left, or run_election's ``lead`` returned), ``lost`` (``cause`` is the
    LeaseLostError: revoked, expired, taken_over, deadline, renewal_failed,
    token_expired) or ``cancelled`` (``cancel()``, run_election's ``stop``,
    or the asyncio task cancelled; the lease is released)."""

    kind: str
    cause: BaseException | None = field(default=None, compare=False)


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


def duration(value: timedelta) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(value)
    return d


def seconds_of(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def timestamp_from(ts: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
    if not present:
        return None
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=UTC)


def key_from(key: lease_pb2.SessionKey) -> SessionKey:
    return SessionKey(key.account_id, key.session_id)


def lease_from(lease: lease_pb2.Lease) -> Lease:
    return Lease(
        key=key_from(lease.key),
        run_id=lease.run_id,
        fencing_token=lease.fencing_token,
        holder=lease.holder,
        ttl=timedelta(seconds=seconds_of(lease.ttl)),
        acquired_at=timestamp_from(lease.acquired_at, lease.HasField("acquired_at")),
        expires_at=timestamp_from(lease.expires_at, lease.HasField("expires_at")),
        remaining=timedelta(seconds=seconds_of(lease.remaining)),
        keeper_id=lease.keeper_id,
    )


def optional_lease(message: lease_pb2.Lease, present: bool) -> Lease | None:
    return lease_from(message) if present else None


def event_from(e: lease_pb2.Event) -> Event:
    name = lease_pb2.EventType.Name(e.type).removeprefix("EVENT_TYPE_")
    return Event(
        type=name,
        key=key_from(e.key),
        run_id=e.run_id,
        fencing_token=e.fencing_token,
        holder=e.holder,
        reason=e.reason,
        at=timestamp_from(e.at, e.HasField("at")),
        lease=optional_lease(e.lease, e.HasField("lease")),
        requester_holder=e.requester_holder,
        id=e.id,
    )


def handoff_from(h: lease_pb2.HandoffRequested) -> HandoffRequest:
    return HandoffRequest(
        requester_holder=h.requester_holder,
        reason=h.reason,
        requested_at=timestamp_from(h.requested_at, h.HasField("requested_at")),
    )


def acquire_result(r: lease_pb2.AcquireResponse) -> AcquireResult:
    return AcquireResult(
        r.acquired,
        optional_lease(r.lease, r.HasField("lease")),
        optional_lease(r.current, r.HasField("current")),
        timestamp_from(r.lock_delay_until, r.HasField("lock_delay_until")),
    )


def renew_result(r: lease_pb2.RenewResponse) -> Lease:
    return lease_from(r.lease)


def release_result(r: lease_pb2.ReleaseResponse) -> bool:
    return bool(r.released)


def get_result(r: lease_pb2.GetResponse) -> GetResult:
    return GetResult(
        r.held,
        optional_lease(r.lease, r.HasField("lease")),
        timestamp_from(r.lock_delay_until, r.HasField("lock_delay_until")),
    )


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


def revoke_keeper_result(r: lease_pb2.RevokeKeeperResponse) -> RevokeKeeperResult:
    return RevokeKeeperResult(r.revoked, r.leases_revoked)


def watch_item(r: lease_pb2.WatchResponse) -> Snapshot | Event:
    if r.WhichOneof("kind") == "snapshot":
        at = r.snapshot.at
        return Snapshot(
            [lease_from(lease) for lease in r.snapshot.leases],
            event_from(lease_pb2.Event(at=at)).at if r.snapshot.HasField("at") else None,
        )
    return event_from(r.event)


def loss_cause(reason: int) -> str | None:
    """The KeepAlive ``lost`` reason as the loss cause names it (``taken_over``, …)."""
    if reason == lease_pb2.LOSS_REASON_UNSPECIFIED:
        return None
    name = lease_pb2.LossReason.Name(lease_pb2.LossReason.ValueType(reason))
    return name.removeprefix("LOSS_REASON_").lower()


_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def normalize_run_id(run_id: str | uuid.UUID | None) -> str:
    """A run id as the server keeps it: a UUID in lower case (a new one when None).

    A value that is not a UUID is passed on unchanged, for the server to
    refuse with INVALID_ARGUMENT naming the field.
    """
    if run_id is None:
        return str(uuid.uuid4())
    text = str(run_id)
    return text.lower() if _UUID.match(text) else text
