"""The asyncio client: ``AsyncLeaseClient`` and its ``hold()`` (grpc.aio).

The same behaviour as the blocking client (client.py), on the event loop,
and the I/O half of it (``_client.py`` has the rest): timers are
``loop.call_later``, the KeepAlive stream is read by a task, ``lost`` is an
``asyncio.Event``, and ``run_exclusive`` cancels the task running the work
the moment the lease is lost. Every callback runs on the one event loop, so
the guard is empty.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, cast

import grpc
import grpc.aio

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
from ._flow import drive_async
from ._gen.leasehold.v1 import lease_pb2, lease_pb2_grpc
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

if TYPE_CHECKING:
    from ._gen.leasehold.v1.lease_pb2_grpc import LeaseServiceAsyncStub

T = TypeVar("T")
Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")


def _call_later(delay: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
    return asyncio.get_running_loop().call_later(delay, fn)


class _AioStream:
    """A KeepAlive stream (or a keeper's Keep stream: ``method``) over a
    fresh channel, read by a task of its own."""

    def __init__(
        self,
        client: AsyncLeaseClient,
        address: str,
        on_message: Callable[[Any], None],
        on_end: OnEnd,
        *,
        method: str = "KeepAlive",
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._channel, self._call = client._open_keepalive(address, self._requests(), method)
        self._on_message = on_message
        self._on_end = on_end
        self._task = self._loop.create_task(self._read())

    async def _requests(self) -> AsyncIterator[Any]:
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

    def send(self, request: Any) -> None:
        self._queue.put_nowait(request)

    def close(self) -> None:
        self._queue.put_nowait(None)
        self._loop.call_later(1.0, self.cancel)

    def cancel(self) -> None:
        self._queue.put_nowait(None)
        self._call.cancel()


class AsyncHold(BaseHold):
    """A session's lease held by this process (``async with client.hold(key) as h``).

    As :class:`leasehold.Hold`, with ``lost`` and ``handoff_requested`` as
    ``asyncio.Event``.
    """

    _client: AsyncLeaseClient
    lost: asyncio.Event
    handoff_requested: asyncio.Event
    _usage = "async with client.hold(key) as h"
    #: The task ``run_exclusive`` runs the work in, cancelled on loss.
    _task: asyncio.Future[Any] | None = None

    def _new_flag(self) -> asyncio.Event:
        return asyncio.Event()

    async def __aenter__(self) -> AsyncHold:
        self._start(await drive_async(acquire_flow(self._wait), self._perform, BaseException))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._finish()

    async def _perform(self, step: SendAcquire | SendRelease) -> Grant | None:
        """A step of ``acquire_flow``, awaited (a release in the background
        as a task of the client's)."""
        if isinstance(step, SendRelease):
            if step.background:
                self._client._spawn(self._send_release())
            else:
                await self._send_release()
            return None
        call = self._acquire_call(step)
        sent_at = time.monotonic()
        response = await self._client._send(call)
        return self._grant(response, sent_at, time.monotonic())

    async def _send_release(self) -> bool | None:
        try:
            return await self._client._send(self._release_call())
        except Exception as error:
            self._release_failed(error)
            return None

    async def _finish(self) -> None:
        settled = asyncio.Event()
        core, waiting = self._stop_renewing(settled.set)
        if core is None:
            return
        if waiting:
            # Its renewal's answer (or a stall, or the deadline) first: see
            # HoldCore.renewal_settled. Bounded by the release's timeout too.
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._release_timeout()):
                        await settled.wait()
            except asyncio.CancelledError:
                if self._end(core):
                    self._client._spawn(self._send_release())
                raise
        if self._end(core):
            self.released = await self._send_release()

    def _on_lost(self, reason: str, message: str) -> None:
        super()._on_lost(reason, message)
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _answer() -> tuple[asyncio.Future[Any], Callable[[Any], None]]:
    """A future and the callback that sets it once (from the event loop)."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def settle(value: Any) -> None:
        if not future.done():
            future.set_result(value)

    return future, settle


async def _within(future: asyncio.Future[Any], seconds: float) -> Any:
    """The future's value, or None when it has none within ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            return await asyncio.shield(future)
    except TimeoutError:
        return future.result() if future.done() else None


async def _run_in_task(h: AsyncHold, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Runs ``await fn(h)`` in a task cancelled the moment the lease is
    lost; then raises LeaseLostError."""
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


class AsyncKeeperHold(BaseKeeperHold, AsyncHold):
    """A lease held on a keeper (``async with keeper.hold(key) as h``); see
    :class:`leasehold.KeeperHold`. ``lost`` is an ``asyncio.Event``, and the
    keeper's ``run_exclusive`` cancels its task the moment it is set.
    """

    _keeper: AsyncKeeper
    _usage = "async with keeper.hold(key) as h"

    async def __aenter__(self) -> AsyncKeeperHold:
        future, settle = _answer()
        keeper = self._keeper._state()
        give_up = keeper.acquire(self.key, self.run_id, self._wait, self.holder, settle)
        try:
            answer = await _within(future, self._acquire_timeout())
        except asyncio.CancelledError:
            give_up()
            raise
        if answer is None:
            give_up()
        self._adopt(answer)
        return self

    async def _finish(self) -> None:
        future, settle = _answer()
        if self._ending(settle):
            self._released(await _within(future, self._release_timeout()))


class AsyncKeeper(BaseKeeper[AsyncKeeperHold]):
    """A keeper (``async with client.keeper(account_id, ttl=…) as k``); see
    :class:`leasehold.Keeper`. ``lost`` is an ``asyncio.Event``.
    """

    _client: AsyncLeaseClient
    lost: asyncio.Event
    _hold_type = AsyncKeeperHold
    _usage = "async with client.keeper(account_id, ttl=…) as k"

    def _new_flag(self) -> asyncio.Event:
        return asyncio.Event()

    async def __aenter__(self) -> AsyncKeeper:
        if self._core is not None:
            raise RuntimeError("a keeper is entered once")
        future, settle = _answer()
        core = self._make_core()
        core.start(settle)
        try:
            result = await _within(future, self._client._timeout)
        except asyncio.CancelledError:
            core.abandon(UnavailableError("the keeper's open was cancelled"))
            raise
        if result is None:
            result = UnavailableError(
                f"no server answered the keeper's open within {self._client._timeout:.1f}s"
            )
            core.abandon(result)
        if isinstance(result, Exception):
            raise result
        self._client._keepers.add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def run_exclusive(
        self,
        key: SessionKey,
        fn: Callable[[AsyncKeeperHold], Awaitable[T]],
        *,
        wait: timedelta | float | None = None,
        holder: str | None = None,
        run_id: str | None = None,
    ) -> T:
        """Runs ``fn(hold)`` while holding the lease on this keeper, as
        :meth:`LeaseClient.run_exclusive` does (in the asyncio client, in a
        task cancelled the moment the lease is lost)."""
        async with self.hold(key, wait=wait, holder=holder, run_id=run_id) as h:
            return await _run_in_task(h, fn)

    async def close(self) -> None:
        """Releases every lease on the keeper and ends it (no lock-delay);
        nothing is sent for a lost keeper. A failure is logged and kept in
        ``close_error``: the keeper then ends at its deadline."""
        core = self._closing()
        if core is None:
            return
        future, settle = _answer()
        core.close(settle)
        try:
            result = await _within(future, self._client._timeout)
        finally:
            core.abandon(UnavailableError("the keeper was closed"))
        if result is None:
            result = DeadlineExceededError(
                "no answer to the keeper's close", grpc.StatusCode.DEADLINE_EXCEEDED
            )
        if isinstance(result, Exception) and not isinstance(result, LeaseLostError):
            self._close_failed(result)


class AsyncLeadership(BaseLeadership[AsyncHold]):
    """A campaign and then a term of leadership (``async with
    client.campaign(account_id, election, value=…) as leadership``); see
    :class:`leasehold.Leadership`. ``lost`` and ``ended`` are
    ``asyncio.Event``. Cancelling the task that campaigns leaves nothing on
    the server (asyncio.CancelledError); ``cancel()`` ends the campaign with
    CanceledError instead. A term whose block is left by the task's
    cancellation ends ``cancelled``.
    """

    _client: AsyncLeaseClient
    lost: asyncio.Event
    ended: asyncio.Event
    _usage = "async with client.campaign(account_id, election, value=…) as leadership"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The waiting Acquire's task, which cancel() cancels.
        self._waiting: asyncio.Future[Any] | None = None
        #: run_election's ``lead``, cancelled when the term ends.
        self._task: asyncio.Future[Any] | None = None

    def _new_flag(self) -> asyncio.Event:
        return asyncio.Event()

    async def __aenter__(self) -> AsyncLeadership:
        give_up_at = self._begin()
        while True:
            if self._cancelled:
                raise campaign_cancelled()
            hold = self._attempt(give_up_at)
            self._waiting = asyncio.ensure_future(hold.__aenter__())
            try:
                await self._waiting
            except (NotAcquiredError, LeaseNotHeldError) as refused:
                self._refused(refused, give_up_at)
                continue
            except asyncio.CancelledError:
                # This task may be cancelled in the instant the grant came
                # (the hold granted, the task not resumed yet): nobody leads
                # with that lease, so it is released (nothing is sent for a
                # hold never granted), and not dropped if the task is
                # cancelled again meanwhile.
                await asyncio.shield(self._client._spawn(hold.__aexit__(None, None, None)))
                task = asyncio.current_task()
                if self._cancelled and (task is None or not task.cancelling()):
                    raise campaign_cancelled() from None
                raise
            finally:
                self._waiting = None
            if self._won(hold):
                return self
            # Cancelled as the grant arrived: released, and no term reported.
            await hold.__aexit__(None, None, None)
            raise campaign_cancelled()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            await self.cancel()
        else:
            await self.resign()

    def _ended(self) -> None:
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    async def proclaim(self, value: str) -> None:
        """Advertises ``value`` instead, keeping the term; see
        :meth:`leasehold.Leadership.proclaim`."""
        if self._keeper is None:
            answer = await self._client._send(self._proclaim_acquire(value))
        else:
            future, settle = _answer()
            self._proclaim_on_keeper(value, settle)
            answer = await _within(future, self._client._timeout)
            if answer is None:
                answer = DeadlineExceededError(
                    "no answer to the keeper's Acquire", grpc.StatusCode.DEADLINE_EXCEEDED
                )
        release = self._proclaimed(value, answer)
        if isinstance(release, Call):
            await self._client._send(release)
        elif release is not None:
            release()
        if release is not None:
            self.check()
            raise self._term_over()

    async def resign(self) -> None:
        """Ends the term at once (on_stopped_leading first, then the Release)
        and lets the next candidate in. Idempotent; nothing is sent once
        leadership was lost."""
        hold = self._resigning()
        if hold is not None:
            await hold.__aexit__(None, None, None)

    async def cancel(self) -> None:
        """A campaign still waiting raises CanceledError (its waiting call
        cancelled, nothing left on the server); a term ends (``cancelled``)
        and its lease is released."""
        hold = self._cancelling()
        if self._waiting is not None:
            self._waiting.cancel()
        if hold is not None:
            await hold.__aexit__(None, None, None)


class AsyncElectionObserver(BaseObserver):
    """An election's changes (``async for change in client.observe(account_id,
    election)``); see :class:`leasehold.ElectionObserver`. ``close()`` (or
    leaving its ``async with`` block) ends the iteration.
    """

    _client: AsyncLeaseClient

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closed_event = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[ElectionChange]:
        return self._changes()

    async def _changes(self) -> AsyncIterator[ElectionChange]:
        client = self._client
        view: ElectionView | None = None
        reconnecting = False
        failures = 0
        while not self._closed:
            try:
                if view is None:
                    # Asked again, as the Watch is opened again, while no
                    # instance answers.
                    fence = await client.check_fence(self.key, 1)
                    view = ElectionView(self.key, fence.highest_token)
                # One Get first moves the Watch to an instance that answers.
                if reconnecting:
                    await client.get(self.key)
                reconnecting = True
                call = client._open_watch(self.key, include_renewals=True)
                if not self._watching(call):
                    return
                async for message in call:
                    failures = 0
                    item = watch_item(message)
                    if isinstance(item, Snapshot):
                        pages = view.snapshot_flow(item)
                        for change in await drive_async(pages, self._read, ()):
                            yield change
                    elif view.started:
                        applied = view.apply(item)
                        if applied is not None:
                            yield applied
            except grpc.RpcError as e:
                self._failed(from_rpc_error(e))
            except LeaseholdError as error:
                self._failed(error)
            except asyncio.CancelledError:
                # The Watch cancelled by close(), not this task by its caller.
                task = asyncio.current_task()
                if not self._closed or (task is not None and task.cancelling()):
                    raise
            if self._closed:
                return
            failures += 1
            with contextlib.suppress(TimeoutError):
                delay = reconnect_delay(self._reconnect_delay, failures)
                await asyncio.wait_for(self._closed_event.wait(), delay)

    async def _read(self, step: str | ReadLease) -> HistoryResult | Lease | None:
        """A step of ``ElectionView.snapshot_flow``: a History page, or the lease now."""
        if isinstance(step, ReadLease):
            return (await self._client.get(self.key)).lease
        return await self._client.history(self.key, page_size=100, page_token=step)

    async def close(self) -> None:
        """Ends the iteration: the Watch is cancelled."""
        self._closed_event.set()
        self._closing()

    async def __aenter__(self) -> AsyncElectionObserver:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _first(task: asyncio.Future[Any], stopping: asyncio.Future[Any] | None) -> bool:
    """Waits for ``task`` or ``stopping``: True when ``task`` is done. The
    task is cancelled when the waiting one is."""
    try:
        await asyncio.wait(
            {task} if stopping is None else {task, stopping}, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.done()


async def _report_leaders(
    observer: AsyncElectionObserver, on_new_leader: Callable[[Leader], None]
) -> None:
    """run_election's on_new_leader, in a task of its own until the observer closes."""
    try:
        async for change in observer:
            if change.leader is not None:
                try:
                    on_new_leader(change.leader)
                except Exception:
                    log_callback_failure("on_new_leader")
    except LeaseholdError as error:
        log.warning("leasehold: observing the election for on_new_leader failed: %s", error)


