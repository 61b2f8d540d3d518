"""A keeper (docs/keepers.md): one Keep stream whose heartbeat keeps every
lease acquired on it, shared by the blocking and the asyncio client.

As ``_core``, nothing here blocks or locks: the client's runtime supplies
the clock, timers and the stream, and calls in with its guard held. The
keeper's local deadline (L2) follows the rules of a lease's
(``HoldCore``): each heartbeat's (or re-attach's) monotonic send time + the
``remaining`` the database answered − the margin; it only ever moves later,
and an answer that arrives after it has passed does not revive the keeper.
Passing it loses the keeper and, at once, every lease on it. A stream that
fails, ends, or leaves a heartbeat unanswered for one heartbeat interval is
replaced by a stream to the next address, which re-attaches to the same
keeper id (the server renews it then) and sends again every request still
unanswered: an Acquire by its run id (idempotent, same token; a waiting one
with what is left of its wait), a Release by its run id (S5), the close.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import grpc
from google.protobuf import duration_pb2

from ._core import LeaseTiming, Timer, not_acquired, released_error
from ._gen.leasehold.v1 import lease_pb2
from .errors import (
    KEEPER_NOT_HELD,
    LeaseholdError,
    LeaseLostError,
    UnauthenticatedError,
    UnavailableError,
    from_status_message,
)
from .types import (
    HandoffRequest,
    SessionKey,
    duration,
    handoff_from,
    loss_cause,
    seconds_of,
)


class KeepStream(Protocol):
    def send(self, request: lease_pb2.KeepRequest) -> None: ...

    def close(self) -> None:
        """Half-closes; cuts the stream if the server has not ended it a second later."""

    def cancel(self) -> None: ...


OnKeepMessage = Callable[[lease_pb2.KeepResponse], None]
OnKeepEnd = Callable[[LeaseholdError | None], None]


class KeeperRuntime(Protocol):
    """What a keeper needs from its client. Callbacks run with the client's guard held."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...

    def open_keep(
        self, address: str, on_message: OnKeepMessage, on_end: OnKeepEnd
    ) -> KeepStream: ...


@dataclass(frozen=True, slots=True)
class KeeperEvent:
    """Something that happened to a keeper's stream (for logs and tests)."""

    #: ``open`` (the stream opened), ``attached`` (the keeper answered the
    #: open or re-attach), ``failed`` or ``closed``.
    type: str
    address: str
    error: LeaseholdError | None = None
    #: Seconds until the next attempt, for ``failed``; None when final.
    retry_in: float | None = None


#: Stream errors after which another attempt cannot succeed.
_DEFINITIVE = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

#: What a request's ``done`` is called with: its answer, or why there is none.
Done = Callable[[lease_pb2.KeepResponse | LeaseholdError], None]


class _Pending:
    __slots__ = ("abandoned", "done", "request", "wait_until")

    def __init__(self, request: lease_pb2.KeepRequest, done: Done) -> None:
        self.request = request
        self.done = done
        #: The caller stopped waiting: a grant that still comes is released.
        self.abandoned = False
        #: A waiting acquire's: when its wait ends (monotonic, from its first send).
        self.wait_until: float | None = None

    def sent_again(self, now: float) -> lease_pb2.KeepRequest:
        """The request to send again on a re-attached stream: a waiting
        acquire waits only what is left of its wait (its caller's timeout
        counts from the first send), none once that has run out."""
        if self.wait_until is not None:
            left = self.wait_until - now
            if left > 0:
                self.request.acquire.wait.CopyFrom(duration_of(left))
            else:
                self.request.acquire.ClearField("wait")
        return self.request


class _Open:
    """One Keep stream of the keeper."""

    __slots__ = ("address", "attached", "generation", "handle", "heartbeats", "open_id")

    def __init__(self, generation: int, address: str, open_id: int) -> None:
        self.generation = generation
        self.address = address
        self.open_id = open_id
        self.handle: KeepStream | None = None
        #: The open (or re-attach) was answered: requests may go out.
        self.attached = False
        #: Unanswered heartbeats (and the open), by request id: their send times.
        self.heartbeats: dict[int, float] = {}


