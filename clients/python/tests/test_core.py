"""The hold's local deadline timer (L2), on a clock the test moves: the
one thing here that cannot be real. The stories against real servers are
in test_blocking.py and test_async.py."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from leasehold import SessionKey
from leasehold._core import HoldCore, KeepAliveChannel, OnEnd, OnMessage, lease_timing
from leasehold._gen.leasehold.v1 import lease_pb2
from leasehold.types import duration

TTL = 3.0
MARGIN = 1.0


class _Timer:
    def __init__(self, at: float, fn: Callable[[], None]) -> None:
        self.at = at
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Stream:
    def send(self, request: lease_pb2.KeepAliveRequest) -> None:
        pass

    def close(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _Runtime:
    """A monotonic clock that moves only when the test says, and the timers
    armed on it (every one kept, to count them)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.timers: list[_Timer] = []

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(self.t + delay, fn)
        self.timers.append(timer)
        return timer

    def open_stream(self, address: str, on_message: OnMessage, on_end: OnEnd) -> _Stream:
        return _Stream()

    def advance(self, to: float) -> None:
        """Runs every timer due by ``to``, in time order, moving the clock to each."""
        while True:
            due = [x for x in self.timers if not x.cancelled and x.at <= to]
            if not due:
                break
            timer = min(due, key=lambda x: x.at)
            timer.cancelled = True
            self.t = max(self.t, timer.at)
            timer.fn()
        self.t = to


def _lease(remaining: float) -> lease_pb2.Lease:
    return lease_pb2.Lease(remaining=duration(timedelta(seconds=remaining)))


def test_l2_the_deadline_timer_is_armed_once_and_follows_the_deadline_when_it_fires() -> None:
    """L2: renewals move the local deadline later without arming a timer
    each; the one timer, due at the first deadline, finds the deadline moved
    and waits for the new one; passing that one loses the lease."""
    rt = _Runtime()
    losses: list[str] = []
    core = HoldCore(
        rt,
        KeepAliveChannel(rt, ["127.0.0.1:1"]),
        SessionKey("acct", "core"),
        "aaaaaaaa-0000-4000-8000-000000000000",
        lease_timing(TTL, MARGIN),
        _lease(TTL),
        TTL - MARGIN,
        lambda reason, message: losses.append(reason),
        lambda request: None,
    )

    def deadline_timers() -> list[_Timer]:
        return [x for x in rt.timers if x.fn == core._deadline_due]

    for i in range(1, 11):
        rt.t = i * 0.1
        core.on_renewed(_lease(TTL), rt.t)
    assert core.deadline == pytest.approx(1.0 + TTL - MARGIN)
    assert [x.at for x in deadline_timers()] == [TTL - MARGIN]

    rt.advance(TTL - MARGIN)
    assert losses == []
    assert [x.at for x in deadline_timers()] == pytest.approx([TTL - MARGIN, 1.0 + TTL - MARGIN])

    rt.advance(1.0 + TTL - MARGIN)
    assert losses == ["deadline"]
    assert len(deadline_timers()) == 2
