"""Failover of a unary call across the instances of one server: which
addresses it tries, in what order, all within the call's one deadline, and
what it raises when none answers. ``failover_flow`` does no I/O: a client's
driver sends each attempt it yields (``_flow``)."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from .errors import UnavailableError, from_rpc_error

Response = TypeVar("Response")

#: Unary calls that change nothing when sent twice: reads, and writes keyed
#: by the caller's run id (S5: a Release can only end that run's own lease;
#: sent again after it succeeded it answers released=false). Revoke and
#: RequestHandoff are not among them: a second Revoke could end a lease
#: granted in between, a second RequestHandoff records a second request.
_IDEMPOTENT = frozenset({"Renew", "Release", "Get", "List", "History", "CheckFence"})


def attempt_plan(method: str, request: Any, count: int, start: int) -> list[int]:
    """The address indexes a unary call tries, in order, on UNAVAILABLE: each
    address once from the preferred one, then, for an idempotent call, each
    again. A connection reset under a call (a proxy or load balancer cutting
    it) fails that call once though the same address answers the next one;
    with a single address there is nowhere else to go. Acquire is idempotent
    only with a run id chosen by the client (same run id, same token)."""
    first = [(start + i) % count for i in range(count)]
    idempotent = method in _IDEMPOTENT or (method == "Acquire" and bool(request.run_id))
    return first + first if idempotent else first


# Before an idempotent call's second round, which asks addresses already
# tried: a connection reset under the first attempt may not yet be seen by
# the channel, whose next call would then go out on the dead connection
# (seen as "sendmsg: Broken pipe"). A pause of this length, as a gRPC retry
# policy's backoff, lets it close the connection and dial again.
SECOND_ROUND_PAUSE_S = 0.1


def second_round_pause(position: int, count: int, remaining: float) -> float:
    """Seconds to wait before the attempt at `position` of a plan over
    `count` addresses: a pause at the start of the second round, within
    what remains of the call's deadline; none otherwise."""
    if position != count:
        return 0.0
    return max(0.0, min(SECOND_ROUND_PAUSE_S, remaining / 2))


def unavailable_message(method: str, attempts: list[tuple[str, str]]) -> str:
    tried = "; ".join(f"{address}: {what}" for address, what in attempts)
    return f"{method}: no server instance could answer (tried {tried})"


class Attempts:
    """One unary call's attempts: the address indexes of ``attempt_plan`` in
    order, every one within the call's one deadline, and what each instance
    said when it was UNAVAILABLE."""

    def __init__(
        self, method: str, request: Any, addresses: Sequence[str], preferred: int, limit: float
    ) -> None:
        self.method = method
        self.count = len(addresses)
        self.deadline = time.monotonic() + limit
        self.plan = attempt_plan(method, request, self.count, preferred)
        self.tried: list[tuple[str, str]] = []
        self.last: grpc.RpcError | None = None

    def pause(self, position: int) -> float:
        """Seconds to wait before the attempt at ``position`` of the plan."""
        return second_round_pause(position, self.count, self.deadline - time.monotonic())

    def remaining(self) -> float | None:
        """The next attempt's timeout: what is left of the call's deadline;
        None when nothing is left after a first attempt."""
        left = self.deadline - time.monotonic()
        return None if self.tried and left <= 0 else left

    def failed(self, address: str, e: grpc.RpcError) -> None:
        """Raises the call's error unless the instance was UNAVAILABLE; that
        is kept, and the plan's next address is tried."""
        error = from_rpc_error(e)
        if not isinstance(error, UnavailableError):
            raise error from e
        self.tried.append((address, error.message))
        self.last = e

    def unavailable(self) -> UnavailableError:
        """The error after every attempt failed, naming each instance."""
        return UnavailableError(unavailable_message(self.method, self.tried), attempts=self.tried)


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait this long before the next attempt (answered with None)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Send:
    """Send the call to ``address`` with this timeout; answered with the
    response, or by throwing the call's ``grpc.RpcError`` into the flow."""

    address: str
    timeout: float


@dataclass(frozen=True, slots=True)
class Answered(Generic[Response]):
    """The response, and the index of the address that gave it (tried first next time)."""

    response: Response
    index: int


def failover_flow(
    method: str, request: Any, addresses: Sequence[str], preferred: int, limit: float
) -> Generator[Pause | Send, Response | None, Answered[Response]]:
    """A unary call, failing over to the next instance on UNAVAILABLE; an
    idempotent call then tries each instance once more (``attempt_plan``),
    all within the call's one deadline."""
    attempts = Attempts(method, request, addresses, preferred, limit)
    for position, index in enumerate(attempts.plan):
        # Every attempt, a failover or a retry, shares the call's deadline.
        pause = attempts.pause(position)
        if pause > 0:
            yield Pause(pause)
        remaining = attempts.remaining()
        if remaining is None:
            break
        address = addresses[index]
        try:
            response = yield Send(address, remaining)
        except grpc.RpcError as e:
            attempts.failed(address, e)
            continue
        assert response is not None, "a Send is answered with the call's response"
        return Answered(response, index)
    raise attempts.unavailable() from attempts.last
