"""Leader election (DESIGN E1) on a session key, the part both clients
share, doing no I/O: what a campaign decides, a term's state and what its
leader reads, and what ``observe()`` makes of Watch and History.

An election is the session ``SessionKey(account_id, election)`` of the
account, so it shares the data model, quotas, ACLs, audit history and web
page of every other session. The leader is the run that holds the
session's lease; its term is the grant's fencing token (S6); its value is
the lease's holder label. A campaign is a hold (``client.hold()``, or
``keeper.hold()`` on a keeper) whose Acquire waits: the grant, the
late-grant refusal, the keep-alive, the local deadline (L2) and "no release
after loss" are the hold's, unchanged. What this module adds is the waiting
loop (one waiting Acquire is bounded by the server's ``--max-wait``), the
one-call-per-term callbacks, proclaim's check, and observe's gap-free
change stream. src/client/election.ts is the TypeScript twin.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Generic, Protocol, Required, TypedDict, TypeVar

import grpc

from ._client import BaseClient, BaseHold, BaseKeeper, Call, acquire_request, release_request
from ._core import lease_timing
from ._gen.leasehold.v1 import lease_pb2
from ._keeper import KeeperLease
from .errors import (
    CanceledError,
    InvalidArgumentError,
    LateGrantError,
    LeaseholdError,
    LeaseLostError,
    LeaseNotHeldError,
    NotAcquiredError,
)
from .types import (
    AcquireResult,
    ElectionChange,
    Event,
    HistoryResult,
    Leader,
    Lease,
    SessionKey,
    Snapshot,
    StopReason,
    acquire_result,
    lease_from,
    normalize_run_id,
    release_result,
    seconds,
)

log = logging.getLogger("leasehold")

#: The longest label the server keeps (its ``holder`` limit), and so the longest value.
MAX_VALUE_LENGTH = 64
#: The longest single waiting Acquire of a campaign, by default (the
#: server's ``--max-wait`` is 5 min by default).
DEFAULT_WAIT_CHUNK = 60.0
DEFAULT_TTL = 10.0

#: Watch errors after which opening it again cannot succeed.
_STOP_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)

_ENDINGS = {"RELEASED": "resigned", "EXPIRED": "expired", "REVOKED": "revoked"}

HoldT = TypeVar("HoldT", bound="BaseHold")


def check_value(value: str) -> str:
    """The advertised value: the lease's holder label, so at most 64 characters."""
    if not isinstance(value, str):
        raise TypeError(f"value must be a str, got {value!r}")
    if len(value) > MAX_VALUE_LENGTH:
        rule = (
            f"must be at most {MAX_VALUE_LENGTH} characters (it is the lease's holder label), "
            f"got {len(value)}"
        )
        raise InvalidArgumentError(f"value {rule}", "value", rule)
    return value


def leader_of(lease: Lease) -> Leader:
    return Leader(lease.holder, lease.fencing_token, lease.run_id, lease.expires_at)


def leader_result(r: lease_pb2.GetResponse) -> Leader | None:
    """``leader()``'s answer: the lease's holder, or None when nobody leads."""
    if not r.held or not r.HasField("lease"):
        return None
    return leader_of(lease_from(r.lease))


def log_callback_failure(name: str) -> None:
    """A callback of the caller's raised: logged, never raised into the client."""
    log.exception("leasehold: %s failed", name)


def campaign_cancelled() -> CanceledError:
    return CanceledError("the campaign was cancelled", grpc.StatusCode.CANCELLED)


def stop_observing(error: LeaseholdError) -> bool:
    """Whether observing ends with ``error`` (else the Watch opens again)."""
    return error.code in _STOP_CODES


def reconnect_delay(base: float, failures: int) -> float:
    """A full-jitter backoff before the Watch (or a campaign) starts again:
    ``base`` doubling per failure, up to 2 s."""
    return random.random() * min(2.0, base * 2.0 ** min(failures, 5))


class CampaignOptions(TypedDict, total=False):
    """The keyword arguments of ``campaign()``, which ``run_election`` passes on."""

    value: Required[str]
    ttl: timedelta | float | None
    safety_margin: timedelta | float | None
    renew_interval: timedelta | float | None
    keeper: Any
    timeout: timedelta | float | None
    wait_chunk: timedelta | float
    on_started_leading: Callable[[int], None] | None
    on_stopped_leading: Callable[[int, StopReason], None] | None


