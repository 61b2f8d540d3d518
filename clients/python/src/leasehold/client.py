"""The blocking client: ``LeaseClient`` and its ``hold()``."""

from __future__ import annotations

import builtins
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import grpc

from . import _common as c
from ._core import (
    Grant,
    HoldCore,
    KeepAliveChannel,
    KeepAliveEvent,
    LeaseTiming,
    OnEnd,
    OnMessage,
    grant_of,
    lease_timing,
    release_timeout,
)
from ._gen.leasehold.v1 import lease_pb2, lease_pb2_grpc
from ._tls import ClientTls, TlsCredentials, credentials_of
from .errors import (
    LateGrantError,
    LeaseholdError,
    NotAcquiredError,
    UnavailableError,
    from_rpc_error,
)
from .types import (
    AcquireResult,
    CheckFenceResult,
    Event,
    GetResult,
    HandoffRequest,
    HandoffResult,
    HistoryResult,
    Lease,
    ListResult,
    ReleaseFailure,
    RevokeResult,
    SessionKey,
    Snapshot,
    lease_from,
    normalize_run_id,
)

T = TypeVar("T")


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

    def __init__(self, lock: threading.RLock) -> None:
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
                    c.log.exception("leasehold: a timer callback failed")


class _ThreadStream:
    """A KeepAlive stream over a fresh channel, read on a thread of its own."""

    def __init__(
        self, client: LeaseClient, address: str, on_message: OnMessage, on_end: OnEnd
    ) -> None:
        metadata = client._auth.metadata()
        self._client = client
        self._queue: queue.SimpleQueue[lease_pb2.KeepAliveRequest | None] = queue.SimpleQueue()
        self._channel = client._make_channel(address, c.FRESH_CONNECTION)
        stub = lease_pb2_grpc.LeaseServiceStub(self._channel)
        self._call: Any = stub.KeepAlive(self._requests(), metadata=metadata)
        self._on_message = on_message
        self._on_end = on_end
        threading.Thread(target=self._read, name="leasehold-keepalive", daemon=True).start()

    def _requests(self) -> Iterator[lease_pb2.KeepAliveRequest]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
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

    def send(self, request: lease_pb2.KeepAliveRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        self._queue.put(None)
        self._client._scheduler.call_later(1.0, self.cancel)

    def cancel(self) -> None:
        self._queue.put(None)
        self._call.cancel()


class _Runtime:
    def __init__(self, client: LeaseClient) -> None:
        self._client = client

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        return self._client._scheduler.call_later(delay, fn)

    def open_stream(self, address: str, on_message: OnMessage, on_end: OnEnd) -> _ThreadStream:
        return _ThreadStream(self._client, address, on_message, on_end)


class LeaseClient:
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

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: c.Token = None,
        root_certificates: bytes | None = None,
        tls: ClientTls | None = None,
        timeout: timedelta | float = c.DEFAULT_TIMEOUT,
        max_leases_per_stream: int = 1000,
        on_event: Callable[[KeepAliveEvent], None] | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.addresses = c.normalize_addresses(addresses)
        self._auth = c.Auth(token)
        self._tls = credentials_of(tls, root_certificates)
        # The credentials' generation the unary channels were made with.
        self._tls_generation = self._tls.current()[0] if self._tls is not None else 0
        self._timeout = c.seconds("timeout", timeout) or c.DEFAULT_TIMEOUT
        self._options = list(channel_options)
        self._lock = threading.RLock()
        self._scheduler = _Scheduler(self._lock)
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, lease_pb2_grpc.LeaseServiceStub] = {}
        self._preferred = 0
        self._closed = False
        self._holds: set[Hold] = set()
        self._keepalive = KeepAliveChannel(
            _Runtime(self),
            self.addresses,
            max_leases_per_stream=max_leases_per_stream,
            # A stream ended at its certificate's expiry reopens with the
            # files read again, as one ended at its token's with a fresh token.
            refreshable_token=self._auth.refreshable
            or (token is None and self._tls is not None and self._tls.presents_certificate),
            on_event=on_event,
        )

    # Connections and calls

    def _make_channel(self, address: str, extra: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        options = [*self._options, *extra]
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

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """A unary call, failing over to the next instance on UNAVAILABLE;
        an idempotent call then tries each instance once more (``attempt_plan``),
        all within the call's one deadline."""
        if self._closed:
            raise RuntimeError("the client is closed")
        metadata = self._auth.metadata()
        limit = timeout if timeout is not None else self._timeout
        attempts = c.Attempts(method, request, self.addresses, self._preferred, limit)
        for position, index in enumerate(attempts.plan):
            # Every attempt, a failover or a retry, shares the call's deadline.
            pause = attempts.pause(position)
            if pause > 0:
                time.sleep(pause)
            remaining = attempts.remaining()
            if remaining is None:
                break
            address = self.addresses[index]
            try:
                response = getattr(self._stub(address), method)(
                    request, timeout=remaining, metadata=metadata
                )
                self._preferred = index
                return response
            except grpc.RpcError as e:
                attempts.failed(address, e)
        raise attempts.unavailable() from attempts.last

    # LeaseService, one method per RPC

    def acquire(
        self,
        key: SessionKey,
        *,
        ttl: timedelta | float,
        wait: timedelta | float | None = None,
        holder: str = "",
        run_id: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> AcquireResult:
        """Acquire once (no renewals). A random run id is chosen when none is
        given, so a retry of this request is idempotent (same token)."""
        request = c.acquire_request(c.as_key(key), normalize_run_id(run_id), ttl, wait, holder)
        limit = c.seconds("timeout", timeout) or self._timeout + (c.seconds("wait", wait) or 0)
        return c.acquire_result(self._call("Acquire", request, limit))

    def renew(
        self,
        key: SessionKey,
        run_id: str,
        *,
        ttl: timedelta | float | None = None,
        timeout: timedelta | float | None = None,
    ) -> Lease:
        request = c.renew_request(c.as_key(key), normalize_run_id(run_id), ttl)
        response = self._call("Renew", request, c.seconds("timeout", timeout))
        return lease_from(response.lease)

    def release(
        self, key: SessionKey, run_id: str, *, timeout: timedelta | float | None = None
    ) -> bool:
        request = c.release_request(c.as_key(key), normalize_run_id(run_id))
        return bool(self._call("Release", request, c.seconds("timeout", timeout)).released)

    def get(self, key: SessionKey, *, timeout: timedelta | float | None = None) -> GetResult:
        request = lease_pb2.GetRequest(key=c.as_key(key).to_proto())
        return c.get_result(self._call("Get", request, c.seconds("timeout", timeout)))

    def list(
        self,
        account_id: str,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: timedelta | float | None = None,
    ) -> ListResult:
        request = lease_pb2.ListRequest(
            account_id=account_id, page_size=page_size, page_token=page_token
        )
        return c.list_result(self._call("List", request, c.seconds("timeout", timeout)))

    def request_handoff(
        self,
        key: SessionKey,
        *,
        requester_holder: str = "",
        reason: str = "",
        timeout: timedelta | float | None = None,
    ) -> HandoffResult:
        request = lease_pb2.RequestHandoffRequest(
            key=c.as_key(key).to_proto(), requester_holder=requester_holder, reason=reason
        )
        return c.handoff_result(
            self._call("RequestHandoff", request, c.seconds("timeout", timeout))
        )

    def history(
        self,
        key: SessionKey,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: timedelta | float | None = None,
    ) -> HistoryResult:
        request = lease_pb2.HistoryRequest(
            key=c.as_key(key).to_proto(), page_size=page_size, page_token=page_token
        )
        return c.history_result(self._call("History", request, c.seconds("timeout", timeout)))

    def check_fence(
        self, key: SessionKey, fencing_token: int, *, timeout: timedelta | float | None = None
    ) -> CheckFenceResult:
        request = lease_pb2.CheckFenceRequest(
            key=c.as_key(key).to_proto(), fencing_token=fencing_token
        )
        return c.check_fence_result(
            self._call("CheckFence", request, c.seconds("timeout", timeout))
        )

    def revoke(
        self, key: SessionKey, *, reason: str, timeout: timedelta | float | None = None
    ) -> RevokeResult:
        request = lease_pb2.RevokeRequest(key=c.as_key(key).to_proto(), reason=reason)
        return c.revoke_result(self._call("Revoke", request, c.seconds("timeout", timeout)))

    def watch(
        self,
        key: SessionKey,
        *,
        include_renewals: bool = False,
        timeout: timedelta | float | None = None,
    ) -> Generator[Snapshot | Event, None, None]:
        """A snapshot, then every change, until the generator is closed (or ``timeout``)."""
        request = lease_pb2.WatchRequest(
            key=c.as_key(key).to_proto(), include_renewals=include_renewals
        )
        call = self._stub(self.addresses[self._preferred]).Watch(
            request, timeout=c.seconds("timeout", timeout), metadata=self._auth.metadata()
        )
        try:
            for message in call:
                yield c.watch_item(message)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and call.cancelled():  # type: ignore[attr-defined]
                return
            raise from_rpc_error(e) from e
        finally:
            call.cancel()  # type: ignore[no-untyped-call]

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
    ) -> Hold:
        """A lease held for a ``with`` block: acquired on entry, kept alive,
        released on exit (never after loss). See :class:`Hold`."""
        return Hold(
            self,
            c.as_key(key),
            lease_timing(ttl, safety_margin, renew_interval),
            c.seconds("wait", wait) or 0.0,
            holder or "",
            normalize_run_id(run_id),
        )

    def run_exclusive(
        self,
        key: SessionKey,
        fn: Callable[[Hold], T],
        *,
        ttl: timedelta | float = timedelta(seconds=10),
        wait: timedelta | float | None = None,
        holder: str | None = None,
        run_id: str | None = None,
        safety_margin: timedelta | float | None = None,
        renew_interval: timedelta | float | None = None,
    ) -> T:
        """Runs ``fn(hold)`` while holding the lease. A thread cannot be
        stopped from outside: ``fn`` checks ``hold.check()`` / ``hold.lost``
        itself, and a result it returns after the loss is not returned:
        :class:`LeaseLostError` is raised instead."""
        with self.hold(
            key,
            ttl=ttl,
            wait=wait,
            holder=holder,
            run_id=run_id,
            safety_margin=safety_margin,
            renew_interval=renew_interval,
        ) as h:
            result = fn(h)
            h.check()
            return result

    @property
    def keepalive_streams(self) -> int:
        """KeepAlive streams open now."""
        with self._lock:
            return self._keepalive.open_streams

    def close(self) -> builtins.list[ReleaseFailure]:
        """Releases every lease still held (not lost) and closes the
        connections. Returns the releases that failed (also logged)."""
        with self._lock:
            if self._closed:
                return []
            holds = list(self._holds)
        failures: builtins.list[ReleaseFailure] = []
        for h in holds:
            h._finish()
            if h.release_error is not None:
                failures.append(ReleaseFailure(h.key, h.run_id, h.release_error))
        with self._lock:
            self._closed = True
            self._keepalive.close()
            self._scheduler.stop()
            channels = list(self._channels.values())
        for channel in channels:
            channel.close()
        return failures

    def __enter__(self) -> LeaseClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Hold:
    """A session's lease held by this process (``with client.hold(key) as h``).

    Entering acquires with a client-chosen run id (a retry after a lost answer
    is idempotent: same token) and refuses a late grant; the lease is then
    renewed on the client's shared KeepAlive stream. ``lost`` is set the
    moment the client can no longer vouch for the lease (the server says it
    is lost, renewals fail for good, or the local deadline passes); stop all
    work and all writes then. Leaving releases the lease, unless it was lost:
    nothing is sent for a lost lease.
    """

    def __init__(
        self,
        client: LeaseClient,
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
        self.lost = threading.Event()
        #: Set when another holder asked for the session (``handoff_requests`` has them).
        self.handoff_requested = threading.Event()
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

    # Acquiring

    def _attempt(self, wait: float) -> Grant:
        request = c.acquire_request(self.key, self.run_id, self._timing.ttl, wait, self.holder)
        sent_at = time.monotonic()
        response = self._client._call("Acquire", request, wait + self._client._timeout)
        return grant_of(self.key, response, sent_at, time.monotonic(), self._timing.margin)

    def _release_in_background(self) -> None:
        # The grant may have happened with its answer lost: release by run id
        # (a no-op when nothing was granted) rather than block the session.
        threading.Thread(target=self._send_release, daemon=True).start()

    def _release_timeout(self) -> float:
        return release_timeout(self._client._timeout, self._timing)

    def _send_release(self) -> bool | None:
        try:
            request = c.release_request(self.key, self.run_id)
            return bool(self._client._call("Release", request, self._release_timeout()).released)
        except Exception as error:
            self.release_error = error
            c.log_release_failure(self.key, self.run_id, error)
            return None

    def __enter__(self) -> Hold:
        try:
            grant = self._attempt(self._wait)
        except NotAcquiredError:
            raise
        except Exception:
            self._release_in_background()
            raise
        if grant.late and self._wait > 0:
            self.confirmed = True
            # A waited grant can be older than its answer: confirm it with an
            # idempotent re-acquire (same run id, same token), its deadline
            # counted from the new request.
            try:
                grant = self._attempt(0)
            except Exception:
                self._send_release()
                raise
        if grant.late:
            self._send_release()
            raise LateGrantError(lease_from(grant.lease), grant.elapsed)
        self.fencing_token = grant.lease.fencing_token
        with self._client._lock:
            self._core = HoldCore(
                _Runtime(self._client),
                self._client._keepalive,
                self.key,
                self.run_id,
                self._timing,
                grant.lease,
                grant.deadline,
                self._on_lost,
                self._on_handoff,
            )
            self._client._holds.add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        settled = threading.Event()
        # Ended from a client callback (a handoff listener), this thread holds
        # the client's lock and is the one that would read the renewal's
        # answer or run the deadline timer: it releases at once instead.
        in_callback: bool = self._client._lock._is_owned()  # type: ignore[attr-defined]
        with self._client._lock:
            if self._finished or self._core is None:
                return
            core = self._core
            self._finished = True
            self._client._holds.discard(self)
            waiting = not core.renewal_settled(settled.set)
        if waiting and not in_callback:
            # Its renewal's answer (or a stall, or the deadline) first: see
            # HoldCore.renewal_settled. Bounded by the release's timeout too.
            settled.wait(self._release_timeout())
        with self._client._lock:
            core.end()
            lost = core.loss is not None
        if not lost:
            self.released = self._send_release()

    # Called with the client's lock held

    def _on_lost(self, reason: str, message: str) -> None:
        self.lost.set()

    def _on_handoff(self, request: HandoffRequest) -> None:
        self.handoff_requests.append(request)
        self.handoff_requested.set()
        for listener in list(self._handoff_listeners):
            listener(request)

    # For the body

    def _state(self) -> HoldCore:
        if self._core is None:
            raise RuntimeError("the lease is not held yet: use `with client.hold(key) as h`")
        return self._core

    @property
    def lease(self) -> Lease:
        """The lease as last confirmed by the server."""
        with self._client._lock:
            return lease_from(self._state().lease)

    @property
    def loss_reason(self) -> str | None:
        """Why the lease was lost (see LeaseLostError), or None."""
        with self._client._lock:
            return self._state().loss_reason()

    def remaining(self) -> timedelta:
        """Time to the local deadline, read from the monotonic clock now."""
        with self._client._lock:
            return timedelta(seconds=self._state().remaining())

    def check(self) -> None:
        """Raises LeaseLostError when the lease is lost or its local deadline
        has passed (read from the clock now, whatever the timer thread did),
        or when the hold has ended."""
        with self._client._lock:
            self._state().check()

    def on_handoff(self, listener: Callable[[HandoffRequest], None]) -> Callable[[], None]:
        """Calls ``listener`` (on a client thread) for every handoff request,
        including those that came before. Returns a function that removes it."""
        with self._client._lock:
            self._handoff_listeners.append(listener)
            earlier = list(self.handoff_requests)
        for request in earlier:
            listener(request)

        def remove() -> None:
            with self._client._lock:
                if listener in self._handoff_listeners:
                    self._handoff_listeners.remove(listener)

        return remove

    def fencing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The three fencing headers as gRPC metadata. Raises LeaseLostError
        once the lease is lost: a call for a lost lease is never sent."""
        self.check()
        return c.fencing_metadata(self.key, self.fencing_token)

    def fencing_headers(self) -> dict[str, str]:
        """The three fencing headers for an HTTP client (raises once lost)."""
        return dict(self.fencing_metadata())