LeaseId = tuple[str, str, str]


class KeeperLease:
    """A lease held on a keeper: what a keeper's hold reads (``BaseHold``'s
    lease state). Its local deadline is its keeper's."""

    def __init__(
        self,
        keeper: KeeperCore,
        key: SessionKey,
        run_id: str,
        lease: lease_pb2.Lease,
    ) -> None:
        self.keeper = keeper
        self.key = key
        self.run_id = run_id
        self.lease = lease
        self.loss: tuple[str, str] | None = None
        self.ended = False
        #: Told once when the lease is lost (reason, message); set by the hold.
        self.notify: Callable[[str, str], None] = lambda reason, message: None
        self.on_handoff: Callable[[HandoffRequest], None] = lambda request: None

    @property
    def id(self) -> LeaseId:
        return (self.key.account_id, self.key.session_id, self.run_id)

    def lose(self, reason: str, message: str) -> None:
        if self.loss is not None or self.ended:
            return
        self.loss = (reason, message)
        self.keeper.leases.pop(self.id, None)
        self.notify(reason, message)

    def end(self) -> bool:
        """The holder is done: True when the lease is to be released (not lost)."""
        self.check_deadline()
        if self.ended:
            return False
        self.ended = True
        self.keeper.leases.pop(self.id, None)
        return self.loss is None

    def check_deadline(self) -> None:
        self.keeper.check_deadline()

    def remaining(self) -> float:
        """Seconds to the keeper's local deadline (0 once lost or ended)."""
        self.check_deadline()
        if self.loss is not None or self.ended:
            return 0.0
        return max(0.0, self.keeper.deadline - self.keeper.rt.now())

    def loss_reason(self) -> str | None:
        self.check_deadline()
        return self.loss[0] if self.loss else None

    def check(self) -> None:
        self.check_deadline()
        if self.loss is not None:
            raise LeaseLostError(self.loss[1], self.loss[0])
        if self.ended:
            raise released_error()


