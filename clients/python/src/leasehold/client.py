"""The blocking client: ``LeaseClient`` and its ``hold()``.

The I/O half of the client (``_client.py`` has the rest): channels, calls
sent on the calling thread, one timer thread and a reader thread per
KeepAlive stream, and the client's reentrant lock as its guard.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc

from ._client import (
    BaseClient,
    BaseHold,
    BaseKeeper,
    BaseKeeperHold,
    Call,
    ClientRuntime,
    HoldOptions,
    log,
)
from ._core import Grant, OnEnd, SendAcquire, SendRelease, acquire_flow
from ._election import (
    BaseLeadership,
    BaseObserver,
    CampaignOptions,
    ElectionView,
    ReadLease,
    campaign_cancelled,
    log_callback_failure,
    reconnect_delay,
)
from ._failover import Pause, Send
from ._flow import drive
from ._gen.leasehold.v1 import lease_pb2, lease_pb2_grpc
from ._keeper import KeeperLease
from ._tls import TlsCredentials
from .errors import (
    CanceledError,
    DeadlineExceededError,
    LeaseholdError,
    LeaseLostError,
    LeaseNotHeldError,
    NotAcquiredError,
    UnavailableError,
    from_rpc_error,
)
from .types import (
    ElectionChange,
    Event,
    HistoryResult,
    Leader,
    Lease,
    ReleaseFailure,
    SessionKey,
    Snapshot,
    watch_item,
)

T = TypeVar("T")
Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")

#: ``client``: the LeaseClient whose timer or KeepAlive reader this thread
#: is. Its callbacks run there with the client's lock held.
_client_thread = threading.local()


def _on_thread_of(client: LeaseClient) -> bool:
    return getattr(_client_thread, "client", None) is client


class _Timer:
    __slots__ = ("at", "cancelled", "fn", "seq")

    def __init__(self, at: float, seq: int, fn: Callable[[], None]) -> None:
        self.at = at
        self.seq = seq
        self.fn = fn
        self.cancelled = False

    def __lt__(self, other: _Timer) -> bool:
        return (self.at, self.seq) < (other.at, other.seq)

    def cancel(self) -> None:
        self.cancelled = True


class _Scheduler:
    """One thread per client runs every timer (renewals, deadlines, stall
    checks) with the client's lock held."""

    def __init__(self, client: LeaseClient, lock: threading.RLock) -> None:
        self._client = client
        self._cond = threading.Condition(lock)
        self._heap: list[_Timer] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        with self._cond:
            timer = _Timer(time.monotonic() + delay, next(self._seq), fn)
            heapq.heappush(self._heap, timer)
            if self._heap[0] is timer:
                self._cond.notify()
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, name="leasehold-timers", daemon=True
                )
                self._thread.start()
            return timer

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()

    def _run(self) -> None:
        _client_thread.client = self._client
        with self._cond:
            while not self._stopped:
                if not self._heap:
                    self._cond.wait()
                    continue
                head = self._heap[0]
                if head.cancelled:
                    heapq.heappop(self._heap)
                    continue
                wait = head.at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                try:
                    head.fn()
                except Exception:  # a callback's bug must not stop every timer
                    log.exception("leasehold: a timer callback failed")


