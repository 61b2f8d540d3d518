"""Results of the client's calls as typed dataclasses, and their conversion."""

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


@dataclass(frozen=True, slots=True)
class AcquireResult:
    acquired: bool
    #: The granted lease, when acquired.
    lease: Lease | None
    #: The valid lease that blocked the grant, when not acquired.
    current: Lease | None


@dataclass(frozen=True, slots=True)
class GetResult:
    held: bool
    lease: Lease | None


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
class ReleaseFailure:
    """A lease ``close()`` could not release, and why."""

    key: SessionKey
    run_id: str
    error: Exception = field(compare=False)


def duration(value: timedelta) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(value)
    return d


def seconds_of(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def _time(ts: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
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
        acquired_at=_time(lease.acquired_at, lease.HasField("acquired_at")),
        expires_at=_time(lease.expires_at, lease.HasField("expires_at")),
        remaining=timedelta(seconds=seconds_of(lease.remaining)),
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
        at=_time(e.at, e.HasField("at")),
        lease=optional_lease(e.lease, e.HasField("lease")),
        requester_holder=e.requester_holder,
        id=e.id,
    )


def handoff_from(h: lease_pb2.HandoffRequested) -> HandoffRequest:
    return HandoffRequest(
        requester_holder=h.requester_holder,
        reason=h.reason,
        requested_at=_time(h.requested_at, h.HasField("requested_at")),
    )


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