class ReadLease:
    """A step of ``ElectionView.snapshot_flow``: the election's lease now (a
    Get), sent back as the Lease, or None when nobody holds it."""


READ_LEASE = ReadLease()


class ElectionView:
    """What ``observe()`` knows of an election, and the change (if any)
    each event, snapshot or History page makes. Deduplicated by term: a
    term is reported elected once and ended once, whether it was seen on
    the stream, in History, or both."""

    def __init__(self, key: SessionKey, highest: int) -> None:
        self.key = key
        #: The highest term seen: every grant committed before observing
        #: began has a token at most this (S6), so none of them is a change.
        self.highest = highest
        self.current: Leader | None = None
        #: The first snapshot was reported (as ``current``).
        self.started = False

    def apply(self, event: Event) -> ElectionChange | None:
        """One event of the stream or of History; the change it makes."""
        if event.type == "ACQUIRED":
            if event.fencing_token <= self.highest:
                return None
            self.highest = event.fencing_token
            # History's events carry no lease: the leader from the event's fields.
            self.current = (
                leader_of(event.lease)
                if event.lease is not None
                else Leader(event.holder, event.fencing_token, event.run_id, None)
            )
            return ElectionChange("elected", self.current, self.current.term)
        current = self.current
        if event.type == "RENEWED" and event.lease is not None:
            if current is None or current.term != event.fencing_token:
                return None
            if event.lease.holder == current.value:
                return None
            self.current = leader_of(event.lease)
            return ElectionChange("proclaimed", self.current, self.current.term)
        how = _ENDINGS.get(event.type)
        if how is None or current is None or current.term != event.fencing_token:
            return None
        self.current = None
        return ElectionChange("ended", None, current.term, how)

    def snapshot_flow(
        self, snapshot: Snapshot
    ) -> Generator[str | ReadLease, HistoryResult | Lease | None, list[ElectionChange]]:
        """The changes a snapshot brings. The first is the ``current`` item.
        A later one (a reconnect, or a fresh snapshot the server sent
        because it could not vouch that nothing was missed) may hide terms
        that began and ended meanwhile: History is read back to the last
        term seen first (the flow yields each page's token and is sent the
        page), then the snapshot says what History could not (trimmed by
        age, or an expiry not recorded yet). History is read after the
        snapshot was taken: a term it shows that the snapshot does not may
        have begun in between, so whether it still leads is read (the flow
        yields READ_LEASE and is sent the lease, or None) before it is said
        to have ended."""
        lease = next((x for x in snapshot.leases if x.key.session_id == self.key.session_id), None)
        if not self.started:
            self.started = True
            self.current = leader_of(lease) if lease is not None else None
            if lease is not None and lease.fencing_token > self.highest:
                self.highest = lease.fencing_token
            term = self.current.term if self.current is not None else 0
            return [ElectionChange("current", self.current, term)]
        missed: list[Event] = []
        page_token = ""
        while True:
            page = yield page_token
            assert isinstance(page, HistoryResult)
            reached = False
            for event in page.events:
                # Newest first: stop at the grant of the last term seen (its
                # end, recorded after it, is kept) or anything older.
                if event.fencing_token < self.highest or (
                    event.fencing_token == self.highest and event.type == "ACQUIRED"
                ):
                    reached = True
                    break
                missed.append(event)
            if reached or not page.next_page_token:
                break
            page_token = page.next_page_token
        known, before = self.highest, self.current
        changes = [c for c in map(self.apply, reversed(missed)) if c is not None]
        current = self.current
        if lease is not None and lease.fencing_token > self.highest:
            self.highest = lease.fencing_token
            self.current = leader_of(lease)
            changes.append(ElectionChange("elected", self.current, self.current.term))
        elif lease is None and current is not None:
            if current.term > known:
                # Elected in History, absent from the snapshot: granted after
                # it (still held: its end comes on the stream), or ended
                # before it unrecorded (not held: it ends here).
                try:
                    now = yield READ_LEASE
                except BaseException:
                    # Not read: History's changes are not yielded, so they
                    # are not seen either; the next snapshot reads them again.
                    self.highest, self.current = known, before
                    raise
                assert now is None or isinstance(now, Lease)
                if now is not None and now.fencing_token == current.term:
                    return changes
            self.current = None
            changes.append(ElectionChange("ended", None, current.term, "expired"))
        elif (
            lease is not None
            and current is not None
            and current.term == lease.fencing_token
            and lease.holder != current.value
        ):
            self.current = leader_of(lease)
            changes.append(ElectionChange("proclaimed", self.current, self.current.term))
        return changes