class _ThreadStream:
    """A KeepAlive stream (or a keeper's Keep stream: ``method``) over a
    fresh channel, read on a thread of its own."""

    def __init__(
        self,
        client: LeaseClient,
        address: str,
        on_message: Callable[[Any], None],
        on_end: OnEnd,
        *,
        method: str = "KeepAlive",
    ) -> None:
        self._client = client
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._channel, self._call = client._open_keepalive(address, self._requests(), method)
        self._on_message = on_message
        self._on_end = on_end
        name = f"leasehold-{method.lower()}"
        threading.Thread(target=self._read, name=name, daemon=True).start()

    def _requests(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        _client_thread.client = self._client
        error: LeaseholdError | None = None
        lock = self._client._lock
        try:
            for message in self._call:
                with lock:
                    self._on_message(message)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
        except Exception as e:
            error = UnavailableError(f"the KeepAlive stream failed: {e!r}")
        finally:
            self._channel.close()
        with lock:
            self._on_end(error)

    def send(self, request: Any) -> None:
        self._queue.put(request)

    def close(self) -> None:
        self._queue.put(None)
        self._client._scheduler.call_later(1.0, self.cancel)

    def cancel(self) -> None:
        self._queue.put(None)
        self._call.cancel()


class _InFlight:
    """The waiting calls of one campaign, cancelled together from any
    thread (``Leadership.cancel()``): grpc's futures can be, a blocking
    call cannot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self._cancels: set[Callable[[], object]] = set()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            cancels = builtins.list(self._cancels)
        for cancel in cancels:
            cancel()

    @contextlib.contextmanager
    def watching(self, cancel: Callable[[], object]) -> Iterator[None]:
        """``cancel`` is called if the campaign is cancelled inside the block
        (at once when it was before)."""
        with self._lock:
            cancelled = self.cancelled
            if not cancelled:
                self._cancels.add(cancel)
        if cancelled:
            cancel()
        try:
            yield
        finally:
            with self._lock:
                self._cancels.discard(cancel)

    def call(self, method: Any, request: Any, timeout: float, metadata: Any) -> Any:
        """Sends a unary call that ``cancel()`` ends with CanceledError."""
        if self.cancelled:
            raise campaign_cancelled()
        future = method.future(request, timeout=timeout, metadata=metadata)
        with self.watching(future.cancel):
            try:
                return future.result()
            except grpc.FutureCancelledError as e:
                raise campaign_cancelled() from e


class Hold(BaseHold):
    """A session's lease held by this process (``with client.hold(key) as h``).

    Entering acquires with a client-chosen run id (a retry after a lost answer
    is idempotent: same token) and refuses a late grant; the lease is then
    renewed on the client's shared KeepAlive stream. ``lost`` is set the
    moment the client can no longer vouch for the lease (the server says it
    is lost, renewals fail for good, or the local deadline passes); stop all
    work and all writes then. Leaving releases the lease, unless it was lost:
    nothing is sent for a lost lease.
    """

    _client: LeaseClient
    lost: threading.Event
    handoff_requested: threading.Event
    #: A campaign's: its waiting Acquire can be cancelled from another thread.
    _in_flight: _InFlight | None = None

    def _new_flag(self) -> threading.Event:
        return threading.Event()

    def __enter__(self) -> Hold:
        self._start(drive(acquire_flow(self._wait), self._perform, Exception))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _perform(self, step: SendAcquire | SendRelease) -> Grant | None:
        """A step of ``acquire_flow``, on this thread (a release in the
        background on a thread of its own)."""
        if isinstance(step, SendAcquire):
            call = self._acquire_call(step)
            sent_at = time.monotonic()
            response = self._client._send(call, self._in_flight)
            return self._grant(response, sent_at, time.monotonic())
        if step.background:
            self._client._in_background(self._send_release)
        else:
            self._send_release()
        return None

    def _send_release(self) -> bool | None:
        try:
            return self._client._send(self._release_call())
        except Exception as error:
            self._release_failed(error)
            return None

    def _finish(self) -> None:
        settled = threading.Event()
        # Ended from a client callback (a handoff listener), this thread holds
        # the client's lock and is the one that would read the renewal's
        # answer or run the deadline timer: it releases at once instead.
        in_callback = _on_thread_of(self._client)
        core, waiting = self._stop_renewing(settled.set)
        if core is None:
            return
        if waiting and not in_callback:
            # Its renewal's answer (or a stall, or the deadline) first: see
            # HoldCore.renewal_settled. Bounded by the release's timeout too.
            settled.wait(self._release_timeout())
        if self._end(core):
            self.released = self._send_release()


class _Answer:
    """One answer a blocking caller waits for, set from a client thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.value: Any = None

    def set(self, value: Any) -> None:
        if not self._event.is_set():
            self.value = value
            self._event.set()

    def wait(self, timeout: float) -> Any:
        """The answer, or None when none came within ``timeout``."""
        return self.value if self._event.wait(timeout) else None


class KeeperHold(BaseKeeperHold, Hold):
    """A lease held on a keeper (``with keeper.hold(key) as h``), with the
    API of :class:`Hold`: acquired on the keeper's stream with a
    client-chosen run id, kept by the keeper's heartbeat (no renewal of its
    own), ``lost`` set the moment the keeper is lost, its local deadline
    passes, or the lease alone is revoked. Leaving releases it, unless it
    was lost.
    """

    _keeper: Keeper
    _usage = "with keeper.hold(key) as h"

    def __enter__(self) -> KeeperHold:
        answer = _Answer()
        with self._client._lock:
            keeper = self._keeper._state()
            give_up = keeper.acquire(self.key, self.run_id, self._wait, self.holder, answer.set)
        if self._in_flight is None:
            answer.wait(self._acquire_timeout())
        else:
            with self._in_flight.watching(lambda: answer.set(campaign_cancelled())):
                answer.wait(self._acquire_timeout())
        with self._client._lock:
            if not isinstance(answer.value, KeeperLease):
                # No grant (yet): one that still comes is released.
                give_up()
            self._adopt(answer.value)
        return self

    def _finish(self) -> None:
        answer = _Answer()
        if self._ending(answer.set) and not _on_thread_of(self._client):
            # Ended from a client callback (a handoff listener), this thread
            # is the one that would read the answer: the Release is sent,
            # not waited for.
            self._released(answer.wait(self._release_timeout()))


class Keeper(BaseKeeper[KeeperHold]):
    """A keeper (``with client.keeper(account_id, ttl=…) as k``): one Keep
    stream whose heartbeat, every third of ``ttl``, keeps every lease held
    on it (``k.hold(key)``), whatever their number.

    Its local deadline (L2) is each heartbeat's monotonic send time + the
    ``remaining`` the database answered − a margin (TTL/10); it only moves
    later, and an answer after it has passed does not revive it. ``lost`` is
    set, with every hold's, the moment the server says the keeper ended
    (expired, revoked) or the deadline passes. A stream that fails, ends or
    leaves a heartbeat unanswered for one heartbeat interval re-attaches to
    the same keeper over the next address, every lease kept. Leaving the
    block closes it: every lease on it is released (no lock-delay).
    """

    _client: LeaseClient
    lost: threading.Event
    _hold_type = KeeperHold

    def _new_flag(self) -> threading.Event:
        return threading.Event()

    def __enter__(self) -> Keeper:
        answer = _Answer()
        with self._client._lock:
            if self._core is not None:
                raise RuntimeError("a keeper is entered once")
            core = self._make_core()
            core.start(answer.set)
        answer.wait(self._client._timeout)
        with self._client._lock:
            result = answer.value
            if result is None:
                result = UnavailableError(
                    f"no server answered the keeper's open within {self._client._timeout:.1f}s"
                )
                core.abandon(result)
            if isinstance(result, Exception):
                raise result
            self._client._keepers.add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def run_exclusive(
        self,
        key: SessionKey,
        fn: Callable[[KeeperHold], T],
        *,
        wait: timedelta | float | None = None,
        holder: str | None = None,
        run_id: str | None = None,
    ) -> T:
        """Runs ``fn(hold)`` while holding the lease on this keeper, as
        :meth:`LeaseClient.run_exclusive` does (in the asyncio client, in a
        task cancelled the moment the lease is lost)."""
        with self.hold(key, wait=wait, holder=holder, run_id=run_id) as h:
            result = fn(h)
            h.check()
            return result

    def close(self) -> None:
        """Releases every lease on the keeper and ends it (no lock-delay);
        nothing is sent for a lost keeper. A failure is logged and kept in
        ``close_error``: the keeper then ends at its deadline."""
        core = self._closing()
        if core is None:
            return
        answer = _Answer()
        with self._client._lock:
            core.close(answer.set)
        if _on_thread_of(self._client):
            # Closed from a client callback: this thread would read the
            # answer; the close is sent, not waited for.
            return
        result = answer.wait(self._client._timeout)
        with self._client._lock:
            if result is None:
                result = DeadlineExceededError(
                    "no answer to the keeper's close", grpc.StatusCode.DEADLINE_EXCEEDED
                )
            core.abandon(UnavailableError("the keeper was closed"))
        if isinstance(result, Exception) and not isinstance(result, LeaseLostError):
            self._close_failed(result)


class Leadership(BaseLeadership[Hold]):
    """A campaign and then a term of leadership (``with
    client.campaign(account_id, election, value=…) as leadership``).

    Entering waits until this candidate leads (E1): the server's waiting
    Acquire, in arrival order, asked again with the same run id whenever one
    wait (``wait_chunk``) runs out. It raises — leaving no lease and no
    waiter on the server — when ``cancel()`` is called (CanceledError), when
    the waiting call fails (its connection lost: the error, e.g.
    UnavailableError; on a keeper, the keeper lost: LeaseLostError), or when
    ``timeout`` passes (NotAcquiredError naming the leader). It never
    returns without a live grant: a grant that arrives after its local
    deadline is released and the campaign goes on.

    Leading, ``term`` (= ``fencing_token``) is the grant's fencing token; the
    lease is kept alive as a hold's, and ``lost`` (a ``threading.Event``) is
    set before the database deadline when leadership can no longer be
    vouched for (L2); ``ended`` is set when the term is over, whatever ended
    it (``stop_reason``). Leaving the block resigns.
    """

    _client: LeaseClient
    lost: threading.Event
    ended: threading.Event

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight = _InFlight()

    def _new_flag(self) -> threading.Event:
        return threading.Event()

    def __enter__(self) -> Leadership:
        give_up_at = self._begin()
        while True:
            hold = self._attempt(give_up_at)
            hold._in_flight = self._in_flight
            try:
                hold.__enter__()
            except (NotAcquiredError, LeaseNotHeldError) as refused:
                self._refused(refused, give_up_at)
                continue
            except CanceledError as error:
                if self._cancelled:
                    raise campaign_cancelled() from error
                raise
            if self._won(hold):
                return self
            # Cancelled as the grant arrived: released, and no term reported.
            hold.__exit__(None, None, None)
            raise campaign_cancelled()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.resign()

    def proclaim(self, value: str) -> None:
        """Advertises ``value`` instead, keeping the term: an idempotent
        re-acquire by the same run (on the keeper when campaigning on one),
        whose token must be the term's. Raises LeaseLostError once
        leadership is lost or over, NotAcquiredError when the server no
        longer grants this term (S4)."""
        if self._keeper is None:
            answer = self._client._send(self._proclaim_acquire(value))
        else:
            waiting = _Answer()
            with self._client._lock:
                self._proclaim_on_keeper(value, waiting.set)
            answer = waiting.wait(self._client._timeout)
            if answer is None:
                answer = DeadlineExceededError(
                    "no answer to the keeper's Acquire", grpc.StatusCode.DEADLINE_EXCEEDED
                )
        release = self._proclaimed(value, answer)
        if isinstance(release, Call):
            self._client._send(release)
        elif release is not None:
            release()
        if release is not None:
            self.check()
            raise self._term_over()

    def resign(self) -> None:
        """Ends the term at once (on_stopped_leading first, then the Release)
        and lets the next candidate in. Idempotent; nothing is sent once
        leadership was lost."""
        hold = self._resigning()
        if hold is not None:
            hold.__exit__(None, None, None)

    def cancel(self) -> None:
        """From any thread: a campaign still waiting raises CanceledError
        (its waiting call cancelled, nothing left on the server); a term
        ends (``cancelled``) and its lease is released."""
        hold = self._cancelling()
        self._in_flight.cancel()
        if hold is not None:
            hold.__exit__(None, None, None)


class ElectionObserver(BaseObserver):
    """An election's changes (``for change in client.observe(account_id,
    election)``): the current leader first (``current``), then every change
    in order — a new term (``elected``), a proclaimed value
    (``proclaimed``), a term that ended with nobody after it (``ended``).

    It rests on Watch (with renewals, which carry proclaimed values). After a
    reconnect (the stream ended or failed: one unary call fails over first,
    and the Watch follows it to the instance that answered) and whenever the
    server sends a fresh snapshot, the terms granted meanwhile are read from
    History before the snapshot is applied, so no term is skipped; a term is
    yielded elected once and ended once. ``close()`` (from any thread, or
    leaving its ``with`` block) ends the iteration.
    """

    _client: LeaseClient

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closed_event = threading.Event()

    def __iter__(self) -> Iterator[ElectionChange]:
        client = self._client
        view: ElectionView | None = None
        reconnecting = False
        failures = 0
        while not self._closed:
            try:
                if view is None:
                    # Asked again, as the Watch is opened again, while no
                    # instance answers.
                    view = ElectionView(self.key, client.check_fence(self.key, 1).highest_token)
                # The Watch goes to the instance that answered the client's
                # last unary call, and unary calls fail over: one Get first
                # moves it to an instance that answers.
                if reconnecting:
                    client.get(self.key)
                reconnecting = True
                call = client._open_watch(self.key, include_renewals=True)
                if not self._watching(call):
                    return
                for message in call:
                    failures = 0
                    item = watch_item(message)
                    if isinstance(item, Snapshot):
                        yield from drive(view.snapshot_flow(item), self._read, ())
                    elif view.started:
                        change = view.apply(item)
                        if change is not None:
                            yield change
            except grpc.RpcError as e:
                self._failed(from_rpc_error(e))
            except LeaseholdError as error:
                self._failed(error)
            if self._closed:
                return
            failures += 1
            self._closed_event.wait(reconnect_delay(self._reconnect_delay, failures))

    def _read(self, step: str | ReadLease) -> HistoryResult | Lease | None:
        """A step of ``ElectionView.snapshot_flow``: a History page, or the lease now."""
        if isinstance(step, ReadLease):
            return self._client.get(self.key).lease
        return self._client.history(self.key, page_size=100, page_token=step)

    def close(self) -> None:
        """Ends the iteration (from any thread): the Watch is cancelled."""
        self._closed_event.set()
        self._closing()

    def __enter__(self) -> ElectionObserver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LeaseClient(BaseClient[Hold, Keeper, Leadership, ElectionObserver]):
    """A blocking client of ``leasehold.v1.LeaseService``.

    ``addresses`` is one ``host:port`` or several instances of one server
    (same database): unary calls fail over on UNAVAILABLE, and the KeepAlive
    stream reconnects to the next instance. ``token`` is a bearer JWT or a
    callable returning the current one (called for every call, and again
    whenever a stream reopens). ``root_certificates`` (PEM bytes) switches to
    TLS; ``tls`` (:class:`ClientTls`) gives the CA bundle, and a client
    certificate and key for mutual TLS, as files read again for new
    connections once they change. ``timeout`` is the deadline of a call
    without its own.
    """

    _hold_type = Hold
    _keeper_type = Keeper
    _leadership_type = Leadership
    _observer_type = ElectionObserver

    def _open_runtime(self) -> ClientRuntime:
        self._lock = threading.RLock()
        self._scheduler = _Scheduler(self, self._lock)
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, lease_pb2_grpc.LeaseServiceStub] = {}
        self._background: set[threading.Thread] = set()
        return ClientRuntime(
            self._scheduler.call_later,
            functools.partial(_ThreadStream, self),
            functools.partial(_ThreadStream, self, method="Keep"),
        )

    def _guard(self) -> threading.RLock:
        return self._lock

    def _in_background(self, fn: Callable[[], object]) -> None:
        """Runs ``fn`` on a thread of its own, which ``close()`` waits for."""

        def run() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    self._background.discard(thread)

        thread = threading.Thread(target=run, name="leasehold-release", daemon=True)
        with self._lock:
            self._background.add(thread)
        thread.start()

    # Connections and calls

    def _make_channel(self, address: str, *, fresh: bool = False) -> grpc.Channel:
        options = self._channel_options(fresh)
        if self._tls is not None:
            return grpc.secure_channel(address, self._tls.current()[1], options=options)
        return grpc.insecure_channel(address, options=options)

    def _retire_stale_channels(self, tls: TlsCredentials) -> None:
        """Once a TLS file has changed, the next calls go on new channels
        (grpcio cannot change a channel's credentials). The old ones are
        dropped, not closed: a call in flight on one goes on, and grpcio
        closes its connection once nothing uses it."""
        generation = tls.current()[0]
        if generation == self._tls_generation:
            return
        with self._lock:
            self._tls_generation = generation
            self._channels.clear()
            self._stubs.clear()

    def _stub(self, address: str) -> lease_pb2_grpc.LeaseServiceStub:
        if self._tls is not None:
            self._retire_stale_channels(self._tls)
        stub = self._stubs.get(address)
        if stub is None:
            with self._lock:
                stub = self._stubs.get(address)
                if stub is None:
                    channel = self._make_channel(address)
                    self._channels[address] = channel
                    stub = self._stubs[address] = lease_pb2_grpc.LeaseServiceStub(channel)
        return stub

    def _send(
        self, call: Call[Request, Response, Result], in_flight: _InFlight | None = None
    ) -> Result:
        """Sends a unary call on this thread, failing over (``_failover``);
        ``in_flight``: a campaign's, which may cancel it from another thread."""
        metadata = self._metadata()

        def perform(step: Pause | Send) -> Response | None:
            if isinstance(step, Pause):
                time.sleep(step.seconds)
                return None
            method = call.method(self._stub(step.address))
            if in_flight is not None:
                response: Response = in_flight.call(method, call.request, step.timeout, metadata)
                return response
            return method(call.request, timeout=step.timeout, metadata=metadata)

        return self._answered(call, drive(self._failover(call), perform, grpc.RpcError))

    def _bind(self, describe: Callable[..., Call[Any, Any, Any]]) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            return self._send(describe(self, *args, **kwargs))

        return method

    # Streams

    def watch(
        self,
        key: SessionKey,
        *,
        include_renewals: bool = False,
        timeout: timedelta | float | None = None,
    ) -> Generator[Snapshot | Event, None, None]:
        """A snapshot, then every change, until the generator is closed (or ``timeout``)."""
        call = self._open_watch(key, include_renewals=include_renewals, timeout=timeout)
        try:
            for message in call:
                yield watch_item(message)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and call.cancelled():
                return
            raise from_rpc_error(e) from e
        finally:
            call.cancel()

    def keep_alive(
        self, requests: Iterable[lease_pb2.KeepAliveRequest]
    ) -> Iterator[lease_pb2.KeepAliveResponse]:
        """The raw KeepAlive stream (``hold()`` shares one for every lease)."""
        call = self._stub(self.addresses[self._preferred]).KeepAlive(
            iter(requests), metadata=self._auth.metadata()
        )
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    # Holding a lease

    def run_exclusive(
        self, key: SessionKey, fn: Callable[[Hold], T], **options: Unpack[HoldOptions]
    ) -> T:
        """Runs ``fn(hold)`` while holding the lease (``options`` as ``hold()``
        takes them). A thread cannot be stopped from outside: ``fn`` checks
        ``hold.check()`` / ``hold.lost`` itself, and a result it returns after
        the loss is not returned: :class:`LeaseLostError` is raised instead."""
        with self.hold(key, **options) as h:
            result = fn(h)
            h.check()
            return result

    def run_election(
        self,
        account_id: str,
        election: str,
        lead: Callable[[Leadership], object],
        *,
        on_new_leader: Callable[[Leader], None] | None = None,
        again: bool = True,
        stop: threading.Event | None = None,
        **options: Unpack[CampaignOptions],
    ) -> None:
        """Campaigns (``options`` as ``campaign()`` takes them), runs
        ``lead(leadership)`` while leading, resigns when ``lead`` returns (or
        raises: the error is raised after), and campaigns again (unless
        ``again`` is False) until ``stop`` is set. A thread cannot be stopped
        from outside: ``lead`` watches ``leadership.ended`` itself (set on
        loss, and when ``stop`` ends the term: ``cancelled``). A campaign
        whose waiting call was lost (UnavailableError,
        DeadlineExceededError: an instance gone, a connection reset or
        stalled) is started again after a backoff (100 ms doubling to 2 s,
        full jitter); any other campaign error is raised.
        ``on_new_leader(leader)`` is called (on a thread of its own) for
        every new leader and proclaimed value, this candidate's terms
        included."""
        over = threading.Event()
        current: builtins.list[Leadership] = []
        threads: builtins.list[threading.Thread] = []
        observer = self.observe(account_id, election) if on_new_leader is not None else None
        if observer is not None and on_new_leader is not None:
            threads.append(
                threading.Thread(
                    target=_report_leaders, args=(observer, on_new_leader), daemon=True
                )
            )
        if stop is not None:

            def watch_stop() -> None:
                # An Event cannot be waited on with another: read every 50 ms.
                while not over.is_set():
                    if stop.wait(0.05):
                        with self._lock:
                            leaderships = builtins.list(current)
                        for leadership in leaderships:
                            leadership.cancel()
                        return

            threads.append(threading.Thread(target=watch_stop, daemon=True))
        for thread in threads:
            thread.start()
        stopped = stop.is_set if stop is not None else lambda: False
        try:
            failures = 0
            terms = 0
            while not stopped() and (terms == 0 or again):
                leadership = self.campaign(account_id, election, **options)
                with self._lock:
                    current[:] = [leadership]
                if stopped():
                    return
                try:
                    leadership.__enter__()
                except (UnavailableError, DeadlineExceededError):
                    # The waiting call's connection or instance went away:
                    # campaign again (a new run id) after a backoff.
                    failures += 1
                    delay = reconnect_delay(0.1, failures)
                    if stop is not None:
                        stop.wait(delay)
                    else:
                        time.sleep(delay)
                    continue
                except CanceledError:
                    if stopped():
                        return
                    raise
                failures = 0
                terms += 1
                try:
                    lead(leadership)
                finally:
                    leadership.resign()
        finally:
            over.set()
            if observer is not None:
                observer.close()
            for thread in threads:
                thread.join()

    def close(self) -> builtins.list[ReleaseFailure]:
        """Releases every lease still held (not lost) and closes the
        connections. Returns the releases that failed (also logged)."""
        with self._lock:
            if self._closed:
                return []
            keepers = builtins.list(self._keepers)
            holds = builtins.list(self._holds)
        for k in keepers:
            k.close()
        for h in holds:
            h._finish()
        with self._lock:
            background = builtins.list(self._background)
        # The releases of acquires whose answer was lost: done (or failed,
        # and logged) before close() returns, never on closed channels after.
        for thread in background:
            thread.join()
        with self._lock:
            self._closed = True
            self._keepalive.close()
            self._scheduler.stop()
            channels = builtins.list(self._channels.values())
        for channel in channels:
            channel.close()
        return self._release_failures(holds)

    def __enter__(self) -> LeaseClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _report_leaders(observer: ElectionObserver, on_new_leader: Callable[[Leader], None]) -> None:
    """run_election's on_new_leader, on a thread of its own until the observer closes."""
    try:
        for change in observer:
            if change.leader is not None:
                try:
                    on_new_leader(change.leader)
                except Exception:
                    log_callback_failure("on_new_leader")
    except LeaseholdError as error:
        log.warning("leasehold: observing the election for on_new_leader failed: %s", error)
