"""The KeepAlive channel, a held lease's local deadline, and the acquire /
late-grant decision, shared by the blocking and the asyncio client
(DESIGN §6, L2).

Nothing here blocks or locks: a runtime (threads for ``LeaseClient``, the
event loop for ``AsyncLeaseClient``) supplies the clock, timers and streams,
and calls in with its lock held. The logic mirrors src/client/keepalive.ts and
run-exclusive.ts: one stream per client shared by every lease (one more per
``max_leases_per_stream``), reconnecting to the next instance over a fresh
connection after a jittered backoff, a renewal unanswered for one renewal
interval counting as a stalled stream (a renewal answered ``undecided``, which
the database did not decide, is answered: the stream goes on and the lease's
deadline stays), and each lease's local deadline set from the monotonic time
its renewal was sent. The acquire / late-grant
decision is a generator (``acquire_flow``) that yields the calls it needs;
each client drives it (``_flow``).
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import grpc

from ._gen.leasehold.v1 import lease_pb2
from .errors import (
    LIMIT_EXCEEDED,
    LIMIT_LEASES_PER_STREAM,
    LateGrantError,
    LeaseholdError,
    LeaseLostError,
    NotAcquiredError,
    UnauthenticatedError,
    UnavailableError,
    from_status_message,
)
from .types import (
    HandoffRequest,
    Lease,
    SessionKey,
    handoff_from,
    lease_from,
    loss_cause,
    seconds,
    seconds_of,
    timestamp_from,
)

DEFAULT_MARGIN_FRACTION = 0.1
DEFAULT_RENEW_FRACTION = 1 / 3


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """TTL, safety margin and renewal interval of one hold, in seconds."""

    ttl: float
    margin: float
    renew_interval: float


def lease_timing(
    ttl: timedelta | float,
    safety_margin: timedelta | float | None = None,
    renew_interval: timedelta | float | None = None,
) -> LeaseTiming:
    """Fills in the defaults (margin TTL/10, renewals every third of TTL − margin)
    and checks that one slow answer cannot end a healthy hold."""
    ttl_s = seconds("ttl", ttl)
    if ttl_s is None or not ttl_s > 0:
        raise ValueError(f"ttl must be a positive duration, got {ttl!r}")
    margin = seconds("safety_margin", safety_margin)
    if margin is None:
        margin = ttl_s * DEFAULT_MARGIN_FRACTION
    if not 0 <= margin < ttl_s:
        raise ValueError(
            f"safety_margin must be at least 0 and below ttl ({ttl_s}s), got {margin}s"
        )
    interval = seconds("renew_interval", renew_interval)
    if interval is None:
        interval = (ttl_s - margin) * DEFAULT_RENEW_FRACTION
    if not 0 < interval <= (ttl_s - margin) / 2:
        raise ValueError(
            "renew_interval must be above 0 and at most half of ttl − safety_margin "
            f"({(ttl_s - margin) / 2}s), got {interval}s"
        )
    return LeaseTiming(ttl_s, margin, interval)


def local_deadline(sent_at: float, lease: lease_pb2.Lease, margin: float) -> float:
    """L2: (monotonic send time) + (the database's ``remaining``) − margin.

    ``remaining`` was computed after the request left, so counting it from the
    send time errs early, never late; ``expires_at`` is never used.
    """
    return sent_at + seconds_of(lease.remaining) - margin


@dataclass(frozen=True, slots=True)
class Grant:
    """An Acquire's grant as the hold sees it (L2)."""

    lease: lease_pb2.Lease
    #: The local deadline (monotonic), counted from the request's send time.
    deadline: float
    #: The answer arrived at or after that deadline: the grant cannot be used.
    late: bool
    #: Seconds from send to answer.
    elapsed: float


def grant_of(
    key: SessionKey,
    response: lease_pb2.AcquireResponse,
    sent_at: float,
    arrived: float,
    margin: float,
) -> Grant:
    """The grant in an Acquire's answer; NotAcquiredError naming the holder
    when the session is held by another run."""
    if not response.acquired or not response.HasField("lease"):
        raise not_acquired(key, response)
    deadline = local_deadline(sent_at, response.lease, margin)
    return Grant(response.lease, deadline, arrived >= deadline, arrived - sent_at)


def not_acquired(key: SessionKey, response: lease_pb2.AcquireResponse) -> NotAcquiredError:
    """A refused Acquire as its error: the lease that blocks it, or, for a
    key of an expired keeper, until when its lock-delay runs (K2)."""
    current = lease_from(response.current) if response.HasField("current") else None
    until = timestamp_from(response.lock_delay_until, response.HasField("lock_delay_until"))
    name = f"session {key.account_id}/{key.session_id}"
    if until is not None and current is None:
        message = f"{name} is in its lock-delay until {until.isoformat()}"
    else:
        message = f"{name} is held by {describe_holder(current)}"
    return NotAcquiredError(message, current, lock_delay_until=until)


def describe_holder(lease: Lease | None) -> str:
    if lease is None:
        return "another run"
    who = json.dumps(lease.holder) if lease.holder else "another run"
    return (
        f"{who} (run {lease.run_id}, token {lease.fencing_token}), "
        f"{lease.remaining.total_seconds():.1f}s left"
    )


def released_error() -> LeaseLostError:
    return LeaseLostError("the hold ended and released its lease", "released")


@dataclass(frozen=True, slots=True)
class SendAcquire:
    """Send the hold's Acquire with this ``wait``; answered with its Grant
    (``grant_of``), or by throwing the call's error into the flow.
    ``confirming``: the re-acquire that confirms a late waited grant."""

    wait: float
    confirming: bool = False


@dataclass(frozen=True, slots=True)
class SendRelease:
    """Release the hold's run (answered with None); ``background``: without
    waiting for the answer, the flow raising meanwhile."""

    background: bool


#: Answers in which the server refused an Acquire: nothing was granted.
_REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def may_have_granted(error: BaseException) -> bool:
    """Whether an Acquire that failed with ``error`` may have been granted,
    its answer lost (unavailable, past its deadline, cancelled, interrupted).
    A refusal (held elsewhere, bad input, credentials, a bound) grants
    nothing, nor does an error raised before anything was sent (the client
    closed, the token callable failed): releasing then could only fail."""
    if isinstance(error, UnauthenticatedError):
        return False
    if isinstance(error, LeaseholdError):
        return error.code not in _REFUSED
    return not isinstance(error, Exception)


def acquire_flow(wait: float) -> Generator[SendAcquire | SendRelease, Grant | None, Grant]:
    """A hold's acquire, once for both holds: the grant to keep alive, or
    the error, after releasing whatever may have been granted. Each client
    drives it (``_flow.drive``, ``_flow.drive_async``) and throws in the
    errors it catches from a step."""
    try:
        grant = yield SendAcquire(wait)
    except GeneratorExit:
        raise
    except BaseException as error:
        if may_have_granted(error):
            # The grant may have happened with its answer lost: release by run
            # id (a no-op when nothing was granted) rather than block the session.
            yield SendRelease(background=True)
        raise
    assert grant is not None, "a SendAcquire is answered with its grant"
    if grant.late and wait > 0:
        # A waited grant can be older than its answer: confirm it with an
        # idempotent re-acquire (same run id, same token), its deadline
        # counted from the new request.
        try:
            grant = yield SendAcquire(0, confirming=True)
        except GeneratorExit:
            raise
        except BaseException:
            yield SendRelease(background=False)
            raise
        assert grant is not None, "a SendAcquire is answered with its grant"
    if grant.late:
        yield SendRelease(background=False)
        raise LateGrantError(lease_from(grant.lease), grant.elapsed)
    return grant


def release_timeout(client_timeout: float, timing: LeaseTiming) -> float:
    """How long a hold's wait for a renewal in flight may take, and then,
    separately, its Release: each at most the client's call timeout and never
    longer than the lease's TTL (so the two together up to twice that)."""
    return min(client_timeout, timing.ttl)


class Timer(Protocol):
    def cancel(self) -> None: ...


class Stream(Protocol):
    def send(self, request: lease_pb2.KeepAliveRequest) -> None: ...

    def close(self) -> None:
        """Half-closes; cuts the stream if the server has not ended it a second later."""

    def cancel(self) -> None: ...


OnMessage = Callable[[lease_pb2.KeepAliveResponse], None]
OnEnd = Callable[[LeaseholdError | None], None]


class Runtime(Protocol):
    """What the channel needs from its client. Callbacks run with the client's lock held."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...

    def open_stream(self, address: str, on_message: OnMessage, on_end: OnEnd) -> Stream: ...


@dataclass(frozen=True, slots=True)
class KeepAliveEvent:
    """Something that happened to a KeepAlive stream (for logs and tests)."""

    #: ``open``, ``failed``, ``closed``, or ``renewal_undecided``: the server
    #: did not decide one renewal (its database timed out) and said so; the
    #: stream goes on, and ``key``, ``run_id`` and ``error`` (an
    #: ``UnavailableError``, reason ``DATABASE_UNAVAILABLE``, metadata
    #: ``sql_state``) name it.
    type: str
    address: str
    error: LeaseholdError | None = None
    #: Seconds until the next attempt; None when the failure is final.
    retry_in: float | None = None
    key: SessionKey | None = None
    run_id: str | None = None


class Target(Protocol):
    key: SessionKey
    run_id: str
    response_timeout: float

    def on_renewed(self, lease: lease_pb2.Lease, sent_at: float | None) -> None: ...

    def on_lost(self, cause: str | None) -> None: ...

    def on_handoff(self, request: HandoffRequest) -> None: ...

    def on_failed(self, error: LeaseholdError, reason: str) -> None: ...


_DEFINITIVE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

EntryId = tuple[str, str, str]


class _Entry:
    __slots__ = ("active", "id", "outstanding", "request", "sent", "settled", "target")

    def __init__(self, target: Target) -> None:
        self.target = target
        self.id: EntryId = (target.key.account_id, target.key.session_id, target.run_id)
        self.request = lease_pb2.KeepAliveRequest(key=target.key.to_proto(), run_id=target.run_id)
        self.outstanding: deque[float] = deque()
        self.sent = 0
        self.active = True
        #: Waiting for no renewal of this lease to be on the way (Registration.settled).
        self.settled: list[Callable[[], None]] = []


def _settle(entry: _Entry) -> None:
    """Tells whoever waits on ``Registration.settled`` that no renewal of
    the entry is on the way any more."""
    waiting, entry.settled = entry.settled, []
    for wake in waiting:
        wake()


class _Open:
    __slots__ = ("generation", "handle", "stall_at", "stall_timer", "stalls")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.handle: Stream | None = None
        # Renewals unanswered, oldest first, one FIFO per response timeout.
        self.stalls: dict[float, deque[tuple[_Entry, int, float]]] = {}
        self.stall_timer: Timer | None = None
        self.stall_at = float("inf")


def leases_per_stream_limit(error: LeaseholdError) -> int | None:
    """The server's --max-leases-per-stream when ``error`` is its refusal of a stream."""
    if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or error.reason != LIMIT_EXCEEDED:
        return None
    if error.metadata.get("limit") != LIMIT_LEASES_PER_STREAM:
        return None
    text = error.metadata.get("max", "")
    return int(text) if text.isdigit() and int(text) >= 1 else None


class _Lane:
    """One self-reconnecting KeepAlive stream and the leases it carries."""

    def __init__(self, channel: KeepAliveChannel) -> None:
        self.channel = channel
        self.rt = channel.rt
        self.entries: dict[EntryId, _Entry] = {}
        self.stream: _Open | None = None
        self.generation = 0
        self.address_index = 0
        self.failures = 0
        self.reconnect: Timer | None = None
        self.closed = False
        #: The last failure of this lane's stream, named with its instance
        #: (cleared by an answered renewal): what a deadline loss reports.
        self.last_failure: str | None = None

    @property
    def size(self) -> int:
        return len(self.entries)

    def register(self, target: Target) -> _Entry:
        entry = _Entry(target)
        replaced = self.entries.get(entry.id)
        if replaced is not None:
            replaced.active = False
            _settle(replaced)
        self.entries[entry.id] = entry
        if self.stream is None and self.reconnect is None:
            self._open()
        return entry

    def renew(self, entry: _Entry) -> None:
        if self.entries.get(entry.id) is entry:
            self._send(entry)

    def remove(self, entry: _Entry) -> None:
        if self.entries.get(entry.id) is not entry:
            return
        entry.active = False
        del self.entries[entry.id]
        _settle(entry)
        if not self.entries:
            self._shutdown()

    def settled(self, entry: _Entry, wake: Callable[[], None]) -> bool:
        """True when no renewal of ``entry`` is unanswered on this lane's
        stream; else False, and ``wake`` is called once none is: its answers
        came, the lease was lost or removed, or the stream failed (the stall
        watch fails it when a renewal goes unanswered for its response
        timeout)."""
        if self.entries.get(entry.id) is not entry or self.stream is None:
            return True
        if not entry.outstanding:
            return True
        entry.settled.append(wake)
        return False

    def close(self) -> None:
        self.closed = True
        for entry in self.entries.values():
            entry.active = False
            _settle(entry)
        self.entries.clear()
        self._shutdown()

    def _send(self, entry: _Entry) -> None:
        stream = self.stream
        if stream is None or stream.handle is None:
            return  # reconnecting: the reopened stream renews every lease
        sent_at = self.rt.now()
        entry.outstanding.append(sent_at)
        entry.sent += 1
        stream.handle.send(entry.request)
        timeout = entry.target.response_timeout
        fifo = stream.stalls.get(timeout)
        if fifo is None:
            fifo = stream.stalls[timeout] = deque()
        due = sent_at + timeout
        fifo.append((entry, entry.sent, due))
        if due < stream.stall_at:
            self._arm_stall(stream, due)

    def _arm_stall(self, stream: _Open, at: float) -> None:
        if stream.stall_timer is not None:
            stream.stall_timer.cancel()
        stream.stall_at = at
        stream.stall_timer = self.rt.call_later(
            max(0.0, at - self.rt.now()), lambda: self._check_stalls(stream)
        )

    def _check_stalls(self, stream: _Open) -> None:
        if self.stream is not stream:
            return
        stream.stall_timer = None
        stream.stall_at = float("inf")
        now = self.rt.now()
        nxt = float("inf")
        for timeout, fifo in stream.stalls.items():
            while fifo:
                entry, n, due = fifo[0]
                if not entry.active or entry.sent - len(entry.outstanding) >= n:
                    fifo.popleft()
                    continue
                if due <= now:
                    self._fail(
                        stream.generation,
                        UnavailableError(f"no answer to a renewal within {timeout * 1000:.0f}ms"),
                    )
                    return
                nxt = min(nxt, due)
                break
        if nxt != float("inf"):
            self._arm_stall(stream, nxt)

    def _open(self) -> None:
        self.reconnect = None
        addresses = self.channel.addresses
        address = addresses[self.address_index % len(addresses)]
        self.generation += 1
        stream = _Open(self.generation)
        self.stream = stream
        generation = stream.generation

        def on_message(message: lease_pb2.KeepAliveResponse) -> None:
            if self.stream is stream:
                self._dispatch(message)

        def on_end(error: LeaseholdError | None) -> None:
            if self.stream is stream:
                self._fail(
                    generation, error or UnavailableError("the server ended the KeepAlive stream")
                )

        try:
            stream.handle = self.rt.open_stream(address, on_message, on_end)
        except LeaseholdError as error:
            # The token callable failed, or the channel could not be made.
            self._fail(generation, error)
            return
        self.channel.emit(KeepAliveEvent("open", address))
        for entry in self.entries.values():
            entry.outstanding.clear()
            entry.sent = 0
            self._send(entry)

    def _dispatch(self, response: lease_pb2.KeepAliveResponse) -> None:
        key = response.key
        entry = self.entries.get((key.account_id, key.session_id, response.run_id))
        if entry is None:
            return
        kind = response.WhichOneof("result")
        if kind == "lease":
            # The answer to the oldest unanswered request: taking the oldest
            # send time can only make the deadline earlier, never later.
            sent_at = entry.outstanding.popleft() if entry.outstanding else None
            self.failures = 0
            self.last_failure = None
            entry.target.on_renewed(response.lease, sent_at)
            if not entry.outstanding:
                _settle(entry)
        elif kind == "lost":
            entry.active = False
            del self.entries[entry.id]
            _settle(entry)
            entry.target.on_lost(loss_cause(response.lost.reason))
            if not self.entries:
                self._shutdown()
        elif kind == "handoff_requested":
            entry.target.on_handoff(handoff_from(response.handoff_requested))
        elif kind == "undecided":
            # Answered, so not stalled; the lease's deadline does not move
            # and its next renewal goes at the usual interval.
            if entry.outstanding:
                entry.outstanding.popleft()
            self.failures = 0
            if not entry.outstanding:
                _settle(entry)
            addresses = self.channel.addresses
            self.channel.emit(
                KeepAliveEvent(
                    "renewal_undecided",
                    addresses[self.address_index % len(addresses)],
                    from_status_message(response.undecided),
                    key=entry.target.key,
                    run_id=entry.target.run_id,
                )
            )

    def _fail(self, generation: int, error: LeaseholdError) -> None:
        stream = self.stream
        if stream is None or stream.generation != generation:
            return
        self.stream = None
        if stream.stall_timer is not None:
            stream.stall_timer.cancel()
        if stream.handle is not None:
            stream.handle.cancel()
        # The renewals sent on this stream will not be answered.
        for entry in self.entries.values():
            _settle(entry)
        addresses = self.channel.addresses
        address = addresses[self.address_index % len(addresses)]
        self.last_failure = f"{address}: {error.message}"
        failure = error.failure if isinstance(error, UnauthenticatedError) else None
        expired_token = failure == "expired"
        # A stream ended at its token's or its client certificate's expiry
        # reopens when a fresh one can be had: a token callable, or
        # certificate files read again for the new channel.
        renewable = failure in ("expired", "certificate_expired") and self.channel.refreshable_token
        if error.code in _DEFINITIVE and not renewable:
            reason = "token_expired" if expired_token else "renewal_failed"
            if expired_token:
                error = UnauthenticatedError(
                    "the bearer token expired and a static token cannot be renewed "
                    "(pass a callable as token to refresh it): " + error.message,
                    error.code,
                    reason=error.reason,
                    metadata=error.metadata,
                )
            failed = list(self.entries.values())
            for entry in failed:
                entry.active = False
            self.entries.clear()
            for entry in failed:
                entry.target.on_failed(error, reason)
            self.channel.emit(KeepAliveEvent("failed", address, error, None))
            return
        # Full jitter: clients cut off together do not all come back at once.
        bound = min(
            self.channel.backoff_max, self.channel.backoff_initial * 2 ** min(self.failures, 20)
        )
        delay = random.random() * bound
        self.failures += 1
        self.address_index += 1
        if self.entries and not self.closed:
            self.reconnect = self.rt.call_later(delay, self._open)
        self.channel.emit(KeepAliveEvent("failed", address, error, delay))
        if self.reconnect is None:
            return
        limit = leases_per_stream_limit(error)
        if limit is not None:
            self.channel.lower_limit(self, limit)

    def _shutdown(self) -> None:
        if self.reconnect is not None:
            self.reconnect.cancel()
            self.reconnect = None
        stream = self.stream
        if stream is None:
            return
        self.stream = None
        if stream.stall_timer is not None:
            stream.stall_timer.cancel()
        if stream.handle is not None:
            stream.handle.close()
        addresses = self.channel.addresses
        self.channel.emit(KeepAliveEvent("closed", addresses[self.address_index % len(addresses)]))


class Registration:
    """A lease kept alive on the channel."""

    __slots__ = ("channel", "entry", "lane", "target")

    def __init__(self, channel: KeepAliveChannel, target: Target) -> None:
        self.channel = channel
        self.target = target
        self.lane = channel.lane_with_room()
        self.entry = self.lane.register(target)

    def renew(self) -> None:
        if self.channel.placed.get(self.entry.id) is self:
            self.lane.renew(self.entry)

    def remove(self) -> None:
        if self.channel.placed.get(self.entry.id) is not self:
            return
        self.lane.remove(self.entry)
        del self.channel.placed[self.entry.id]

    def settled(self, wake: Callable[[], None]) -> bool:
        """True when no renewal of this lease is on the way; else False, and
        ``wake`` is called (with the client's lock held) once none is."""
        if self.channel.placed.get(self.entry.id) is not self:
            return True
        return self.lane.settled(self.entry, wake)


class KeepAliveChannel:
    """The KeepAlive streams of one client, shared by every lease it keeps alive."""

    def __init__(
        self,
        rt: Runtime,
        addresses: list[str],
        *,
        max_leases_per_stream: int = 1000,
        refreshable_token: bool = False,
        backoff_initial: float = 0.1,
        backoff_max: float = 2.0,
        on_event: Callable[[KeepAliveEvent], None] | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("at least one server address is required")
        if max_leases_per_stream < 1:
            raise ValueError(
                "max_leases_per_stream must be a whole number of at least 1, "
                f"got {max_leases_per_stream}"
            )
        self.rt = rt
        self.addresses = addresses
        self.max_per_lane = max_leases_per_stream
        self.refreshable_token = refreshable_token
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.on_event = on_event
        self.lanes: list[_Lane] = []
        self.placed: dict[EntryId, Registration] = {}
        self.closed = False

    def emit(self, event: KeepAliveEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def register(self, target: Target) -> Registration:
        if self.closed:
            raise RuntimeError("the client is closed")
        registration = Registration(self, target)
        self.placed[registration.entry.id] = registration
        return registration

    def lane_with_room(self) -> _Lane:
        for lane in self.lanes:
            if lane.size < self.max_per_lane:
                return lane
        lane = _Lane(self)
        self.lanes.append(lane)
        return lane

    @property
    def open_streams(self) -> int:
        """Streams open now (for tests and logs)."""
        return sum(1 for lane in self.lanes if lane.stream is not None)

    def lower_limit(self, refused: _Lane, limit: int) -> None:
        """The server carries at most ``limit`` leases per stream and refused
        ``refused`` for carrying more: it keeps its first ``limit``; the rest
        move to lanes with room (new streams), renewed at once there."""
        if self.closed:
            return
        self.max_per_lane = min(self.max_per_lane, limit)
        for entry_id in list(refused.entries)[self.max_per_lane :]:
            registration = self.placed.get(entry_id)
            entry = refused.entries.pop(entry_id)
            entry.active = False
            _settle(entry)
            if registration is None:
                continue
            lane = self.lane_with_room()
            connected = lane.stream is not None
            registration.lane = lane
            registration.entry = lane.register(registration.target)
            if connected:
                lane.renew(registration.entry)

    def close(self) -> None:
        self.closed = True
        for lane in self.lanes:
            lane.close()
        self.placed.clear()


class HoldCore:
    """A held lease's state: its local deadline, renewals and loss (L2).

    ``notify`` is told once when the hold is lost; the blocking and asyncio
    holds set their event there (and the async ``run_exclusive`` cancels its
    task).
    """

    def __init__(
        self,
        rt: Runtime,
        channel: KeepAliveChannel,
        key: SessionKey,
        run_id: str,
        timing: LeaseTiming,
        lease: lease_pb2.Lease,
        deadline: float,
        notify: Callable[[str, str], None],
        on_handoff: Callable[[HandoffRequest], None],
    ) -> None:
        self.rt = rt
        self.key = key
        self.run_id = run_id
        self.timing = timing
        self.response_timeout = timing.renew_interval
        self.lease = lease
        self.deadline = deadline
        self.loss: tuple[str, str] | None = None
        self.ended = False
        self._notify = notify
        self._on_handoff = on_handoff
        self._deadline_timer: Timer | None = None
        self._renew_timer: Timer | None = None
        self.registration: Registration | None = channel.register(self)
        self._arm_deadline()
        self._schedule_renewal()

    # Target
    def on_renewed(self, lease: lease_pb2.Lease, sent_at: float | None) -> None:
        if self.loss is not None or self.ended:
            return
        # L2: a confirmation after the local deadline cannot revive the hold.
        if self.rt.now() >= self.deadline:
            self.lose("deadline", "the local deadline passed before a renewal was confirmed")
            return
        self.lease = lease
        if sent_at is None:
            return
        nxt = local_deadline(sent_at, lease, self.timing.margin)
        if nxt > self.deadline:
            # The deadline only moves later: the timer armed for the earlier
            # one stays, and when it fires it waits on for this one
            # (_deadline_due), instead of a timer cancelled and made anew on
            # every renewal of every lease.
            self.deadline = nxt

    def on_lost(self, cause: str | None) -> None:
        words = cause.replace("_", " ") if cause else "no reason given"
        self.lose(cause or "renewal_failed", f"the server reports the lease lost ({words})")

    def on_handoff(self, request: HandoffRequest) -> None:
        if self.loss is None and not self.ended:
            self._on_handoff(request)

    def on_failed(self, error: LeaseholdError, reason: str) -> None:
        self.lose(reason, f"renewals failed: {error.message}")

    # State
    def check_deadline(self) -> None:
        """Reads the monotonic clock: a passed deadline is a loss at once,
        even when the timer thread or the event loop has not run yet."""
        if self.loss is None and not self.ended and self.rt.now() >= self.deadline:
            self.lose("deadline", self._deadline_message())

    def _deadline_message(self) -> str:
        message = "the local deadline passed without a confirmed renewal"
        failure = self.registration.lane.last_failure if self.registration else None
        return f"{message} (the KeepAlive stream failed: {failure})" if failure else message

    def remaining(self) -> float:
        """Seconds to the local deadline (0 once lost or ended), read from the clock now."""
        self.check_deadline()
        if self.loss is not None or self.ended:
            return 0.0
        return max(0.0, self.deadline - self.rt.now())

    def loss_reason(self) -> str | None:
        """Why the lease was lost (a passed deadline counts now), or None."""
        self.check_deadline()
        return self.loss[0] if self.loss else None

    def check(self) -> None:
        """Raises LeaseLostError when the lease is lost or its local deadline
        has passed (read from the clock now, whatever the timers did), or
        when the hold has ended."""
        self.check_deadline()
        if self.loss is not None:
            raise LeaseLostError(self.loss[1], self.loss[0])
        if self.ended:
            raise released_error()

    def lose(self, reason: str, message: str) -> None:
        if self.loss is not None or self.ended:
            return
        self.loss = (reason, message)
        self._stop()
        self._notify(reason, message)

    def renewal_settled(self, wake: Callable[[], None]) -> bool:
        """The holder is done and about to release: no renewal is sent from
        now on. True when none is on the way; else False, and ``wake`` is
        called (with the client's lock held) once its answer came, the lease
        was lost, or its stream failed. The caller waits for that before
        ``end()`` and its Release: released first, the lease would be refused
        to its own renewal as "released", and the server would count a lost
        lease though its run ended it. The wait is bounded by the stream's
        stall watch (the response timeout) and by the local deadline, whose
        timer still runs."""
        if self._renew_timer is not None:
            self._renew_timer.cancel()
            self._renew_timer = None
        if self.loss is not None or self.ended or self.registration is None:
            return True
        return self.registration.settled(wake)

    def end(self) -> None:
        """The holder is done: stop keeping the lease alive (the caller releases it)."""
        if self.ended:
            return
        self.check_deadline()
        self.ended = True
        self._stop()

    def _stop(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._renew_timer is not None:
            self._renew_timer.cancel()
            self._renew_timer = None
        if self.registration is not None:
            self.registration.remove()
            self.registration = None

    def _arm_deadline(self) -> None:
        self._deadline_timer = self.rt.call_later(
            max(0.0, self.deadline - self.rt.now()), self._deadline_due
        )

    def _deadline_due(self) -> None:
        self._deadline_timer = None
        if self.loss is not None or self.ended:
            return
        if self.rt.now() >= self.deadline:
            self.lose("deadline", self._deadline_message())
        else:
            self._arm_deadline()

    def _schedule_renewal(self) -> None:
        self._renew_timer = self.rt.call_later(self.timing.renew_interval, self._renew_due)

    def _renew_due(self) -> None:
        if self.loss is not None or self.ended or self.registration is None:
            return
        self.registration.renew()
        self._schedule_renewal()
