"""Drivers of the sans-I/O flows (``_core.acquire_flow``,
``_failover.failover_flow``): a flow is a generator that yields what it
needs done and is sent the answer, or has the step's error thrown into it;
``drive`` performs each step blocking, ``drive_async`` on the event loop
(httpx's ``Auth.auth_flow`` with ``sync_auth_flow`` and ``async_auth_flow``).

The naming rule of this package for async twins: a class takes ``Async``
first (``AsyncLeaseClient``, ``AsyncHold``, ``AsyncFencingInterceptor``), a
module-level function takes ``_async`` last (``drive_async``,
``fenced_write_async``), and a method of an async class keeps its blocking
twin's name (``await client.acquire(…)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Generator
from typing import Generic, TypeVar

Step = TypeVar("Step")
Answer = TypeVar("Answer")
Result = TypeVar("Result")

Catch = type[BaseException] | tuple[type[BaseException], ...]


class _Steps(Generic[Step, Answer, Result]):
    """A flow being driven: iterating gives its steps, and each is answered
    (``answer``) or failed (``fail``) before the next; ``result`` is what the
    flow returned."""

    def __init__(self, flow: Generator[Step, Answer, Result]) -> None:
        self._flow = flow
        self._resume: Callable[[], Step] = lambda: next(flow)
        self.result: Result

    def __iter__(self) -> _Steps[Step, Answer, Result]:
        return self

    def __next__(self) -> Step:
        try:
            return self._resume()
        except StopIteration as done:
            self.result = done.value
            raise StopIteration from None

    def answer(self, answer: Answer) -> None:
        self._resume = lambda: self._flow.send(answer)

    def fail(self, error: BaseException) -> None:
        self._resume = lambda: self._flow.throw(error)


def drive(
    flow: Generator[Step, Answer, Result], perform: Callable[[Step], Answer], catch: Catch
) -> Result:
    """Runs ``flow`` to its end, performing every step it yields; an error
    of a step that ``catch`` names is thrown into the flow, any other passes."""
    steps = _Steps(flow)
    with contextlib.closing(flow):
        for step in steps:
            try:
                steps.answer(perform(step))
            except catch as error:
                steps.fail(error)
    return steps.result


async def drive_async(
    flow: Generator[Step, Answer, Result],
    perform: Callable[[Step], Awaitable[Answer]],
    catch: Catch,
) -> Result:
    """``drive`` with each step performed by awaiting ``perform``."""
    steps = _Steps(flow)
    with contextlib.closing(flow):
        for step in steps:
            try:
                steps.answer(await perform(step))
            except catch as error:
                steps.fail(error)
    return steps.result