class KeeperCore:
    """One keeper: its stream, heartbeats, local deadline, requests and leases.

    ``notify`` is told once when the keeper is lost (reason, message): every
    lease on it is lost at that moment too.
    """

    def __init__(
        self,
        rt: KeeperRuntime,
        addresses: list[str],
        *,
        account_id: str,
        keeper_id: str,
        holder: str,
        timing: LeaseTiming,
        lock_delay: float,
        notify: Callable[[str, str], None],
        refreshable_token: bool = False,
        backoff_initial: float = 0.1,
        backoff_max: float = 2.0,
        on_event: Callable[[KeeperEvent], None] | None = None,
    ) -> None:
        self.rt = rt
        self.addresses = addresses
        self.account_id = account_id
        self.keeper_id = keeper_id
        self.holder = holder
        self.timing = timing
        self.lock_delay = lock_delay
        self._notify = notify
        self.refreshable_token = refreshable_token
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.on_event = on_event
        #: The local deadline (monotonic); none before the keeper is opened.
        self.deadline = float("-inf")
        #: The keeper as the server last answered it (open, heartbeat, close).
        self.state: lease_pb2.Keeper | None = None
        self.loss: tuple[str, str] | None = None
        #: Closed by its holder (CloseKeeper answered, or given up on).
        self.closed = False
        self.leases: dict[LeaseId, KeeperLease] = {}
        #: Heartbeats sent, re-attaches included (for tests and logs).
        self.heartbeats_sent = 0
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._stream: _Open | None = None
        self._generation = 0
        self._address_index = 0
        self._failures = 0
        self._last_failure: str | None = None
        self._opened: Done | None = None
        self._reconnect: Timer | None = None
        self._heartbeat_timer: Timer | None = None
        self._deadline_timer: Timer | None = None

    # The keeper's life

    def start(self, opened: Done) -> None:
        """Opens the stream; ``opened`` is called with the first open's
        answer, or its definitive refusal (an unreachable instance is
        retried on the next address until the caller gives up: ``abandon``)."""
        self._opened = opened
        self._open()

    @property
    def done(self) -> bool:
        return self.loss is not None or self.closed

    def close(self, done: Done) -> None:
        """Releases every lease on the keeper and ends it (CloseKeeper; no
        lock-delay). Nothing is sent for a lost keeper: ``done`` is told its
        loss."""
        for lease in list(self.leases.values()):
            lease.end()
        if self.loss is not None:
            done(LeaseLostError(self.loss[1], self.loss[0]))
            return
        if self.closed:
            done(released_error())
            return
        self._request(lease_pb2.KeepRequest(close=lease_pb2.CloseKeeper()), done)

    def abandon(self, error: LeaseholdError) -> None:
        """Stops everything here at once (the holder gave up waiting, or is
        gone): the stream is cut, unanswered requests fail with ``error``."""
        if not self.done:
            self.closed = True
        for lease in list(self.leases.values()):
            lease.end()
        self._teardown(cut=True)
        self._fail_pending(error)

    # Requests on the stream

    def acquire(
        self,
        key: SessionKey,
        run_id: str,
        wait: float,
        holder: str,
        done: Callable[[KeeperLease | LeaseholdError], None],
    ) -> Callable[[], None]:
        """Acquires ``key`` on the keeper; ``done`` gets the lease, or the
        error (NotAcquiredError with the holder or the lock-delay). The
        lease is registered the moment its grant is read, so a loss right
        behind it on the stream finds it. Returns a function that gives up
        waiting: an acquire that waits and is still unanswered is given up on
        the server too (a release of its run on the stream, which answers it
        CANCELLED and leaves no waiter), and a grant that comes after it is
        released."""
        request = lease_pb2.AcquireRequest(key=key.to_proto(), run_id=run_id, holder=holder)
        if wait > 0:
            request.wait.CopyFrom(duration_of(wait))

        # Set once sent; a keeper that has ended answers before that.
        sent: list[_Pending] = []

        def answered(answer: lease_pb2.KeepResponse | LeaseholdError) -> None:
            done(self._grant(key, run_id, answer, sent[0] if sent else None))

        pending = self._request(lease_pb2.KeepRequest(acquire=request), answered)
        if pending is not None:
            sent.append(pending)
            if wait > 0:
                pending.wait_until = self.rt.now() + wait

        def give_up() -> None:
            if pending is None or pending.abandoned:
                return
            pending.abandoned = True
            if wait > 0 and self._pending.get(pending.request.id) is pending:
                # A waiting acquire stays queued on the server until its wait
                # runs out; a release of its run gives it up there (and ends a
                # grant that raced it), so a cancelled candidate leaves no
                # waiter ahead of the others.
                release = lease_pb2.ReleaseRequest(key=key.to_proto(), run_id=run_id)
                self._request(lease_pb2.KeepRequest(release=release), lambda answer: None)

        return give_up

    def _grant(
        self,
        key: SessionKey,
        run_id: str,
        answer: lease_pb2.KeepResponse | LeaseholdError,
        pending: _Pending | None,
    ) -> KeeperLease | LeaseholdError:
        if isinstance(answer, LeaseholdError):
            return answer
        kind = answer.WhichOneof("result")
        if kind != "acquire":
            return UnavailableError(f"the server answered an Acquire with {kind}")
        response = answer.acquire
        if not response.acquired or not response.HasField("lease"):
            return not_acquired(key, response)
        lease = KeeperLease(self, key, run_id, response.lease)
        if pending is not None and pending.abandoned:
            self.release(lease, lambda answer: None)
            return UnavailableError("the grant came after the hold stopped waiting; released")
        self.check_deadline()
        if self.loss is not None:
            # Past the local deadline: the grant cannot be vouched for. No
            # release (nothing is sent for a lost keeper's leases); it ends
            # with the keeper.
            return LeaseLostError(self.loss[1], self.loss[0])
        self.leases[lease.id] = lease
        return lease

    def release(self, lease: KeeperLease, done: Done) -> bool:
        """Ends the hold of ``lease``; releases it (True, ``done`` getting
        the answer) unless it was lost or the keeper ended (False, nothing
        sent)."""
        if not lease.end() or self.done:
            return False
        request = lease_pb2.ReleaseRequest(key=lease.key.to_proto(), run_id=lease.run_id)
        self._request(lease_pb2.KeepRequest(release=request), done)
        return True

    def _request(self, request: lease_pb2.KeepRequest, done: Done) -> _Pending | None:
        if self.done:
            error = (
                LeaseLostError(self.loss[1], self.loss[0])
                if self.loss is not None
                else _closed_error()
            )
            done(error)
            return None
        request.id = self._new_id()
        pending = _Pending(request, done)
        self._pending[request.id] = pending
        stream = self._stream
        if stream is not None and stream.attached and stream.handle is not None:
            stream.handle.send(request)
        # Else it goes out once the stream (re-)attaches.
        return pending

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # The local deadline (L2)

    def check_deadline(self) -> None:
        """Reads the monotonic clock: a passed deadline loses the keeper at
        once, even when the timer has not run yet."""
        if not self.done and self._stream_ever_attached and self.rt.now() >= self.deadline:
            self.lose("deadline", self._deadline_message())

    @property
    def _stream_ever_attached(self) -> bool:
        return self.deadline != float("-inf")

    def remaining(self) -> float:
        self.check_deadline()
        if self.done:
            return 0.0
        return max(0.0, self.deadline - self.rt.now())

    def _deadline_message(self) -> str:
        message = "the keeper's local deadline passed without a confirmed heartbeat"
        if self._last_failure:
            return f"{message} (the Keep stream failed: {self._last_failure})"
        return message

    def _renewed(self, keeper: lease_pb2.Keeper, sent_at: float) -> None:
        """A heartbeat's (or an open's) answer: the deadline moves to its
        send time + remaining − margin, if that is later, unless it has
        passed already (a late answer never revives the keeper)."""
        if self.done:
            return
        if self._stream_ever_attached and self.rt.now() >= self.deadline:
            self.lose("deadline", self._deadline_message())
            return
        self.state = keeper
        self.keeper_id = keeper.keeper_id or self.keeper_id
        nxt = sent_at + seconds_of(keeper.remaining) - self.timing.margin
        first = not self._stream_ever_attached
        if nxt > self.deadline:
            self.deadline = nxt
        if first:
            self._arm_deadline()
            self._schedule_heartbeat()

    def _arm_deadline(self) -> None:
        self._deadline_timer = self.rt.call_later(
            max(0.0, self.deadline - self.rt.now()), self._deadline_due
        )

    def _deadline_due(self) -> None:
        self._deadline_timer = None
        if self.done:
            return
        if self.rt.now() >= self.deadline:
            self.lose("deadline", self._deadline_message())
        else:
            # Moved later since it was armed: one timer, re-armed when it
            # fires, rather than one made anew for every heartbeat.
            self._arm_deadline()

    def lose(self, reason: str, message: str) -> None:
        """The keeper is lost: every lease on it at once, then the holder."""
        if self.done:
            return
        self.loss = (reason, message)
        for lease in list(self.leases.values()):
            lease.lose(reason, message)
        self._teardown(cut=True)
        self._fail_pending(LeaseLostError(message, reason))
        self._notify(reason, message)

    # Heartbeats

    def _schedule_heartbeat(self) -> None:
        self._heartbeat_timer = self.rt.call_later(self.timing.renew_interval, self._heartbeat_due)

    def _heartbeat_due(self) -> None:
        self._heartbeat_timer = None
        if self.done:
            return
        stream = self._stream
        if stream is not None and stream.attached and stream.handle is not None:
            request = lease_pb2.KeepRequest(id=self._new_id(), heartbeat=lease_pb2.Heartbeat())
            self._send_timed(stream, request)
        # While reconnecting the re-attach renews the keeper.
        self._schedule_heartbeat()

    def _send_timed(self, stream: _Open, request: lease_pb2.KeepRequest) -> None:
        """Sends an open or a heartbeat, watched: unanswered for one
        heartbeat interval, the stream counts as stalled and is replaced."""
        assert stream.handle is not None
        sent_at = self.rt.now()
        stream.heartbeats[request.id] = sent_at
        self.heartbeats_sent += 1
        stream.handle.send(request)
        interval = self.timing.renew_interval

        def watch() -> None:
            if self._stream is stream and request.id in stream.heartbeats:
                what = "the open" if request.id == stream.open_id else "a heartbeat"
                self._fail(
                    stream,
                    UnavailableError(f"no answer to {what} within {interval * 1000:.0f}ms"),
                )

        self.rt.call_later(interval, watch)

    # The stream

    def _open(self) -> None:
        self._reconnect = None
        if self.done:
            return
        address = self.addresses[self._address_index % len(self.addresses)]
        self._generation += 1
        stream = _Open(self._generation, address, self._new_id())
        self._stream = stream

        def on_message(message: lease_pb2.KeepResponse) -> None:
            if self._stream is stream:
                self._dispatch(stream, message)

        def on_end(error: LeaseholdError | None) -> None:
            if self._stream is stream:
                self._fail(stream, error or UnavailableError("the server ended the Keep stream"))

        try:
            stream.handle = self.rt.open_keep(address, on_message, on_end)
        except LeaseholdError as error:
            self._fail(stream, error)
            return
        self._emit(KeeperEvent("open", address))
        request = lease_pb2.KeepRequest(
            id=stream.open_id,
            open=lease_pb2.OpenKeeper(
                account_id=self.account_id,
                keeper_id=self.keeper_id,
                holder=self.holder,
                ttl=duration_of(self.timing.ttl),
                lock_delay=duration_of(self.lock_delay),
            ),
        )
        self._send_timed(stream, request)

    def _dispatch(self, stream: _Open, message: lease_pb2.KeepResponse) -> None:
        kind = message.WhichOneof("result")
        if kind == "lost":
            # Unasked, or the answer of the heartbeat that found the keeper ended.
            cause = loss_cause(message.lost.reason) or "expired"
            detail = f": {message.lost.detail}" if message.lost.detail else ""
            words = cause.replace("_", " ")
            self.lose(cause, f"the server reports the keeper lost ({words}{detail})")
            return
        if message.id == stream.open_id:
            self._on_open(stream, message, kind)
            return
        if message.id in stream.heartbeats:
            sent_at = stream.heartbeats.pop(message.id)
            if kind == "keeper":
                self._failures = 0
                self._last_failure = None
                self._renewed(message.keeper, sent_at)
            elif kind == "error":
                self._refused(stream, from_status_message(message.error))
            return
        if message.id != 0:
            pending = self._pending.pop(message.id, None)
            if pending is None:
                return
            if kind == "keeper" and pending.request.WhichOneof("op") == "close":
                self.state = message.keeper
                self.closed = True
                self._teardown(cut=False)
            pending.done(from_status_message(message.error) if kind == "error" else message)
            return
        if kind == "lease_lost":
            lost = message.lease_lost
            lease = self.leases.get((lost.key.account_id, lost.key.session_id, lost.run_id))
            if lease is not None:
                cause = loss_cause(lost.reason) or "revoked"
                lease.lose(cause, f"the server reports the lease lost ({cause.replace('_', ' ')})")
        elif kind == "handoff_requested":
            asked = message.handoff_requested
            lease = self.leases.get((asked.key.account_id, asked.key.session_id, asked.run_id))
            if lease is not None:
                lease.on_handoff(handoff_from(asked.request))

    def _on_open(self, stream: _Open, message: lease_pb2.KeepResponse, kind: str | None) -> None:
        sent_at = stream.heartbeats.pop(stream.open_id, None)
        if kind == "error":
            self._refused(stream, from_status_message(message.error))
            return
        if kind != "keeper" or sent_at is None:
            self._fail(stream, UnavailableError(f"the server answered the open with {kind}"))
            return
        self._failures = 0
        self._last_failure = None
        self._renewed(message.keeper, sent_at)
        if self.done:
            return
        stream.attached = True
        self._emit(KeeperEvent("attached", stream.address))
        opened, self._opened = self._opened, None
        if opened is not None:
            opened(message)
        assert stream.handle is not None
        now = self.rt.now()
        for pending in list(self._pending.values()):
            stream.handle.send(pending.sent_again(now))

    def _refused(self, stream: _Open, error: LeaseholdError) -> None:
        """The server refused the open or a heartbeat: the keeper is not
        valid (expired, revoked, another account's), or the request was bad."""
        if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._fail(stream, error)
            return
        opened, self._opened = self._opened, None
        if opened is not None:
            self.closed = True
            self._teardown(cut=True)
            self._fail_pending(error)
            opened(error)
            return
        cause = error.metadata.get("cause") if error.reason == KEEPER_NOT_HELD else None
        self.lose(cause or "renewal_failed", f"the server refused the keeper: {error.message}")

    def _fail(self, stream: _Open, error: LeaseholdError) -> None:
        if self._stream is not stream:
            return
        self._stream = None
        if stream.handle is not None:
            stream.handle.cancel()
        self._last_failure = f"{stream.address}: {error.message}"
        if self.done:
            return
        failure = error.failure if isinstance(error, UnauthenticatedError) else None
        renewable = failure in ("expired", "certificate_expired") and self.refreshable_token
        if error.code in _DEFINITIVE and not renewable:
            self._emit(KeeperEvent("failed", stream.address, error, None))
            opened, self._opened = self._opened, None
            if opened is not None:
                self.closed = True
                self._teardown(cut=True)
                self._fail_pending(error)
                opened(error)
                return
            # A re-attach to a keeper that ended is refused with its cause
            # (KEEPER_NOT_HELD: expired, revoked, closed, not_found).
            reason = "token_expired" if failure == "expired" else "renewal_failed"
            if error.reason == KEEPER_NOT_HELD:
                reason = error.metadata.get("cause") or reason
            self.lose(reason, f"the Keep stream was refused: {error.message}")
            return
        # Full jitter: keepers cut off together do not all come back at once.
        bound = min(self.backoff_max, self.backoff_initial * 2 ** min(self._failures, 20))
        delay = random.random() * bound
        self._failures += 1
        self._address_index += 1
        self._reconnect = self.rt.call_later(delay, self._open)
        self._emit(KeeperEvent("failed", stream.address, error, delay))

    def _teardown(self, *, cut: bool) -> None:
        for timer in (self._reconnect, self._heartbeat_timer, self._deadline_timer):
            if timer is not None:
                timer.cancel()
        self._reconnect = self._heartbeat_timer = self._deadline_timer = None
        stream, self._stream = self._stream, None
        if stream is None or stream.handle is None:
            return
        if cut:
            stream.handle.cancel()
        else:
            stream.handle.close()
        self._emit(KeeperEvent("closed", stream.address))

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for item in pending.values():
            item.done(error if isinstance(error, LeaseholdError) else UnavailableError(str(error)))
        opened, self._opened = self._opened, None
        if opened is not None:
            opened(error if isinstance(error, LeaseholdError) else UnavailableError(str(error)))

    def _emit(self, event: KeeperEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)


def _closed_error() -> LeaseholdError:
    """A request on a keeper its holder closed."""
    return LeaseholdError("the keeper is closed", grpc.StatusCode.FAILED_PRECONDITION)


def duration_of(value: float) -> duration_pb2.Duration:
    return duration(timedelta(seconds=value))