class _Flag(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...


class BaseLeadership(Generic[HoldT]):
    """The no-I/O half of ``Leadership`` and ``AsyncLeadership``: the
    campaign's settings and decisions, the term's state, and what the leader
    reads, each behind the client's guard."""

    lost: _Flag
    ended: _Flag
    _usage = "with client.campaign(account_id, election, value=…) as leadership"

    def __init__(
        self,
        client: BaseClient[Any, Any, Any, Any],
        account_id: str,
        election: str,
        *,
        value: str,
        ttl: timedelta | float | None,
        safety_margin: timedelta | float | None,
        renew_interval: timedelta | float | None,
        keeper: BaseKeeper[Any] | None,
        timeout: timedelta | float | None,
        wait_chunk: timedelta | float,
        run_id: str,
        on_started_leading: Callable[[int], None] | None,
        on_stopped_leading: Callable[[int, StopReason], None] | None,
    ) -> None:
        self._client = client
        self.account_id = account_id
        self.election = election
        #: The election's session key.
        self.key = SessionKey(account_id, election)
        #: This candidate's run id, the same for every waiting Acquire of the
        #: campaign (a new one after a late grant, whose lease ended).
        self.run_id = run_id
        #: The value advertised now.
        self.value = check_value(value)
        if keeper is not None:
            if ttl is not None or safety_margin is not None or renew_interval is not None:
                raise ValueError(
                    "ttl, safety_margin and renew_interval are the keeper's on a keeper: leave "
                    "them out"
                )
            if keeper.account_id != account_id:
                raise ValueError(
                    f"keeper is of account {keeper.account_id!r}, not of the election's "
                    f"{account_id!r}"
                )
        self._timing = lease_timing(
            ttl if ttl is not None else DEFAULT_TTL, safety_margin, renew_interval
        )
        self._keeper = keeper
        self._timeout = seconds("timeout", timeout)
        if self._timeout is not None and self._timeout < 0:
            raise ValueError(f"timeout must be at least 0, got {timeout!r}")
        chunk = seconds("wait_chunk", wait_chunk)
        if chunk is None or not chunk > 0:
            raise ValueError(f"wait_chunk must be a positive duration, got {wait_chunk!r}")
        self._wait_chunk = chunk
        self._on_started_leading = on_started_leading
        self._on_stopped_leading = on_stopped_leading
        #: The term: this grant's fencing token (0 until leading).
        self.term = 0
        #: The same number, as fences read it.
        self.fencing_token = 0
        #: Why the term ended, once it has.
        self.stop_reason: StopReason | None = None
        #: Set when leadership is lost (revoked, expired, taken over, the
        #: local deadline passed): stop acting as leader. Set before the
        #: database deadline (L2).
        self.lost = self._new_flag()
        #: Set when the term is over, whatever ended it (``stop_reason`` says what).
        self.ended = self._new_flag()
        self._hold: HoldT | None = None
        self._entered = False
        self._cancelled = False
        self._last_seen: Lease | None = None

    def _new_flag(self) -> _Flag:
        raise NotImplementedError

    # The campaign, for the I/O half

    def _begin(self) -> float:
        """The campaign starts: when it gives up (monotonic; inf: never)."""
        with self._client._guard():
            if self._entered:
                raise RuntimeError("a leadership is entered once: call campaign() again")
            self._entered = True
            if self._cancelled:
                raise campaign_cancelled()
        return math.inf if self._timeout is None else time.monotonic() + self._timeout

    def _attempt(self, give_up_at: float) -> HoldT:
        """The hold of the next waiting Acquire: the same run id, a wait cut
        to end at the campaign's timeout."""
        wait = max(0.0, min(self._wait_chunk, give_up_at - time.monotonic()))
        if self._keeper is not None:
            hold: HoldT = self._keeper.hold(
                self.key, wait=wait, holder=self.value, run_id=self.run_id
            )
        else:
            hold = self._client.hold(
                self.key,
                ttl=self._timing.ttl,
                safety_margin=self._timing.margin,
                renew_interval=self._timing.renew_interval,
                wait=wait,
                holder=self.value,
                run_id=self.run_id,
            )
        return hold

    def _refused(self, error: NotAcquiredError | LeaseNotHeldError, give_up_at: float) -> None:
        """A waiting Acquire ended without a grant (its wait ran out), with a
        late one (refused and released), or with one that the re-acquire
        confirming it found ended (LeaseNotHeldError: its answer came after
        the lease's own deadline): returns to campaign again; raises once the
        campaign is cancelled or its timeout has passed (NotAcquiredError
        naming the leader)."""
        if self._cancelled:
            raise campaign_cancelled() from error
        if isinstance(error, (LateGrantError, LeaseNotHeldError)):
            # That run's lease ended, and a run whose lease ended never
            # holds the session again (S4): a new run asks.
            self.run_id = normalize_run_id(None)
            return
        self._last_seen = error.current or self._last_seen
        if time.monotonic() < give_up_at:
            return
        raise NotAcquiredError(
            f"election {self.account_id}/{self.election} not won within {self._timeout}s",
            self._last_seen,
            lock_delay_until=error.lock_delay_until,
        ) from error

    def _won(self, hold: HoldT) -> bool:
        """The grant is this candidate's: the term begins (on_started_leading,
        called before the campaign returns). False when the campaign was
        cancelled as the grant arrived: the caller releases it and reports
        no term."""
        with self._client._guard():
            if self._cancelled:
                return False
            self._hold = hold
            self.term = self.fencing_token = hold.fencing_token
            hold._on_loss = self._lost
            if self._on_started_leading is not None:
                try:
                    self._on_started_leading(self.term)
                except Exception:
                    log_callback_failure("on_started_leading")
            # Lost between the grant and here: the term still gets its one
            # on_stopped_leading.
            if hold.lost.is_set():
                try:
                    hold.check()
                except LeaseLostError as lost:
                    self._lost(lost.loss_reason, lost.message)
        return True

    def _lost(self, reason: str, message: str) -> None:
        """The hold was lost (with the client's guard held)."""
        self.lost.set()
        self._stop(StopReason("lost", LeaseLostError(message, reason)))

    def _stop(self, reason: StopReason) -> bool:
        """The term ends: the first ending is the one reported, once
        (on_stopped_leading). False when it had ended already, or never began."""
        with self._client._guard():
            if self.stop_reason is not None or self._hold is None:
                return False
            self.stop_reason = reason
            self.ended.set()
            self._ended()
            if self._on_stopped_leading is not None:
                try:
                    self._on_stopped_leading(self.term, reason)
                except Exception:
                    # A callback's own failure must not keep the term from ending.
                    log_callback_failure("on_stopped_leading")
        return True

    def _ended(self) -> None:
        """The term is over (the asyncio leadership cancels run_election's ``lead``)."""

    def _cancelling(self) -> HoldT | None:
        """``cancel()`` was called: the held lease to release (None while
        campaigning, or once the term has ended)."""
        with self._client._guard():
            self._cancelled = True
            hold = self._hold
        if hold is None or not self._stop(StopReason("cancelled", campaign_cancelled())):
            return None
        return hold

    def _resigning(self) -> HoldT | None:
        """``resign()`` was called: the held lease to release; the term's
        end is reported before its Release goes out, so the leader stops
        acting before a successor can be granted."""
        hold = self._hold
        if hold is None:
            return None
        self._stop(StopReason("resigned"))
        return hold

    # Proclaim, for the I/O half

    def _proclaim_acquire(self, value: str) -> Any:
        """The Call of an idempotent re-acquire by this run advertising
        ``value`` (the server keeps the token and takes the label)."""
        check_value(value)
        self.check()
        request = acquire_request(self.key, self.run_id, self._timing.ttl, None, value)
        return Call("Acquire", lambda stub: stub.Acquire, request, acquire_result, None)

    def _proclaim_on_keeper(self, value: str, done: Callable[[Any], None]) -> None:
        """The re-acquire on the keeper (a plain Acquire names no keeper, and
        the server would refuse it the lease); ``done`` gets the answer.
        With the client's guard held."""
        check_value(value)
        self.check()
        hold = self._held()
        assert self._keeper is not None
        keeper = self._keeper._state()
        own: KeeperLease | None = getattr(hold, "_lease", None)

        def answered(answer: Any) -> None:
            if (
                isinstance(answer, KeeperLease)
                and answer.lease.fencing_token == self.term
                and own is not None
                and not own.ended
                and own.loss is None
            ):
                # The keeper registered the answer as a lease of its own:
                # the hold's lease stays the one the keeper tells of a loss.
                keeper.leases[own.id] = own
                own.lease = answer.lease
                answer = AcquireResult(True, lease_from(answer.lease), None, None)
            done(answer)

        keeper.acquire(self.key, self.run_id, 0.0, value, answered)

    def _proclaimed(
        self, value: str, answer: Any
    ) -> Callable[[], None] | Call[Any, Any, bool] | None:
        """The re-acquire's answer. Raises unless the term goes on with the
        new value; returns how to release a grant that came with another
        token (the term had ended and the same run id was granted afresh:
        on a keeper, a function; else the Release to send), for the caller
        to do before it raises (``check()``'s LeaseLostError, else
        ``_term_over()``)."""
        if isinstance(answer, LeaseholdError):
            raise answer
        if isinstance(answer, KeeperLease):
            fresh = answer
            keeper = self._keeper
            assert keeper is not None

            def release_on_keeper() -> None:
                with self._client._guard():
                    keeper._state().release(fresh, lambda _: None)

            return release_on_keeper
        result: AcquireResult = answer
        if result.acquired and result.lease is not None and result.lease.fencing_token == self.term:
            self.check()
            self.value = value
            return None
        if result.acquired:
            request = release_request(self.key, self.run_id)
            return Call("Release", lambda stub: stub.Release, request, release_result, None)
        raise NotAcquiredError(
            f"term {self.term} of {self.account_id}/{self.election} is over: "
            "the value was not changed",
            result.current,
        )

    def _term_over(self) -> NotAcquiredError:
        """Proclaim's error once the server no longer grants this term."""
        return NotAcquiredError(
            f"term {self.term} of {self.account_id}/{self.election} is over: "
            "the value was not changed",
            None,
        )

    # For the leader

    def _held(self) -> HoldT:
        hold = self._hold
        if hold is None:
            raise RuntimeError(f"not leading yet: use `{self._usage}`")
        return hold

    @property
    def lease(self) -> Lease:
        """The lease as last confirmed by the server."""
        return self._held().lease

    @property
    def loss_reason(self) -> str | None:
        """Why leadership was lost (see LeaseLostError), or None."""
        return self._held().loss_reason

    def remaining(self) -> timedelta:
        """Time to the local deadline, read from the monotonic clock now."""
        return self._held().remaining()

    def check(self) -> None:
        """Raises LeaseLostError once leadership is lost or its local
        deadline has passed (read from the clock now), or the term has ended
        (``released``)."""
        self._held().check()

    def on_handoff(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Calls ``listener`` for every handoff request someone sends the
        leader (earlier ones included); returns a function that removes it."""
        return self._held().on_handoff(listener)

    def fencing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The three fencing headers of this term, as gRPC metadata; raises
        LeaseLostError once the term is over."""
        return self._held().fencing_metadata()

    def fencing_headers(self) -> dict[str, str]:
        """The three fencing headers of this term, for an HTTP client."""
        return self._held().fencing_headers()


class BaseObserver:
    """The no-I/O half of ``ElectionObserver`` and ``AsyncElectionObserver``."""

    def __init__(
        self, client: BaseClient[Any, Any, Any, Any], key: SessionKey, reconnect_delay: float
    ) -> None:
        self._client = client
        #: The election's session key.
        self.key = key
        self._reconnect_delay = reconnect_delay
        self._closed = False
        self._call: Any = None

    def _watching(self, call: Any) -> bool:
        """The Watch ``call`` is open; False when the observer was closed meanwhile."""
        with self._client._guard():
            if self._closed:
                call.cancel()
                return False
            self._call = call
            return True

    def _closing(self) -> None:
        with self._client._guard():
            self._closed = True
            call, self._call = self._call, None
        if call is not None:
            call.cancel()

    def _failed(self, error: LeaseholdError) -> None:
        """The Watch (or a call before it) failed: raises when observing
        cannot go on; returns to open it again."""
        if not self._closed and stop_observing(error):
            raise error
