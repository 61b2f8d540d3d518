"""The asyncio client: ``AsyncLeaseClient`` and its ``hold()`` (grpc.aio).

The same behaviour as the blocking client (client.py), on the event loop:
timers are ``loop.call_later``, the KeepAlive stream is read by a task,
``lost`` is an ``asyncio.Event``, and ``run_exclusive`` cancels the task
running the work the moment the lease is lost.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

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


class _AioStream:
    """A KeepAlive stream over a fresh channel, read by a task of its own."""

    def __init__(
        self, client: AsyncLeaseClient, address: str, on_message: OnMessage, on_end: OnEnd
    ) -> None:
        metadata = client._auth.metadata()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[lease_pb2.KeepAliveRequest | None] = asyncio.Queue()
        self._channel = client._make_channel(address, c.FRESH_CONNECTION)
        stub = lease_pb2_grpc.LeaseServiceStub(self._channel)
        self._call: Any = stub.KeepAlive(self._requests(), metadata=metadata)
        self._on_message = on_message
        self._on_end = on_end
        self._task = self._loop.create_task(self._read())

    async def _requests(self) -> AsyncIterator[lease_pb2.KeepAliveRequest]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    async def _read(self) -> None:
        error: LeaseholdError | None = None
        try:
            async for message in self._call:
                self._on_message(message)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
        except asyncio.CancelledError:
            error = UnavailableError("the KeepAlive stream was cancelled")
        except Exception as e:
            error = UnavailableError(f"the KeepAlive stream failed: {e!r}")
        finally:
            await self._channel.close(None)
        self._on_end(error)

    def send(self, request: lease_pb2.KeepAliveRequest) -> None:
        self._queue.put_nowait(request)

    def close(self) -> None:
        self._queue.put_nowait(None)
        self._loop.call_later(1.0, self.cancel)

    def cancel(self) -> None:
        self._queue.put_nowait(None)
        self._call.cancel()


class _Runtime:
    def __init__(self, client: AsyncLeaseClient) -> None:
        self._client = client

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay, fn)

    def open_stream(self, address: str, on_message: OnMessage, on_end: OnEnd) -> _AioStream:
        return _AioStream(self._client, address, on_message, on_end)


class AsyncLeaseClient:
    """An asyncio client of ``leasehold.v1.LeaseService``; see :class:`LeaseClient`.

    Make and use it inside one running event loop. ``token`` is a string or a
    (synchronous) callable returning the current token.
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
        # The credentials' generation the unary channels were made with, and
        # the channels made with older ones, closing once their calls end.
        self._tls_generation = self._tls.current()[0] if self._tls is not None else 0
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        self._timeout = c.seconds("timeout", timeout) or c.DEFAULT_TIMEOUT
        self._options = list(channel_options)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, lease_pb2_grpc.LeaseServiceStub] = {}
        self._preferred = 0
        self._closed = False
        self._holds: set[AsyncHold] = set()
        self._background: set[asyncio.Task[Any]] = set()
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

    def _make_channel(
        self, address: str, extra: Sequence[tuple[str, Any]] = ()
    ) -> grpc.aio.Channel:
        options = [*self._options, *extra]
        if self._tls is not None:
            return grpc.aio.secure_channel(address, self._tls.current()[1], options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def _retire_stale_channels(self, tls: TlsCredentials) -> None:
        """Once a TLS file has changed, the next calls go on new channels
        (grpcio cannot change a channel's credentials). The old ones close
        once the calls in flight on them have ended (a grace without bound:
        a Watch opened before the rotation goes on), or at ``close()``."""
        generation = tls.current()[0]
        if generation == self._tls_generation:
            return
        self._tls_generation = generation
        for channel in self._channels.values():
            self._retired[channel] = asyncio.get_running_loop().create_task(
                self._close_retired(channel)
            )
        self._channels.clear()
        self._stubs.clear()

    async def _close_retired(self, channel: grpc.aio.Channel) -> None:
        await channel.close(math.inf)
        self._retired.pop(channel, None)

    def _stub(self, address: str) -> lease_pb2_grpc.LeaseServiceStub:
        if self._tls is not None:
            self._retire_stale_channels(self._tls)
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._make_channel(address)
            self._channels[address] = channel
            stub = lease_pb2_grpc.LeaseServiceStub(channel)
            self._stubs[address] = stub
        return stub

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
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
                await asyncio.sleep(pause)
            remaining = attempts.remaining()
            if remaining is None:
                break
            address = self.addresses[index]
            try:
                response = await getattr(self._stub(address), method)(
                    request, timeout=remaining, metadata=metadata
                )
                self._preferred = index
                return response
            except grpc.RpcError as e:
                attempts.failed(address, e)
        raise attempts.unavailable() from attempts.last

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # LeaseService, one method per RPC

    async def acquire(
        self,
        key: SessionKey,
        *,
        ttl: timedelta | float,
        wait: timedelta | float | None = None,
        holder: str = "",
        run_id: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> AcquireResult:
        request = c.acquire_request(c.as_key(key), normalize_run_id(run_id), ttl, wait, holder)
        limit = c.seconds("timeout", timeout) or self._timeout + (c.seconds("wait", wait) or 0)
        return c.acquire_result(await self._call("Acquire", request, limit))

    async def renew(
        self,
        key: SessionKey,
        run_id: str,
        *,
        ttl: timedelta | float | None = None,
        timeout: timedelta | float | None = None,
    ) -> Lease:
        request = c.renew_request(c.as_key(key), normalize_run_id(run_id), ttl)
        response = await self._call("Renew", request, c.seconds("timeout", timeout))
        return lease_from(response.lease)

    async def release(
        self, key: SessionKey, run_id: str, *, timeout: timedelta | float | None = None
    ) -> bool:
        request = c.release_request(c.as_key(key), normalize_run_id(run_id))
        response = await self._call("Release", request, c.seconds("timeout", timeout))
        return bool(response.released)

    async def get(self, key: SessionKey, *, timeout: timedelta | float | None = None) -> GetResult:
        request = lease_pb2.GetRequest(key=c.as_key(key).to_proto())
        return c.get_result(await self._call("Get", request, c.seconds("timeout", timeout)))

    async def list(
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
        return c.list_result(await self._call("List", request, c.seconds("timeout", timeout)))

    async def request_handoff(
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
        response = await self._call("RequestHandoff", request, c.seconds("timeout", timeout))
        return c.handoff_result(response)

    async def history(
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
        response = await self._call("History", request, c.seconds("timeout", timeout))
        return c.history_result(response)

    async def check_fence(
        self, key: SessionKey, fencing_token: int, *, timeout: timedelta | float | None = None
    ) -> CheckFenceResult:
        request = lease_pb2.CheckFenceRequest(
            key=c.as_key(key).to_proto(), fencing_token=fencing_token
        )
        response = await self._call("CheckFence", request, c.seconds("timeout", timeout))
        return c.check_fence_result(response)

    async def revoke(
        self, key: SessionKey, *, reason: str, timeout: timedelta | float | None = None
    ) -> RevokeResult:
        request = lease_pb2.RevokeRequest(key=c.as_key(key).to_proto(), reason=reason)
        response = await self._call("Revoke", request, c.seconds("timeout", timeout))
        return c.revoke_result(response)

    async def watch(
        self,
        key: SessionKey,
        *,
        include_renewals: bool = False,
        timeout: timedelta | float | None = None,
    ) -> AsyncGenerator[Snapshot | Event, None]:
        """A snapshot, then every change, until the generator is closed (or ``timeout``)."""
        request = lease_pb2.WatchRequest(
            key=c.as_key(key).to_proto(), include_renewals=include_renewals
        )
        call: Any = self._stub(self.addresses[self._preferred]).Watch(
            request, timeout=c.seconds("timeout", timeout), metadata=self._auth.metadata()
        )
        try:
            async for message in call:
                yield c.watch_item(message)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        finally:
            call.cancel()

    async def keep_alive(
        self, requests: AsyncIterator[lease_pb2.KeepAliveRequest]
    ) -> AsyncIterator[lease_pb2.KeepAliveResponse]:
        """The raw KeepAlive stream (``hold()`` shares one for every lease)."""
        stub: Any = self._stub(self.addresses[self._preferred])
        call: Any = stub.KeepAlive(requests, metadata=self._auth.metadata())
        try:
            async for message in call:
                yield message
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
    ) -> AsyncHold:
        """A lease held for an ``async with`` block. See :class:`AsyncHold`."""
        return AsyncHold(
            self,
            c.as_key(key),
            lease_timing(ttl, safety_margin, renew_interval),
            c.seconds("wait", wait) or 0.0,
            holder or "",
            normalize_run_id(run_id),
        )

    async def run_exclusive(
        self,
        key: SessionKey,
        fn: Callable[[AsyncHold], Awaitable[T]],
        *,
        ttl: timedelta | float = timedelta(seconds=10),
        wait: timedelta | float | None = None,
        holder: str | None = None,
        run_id: str | None = None,
        safety_margin: timedelta | float | None = None,
        renew_interval: timedelta | float | None = None,
    ) -> T:
        """Runs ``await fn(hold)`` while holding the lease, in a task that is
        cancelled the moment the lease is lost; then raises LeaseLostError."""
        async with self.hold(
            key,
            ttl=ttl,
            wait=wait,
            holder=holder,
            run_id=run_id,
            safety_margin=safety_margin,
            renew_interval=renew_interval,
        ) as h:
            task = asyncio.ensure_future(fn(h))
            h._task = task
            try:
                result = await task
            except asyncio.CancelledError:
                if h.lost.is_set():
                    h.check()  # raises LeaseLostError with the reason
                raise
            finally:
                h._task = None
            h.check()
            return result

    @property
    def keepalive_streams(self) -> int:
        """KeepAlive streams open now."""
        return self._keepalive.open_streams

    async def close(self) -> builtins.list[ReleaseFailure]:
        """Releases every lease still held (not lost) and closes the
        connections. Returns the releases that failed (also logged)."""
        if self._closed:
            return []
        failures: builtins.list[ReleaseFailure] = []
        for h in builtins.list(self._holds):
            await h._finish()
            if h.release_error is not None:
                failures.append(ReleaseFailure(h.key, h.run_id, h.release_error))
        self._closed = True
        self._keepalive.close()
        for channel in self._channels.values():
            await channel.close(None)
        for channel, task in list(self._retired.items()):
            task.cancel()
            await channel.close(None)
        return failures

    async def __aenter__(self) -> AsyncLeaseClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncHold:
    """A session's lease held by this process (``async with client.hold(key) as h``).

    As :class:`leasehold.Hold`, with ``lost`` and ``handoff_requested`` as
    ``asyncio.Event``.
    """

    def __init__(
        self,
        client: AsyncLeaseClient,
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
        self.lost = asyncio.Event()
        #: Set when another holder asked for the session.
        self.handoff_requested = asyncio.Event()
        self.handoff_requests: list[HandoffRequest] = []
        self._handoff_listeners: list[Callable[[HandoffRequest], None]] = []
        #: The release's answer: True released, False nothing to release, None not sent.
        self.released: bool | None = None
        #: Why the release failed, when it did.
        self.release_error: Exception | None = None
        #: True when a late waited grant was confirmed by a re-acquire.
        self.confirmed = False
        self._finished = False
        self._task: asyncio.Future[Any] | None = None

    async def _attempt(self, wait: float) -> Grant:
        request = c.acquire_request(self.key, self.run_id, self._timing.ttl, wait, self.holder)
        sent_at = time.monotonic()
        response = await self._client._call("Acquire", request, wait + self._client._timeout)
        return grant_of(self.key, response, sent_at, time.monotonic(), self._timing.margin)

    def _release_timeout(self) -> float:
        return release_timeout(self._client._timeout, self._timing)

    async def _send_release(self) -> bool | None:
        try:
            request = c.release_request(self.key, self.run_id)
            response = await self._client._call("Release", request, self._release_timeout())
            return bool(response.released)
        except Exception as error:
            self.release_error = error
            c.log_release_failure(self.key, self.run_id, error)
            return None

    async def __aenter__(self) -> AsyncHold:
        try:
            grant = await self._attempt(self._wait)
        except NotAcquiredError:
            raise
        except BaseException:
            # The grant may have happened with its answer lost.
            self._client._spawn(self._send_release())
            raise
        if grant.late and self._wait > 0:
            self.confirmed = True
            try:
                grant = await self._attempt(0)
            except BaseException:
                await self._send_release()
                raise
        if grant.late:
            await self._send_release()
            raise LateGrantError(lease_from(grant.lease), grant.elapsed)
        self.fencing_token = grant.lease.fencing_token
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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._finish()

    async def _finish(self) -> None:
        if self._finished or self._core is None:
            return
        core = self._core
        self._finished = True
        self._client._holds.discard(self)
        settled = asyncio.Event()
        if not core.renewal_settled(settled.set):
            # Its renewal's answer (or a stall, or the deadline) first: see
            # HoldCore.renewal_settled. Bounded by the release's timeout too.
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._release_timeout()):
                        await settled.wait()
            except asyncio.CancelledError:
                core.end()
                if core.loss is None:
                    self._client._spawn(self._send_release())
                raise
        core.end()
        if core.loss is None:
            self.released = await self._send_release()

    def _on_lost(self, reason: str, message: str) -> None:
        self.lost.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _on_handoff(self, request: HandoffRequest) -> None:
        self.handoff_requests.append(request)
        self.handoff_requested.set()
        for listener in builtins.list(self._handoff_listeners):
            listener(request)

    def _state(self) -> HoldCore:
        if self._core is None:
            raise RuntimeError("the lease is not held yet: use `async with client.hold(key) as h`")
        return self._core

    @property
    def lease(self) -> Lease:
        """The lease as last confirmed by the server."""
        return lease_from(self._state().lease)

    @property
    def loss_reason(self) -> str | None:
        """Why the lease was lost (see LeaseLostError), or None."""
        return self._state().loss_reason()

    def remaining(self) -> timedelta:
        """Time to the local deadline, read from the monotonic clock now."""
        return timedelta(seconds=self._state().remaining())

    def check(self) -> None:
        """Raises LeaseLostError once the lease is lost or its local deadline
        has passed (read from the clock now, even if the loop was blocked),
        or once the hold has ended."""
        self._state().check()

    def on_handoff(self, listener: Callable[[HandoffRequest], None]) -> Callable[[], None]:
        """Calls ``listener`` for every handoff request, earlier ones included."""
        self._handoff_listeners.append(listener)
        for request in builtins.list(self.handoff_requests):
            listener(request)

        def remove() -> None:
            if listener in self._handoff_listeners:
                self._handoff_listeners.remove(listener)

        return remove

    def fencing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The three fencing headers as gRPC metadata (raises once lost)."""
        self.check()
        return c.fencing_metadata(self.key, self.fencing_token)

    def fencing_headers(self) -> dict[str, str]:
        """The three fencing headers for an HTTP client (raises once lost)."""
        return dict(self.fencing_metadata())