class AsyncLeaseClient(BaseClient[AsyncHold, AsyncKeeper, AsyncLeadership, AsyncElectionObserver]):
    """An asyncio client of ``leasehold.v1.LeaseService``; see :class:`LeaseClient`.

    Make and use it inside one running event loop. ``token`` is a string or a
    (synchronous) callable returning the current token.
    """

    _hold_type = AsyncHold
    _keeper_type = AsyncKeeper
    _leadership_type = AsyncLeadership
    _observer_type = AsyncElectionObserver

    def _open_runtime(self) -> ClientRuntime:
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Channels made with older TLS files, closing once their calls end.
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        self._stubs: dict[str, LeaseServiceAsyncStub] = {}
        self._background: set[asyncio.Task[Any]] = set()
        return ClientRuntime(
            _call_later,
            functools.partial(_AioStream, self),
            functools.partial(_AioStream, self, method="Keep"),
        )

    def _guard(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def _make_channel(self, address: str, *, fresh: bool = False) -> grpc.aio.Channel:
        options = self._channel_options(fresh)
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

    def _stub(self, address: str) -> LeaseServiceAsyncStub:
        if self._tls is not None:
            self._retire_stale_channels(self._tls)
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._make_channel(address)
            self._channels[address] = channel
            stub = lease_pb2_grpc.LeaseServiceStub(channel)
            self._stubs[address] = stub
        return stub

    async def _send(self, call: Call[Request, Response, Result]) -> Result:
        """Sends a unary call, failing over (``_failover``)."""
        metadata = self._metadata()

        async def perform(step: Pause | Send) -> Response | None:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
                return None
            # The asyncio stub's method of the same name: grpc.aio's, of the same types.
            method = cast(
                "grpc.aio.UnaryUnaryMultiCallable[Request, Response]",
                call.method(self._stub(step.address)),
            )
            return await method(call.request, timeout=step.timeout, metadata=metadata)

        answered = await drive_async(self._failover(call), perform, grpc.RpcError)
        return self._answered(call, answered)

    def _bind(self, describe: Callable[..., Call[Any, Any, Any]]) -> Callable[..., Any]:
        async def method(*args: Any, **kwargs: Any) -> Any:
            return await self._send(describe(self, *args, **kwargs))

        return method

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # Streams

    async def watch(
        self,
        key: SessionKey,
        *,
        include_renewals: bool = False,
        timeout: timedelta | float | None = None,
    ) -> AsyncGenerator[Snapshot | Event, None]:
        """A snapshot, then every change, until the generator is closed (or ``timeout``)."""
        call = self._open_watch(key, include_renewals=include_renewals, timeout=timeout)
        try:
            async for message in call:
                yield watch_item(message)
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

    async def run_exclusive(
        self,
        key: SessionKey,
        fn: Callable[[AsyncHold], Awaitable[T]],
        **options: Unpack[HoldOptions],
    ) -> T:
        """Runs ``await fn(hold)`` while holding the lease (``options`` as
        ``hold()`` takes them), in a task that is cancelled the moment the
        lease is lost; then raises LeaseLostError."""
        async with self.hold(key, **options) as h:
            return await _run_in_task(h, fn)

    async def run_election(
        self,
        account_id: str,
        election: str,
        lead: Callable[[AsyncLeadership], Awaitable[object]],
        *,
        on_new_leader: Callable[[Leader], None] | None = None,
        again: bool = True,
        stop: asyncio.Event | None = None,
        **options: Unpack[CampaignOptions],
    ) -> None:
        """Campaigns, runs ``await lead(leadership)`` while leading — in a
        task cancelled the moment the term ends (lost, or ``stop`` set:
        ``cancelled``) —, resigns when ``lead`` returns, and campaigns again
        (unless ``again`` is False) until ``stop`` is set; see
        :meth:`leasehold.LeaseClient.run_election`."""
        observer = self.observe(account_id, election) if on_new_leader is not None else None
        reporter = (
            asyncio.ensure_future(_report_leaders(observer, on_new_leader))
            if observer is not None and on_new_leader is not None
            else None
        )
        stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
        stopped = stop.is_set if stop is not None else lambda: False
        try:
            failures = 0
            terms = 0
            while not stopped() and (terms == 0 or again):
                leadership = self.campaign(account_id, election, **options)
                entering = asyncio.ensure_future(leadership.__aenter__())
                try:
                    entered = await _first(entering, stopping)
                except asyncio.CancelledError:
                    # This task may be cancelled in the instant the campaign
                    # won (the term begun, this task not resumed yet): the
                    # term ends (cancelled, released) before the cancellation
                    # goes on, and a campaign still waiting leaves nothing.
                    await leadership.cancel()
                    with contextlib.suppress(LeaseholdError, asyncio.CancelledError):
                        await entering
                    raise
                if not entered:
                    await leadership.cancel()
                    with contextlib.suppress(LeaseholdError, asyncio.CancelledError):
                        await entering
                    if leadership.stop_reason is not None:
                        await leadership.resign()
                    return
                try:
                    entering.result()
                except (UnavailableError, DeadlineExceededError):
                    # The waiting call's connection or instance went away:
                    # campaign again (a new run id) after a backoff.
                    failures += 1
                    pause = asyncio.ensure_future(asyncio.sleep(reconnect_delay(0.1, failures)))
                    if not await _first(pause, stopping):
                        pause.cancel()
                        return
                    continue
                except CanceledError:
                    if stopped():
                        return
                    raise
                failures = 0
                terms += 1
                task = asyncio.ensure_future(lead(leadership))
                leadership._task = task
                if leadership.ended.is_set():
                    task.cancel()
                try:
                    if not await _first(task, stopping):
                        await leadership.cancel()
                    await task
                except asyncio.CancelledError:
                    # Cancelled because the term ended (its end was
                    # reported); not when this task itself is.
                    current = asyncio.current_task()
                    if leadership.stop_reason is None or (
                        current is not None and current.cancelling()
                    ):
                        await leadership.cancel()
                        raise
                finally:
                    await leadership.resign()
        finally:
            if stopping is not None:
                stopping.cancel()
            if observer is not None:
                await observer.close()
            if reporter is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter

    async def close(self) -> builtins.list[ReleaseFailure]:
        """Releases every lease still held (not lost) and closes the
        connections. Returns the releases that failed (also logged)."""
        if self._closed:
            return []
        for k in builtins.list(self._keepers):
            await k.close()
        holds = builtins.list(self._holds)
        for h in holds:
            await h._finish()
        # The releases of acquires whose answer was lost, or of holds
        # cancelled while ending: done (or failed, and logged) before close()
        # returns, never on closed channels after.
        while self._background:
            await asyncio.wait(builtins.list(self._background))
        self._closed = True
        self._keepalive.close()
        for channel in self._channels.values():
            await channel.close(None)
        for channel, task in builtins.list(self._retired.items()):
            task.cancel()
            await channel.close(None)
        return self._release_failures(holds)

    async def __aenter__(self) -> AsyncLeaseClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
