"""The sans-I/O flows driven by a script instead of a server: the hold's
acquire / late-grant decision (``acquire_flow``) and a unary call's
failover (``failover_flow``), each step checked as the flow asks for it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import grpc
import pytest

from leasehold import InvalidArgumentError, LateGrantError, NotAcquiredError, UnavailableError
from leasehold._core import Grant, SendAcquire, SendRelease, acquire_flow
from leasehold._failover import Answered, Pause, Send, failover_flow
from leasehold._flow import drive
from leasehold._gen.leasehold.v1 import lease_pb2


def grant(*, late: bool, token: int = 7) -> Grant:
    return Grant(lease_pb2.Lease(run_id="r", fencing_token=token), 100.0, late, 0.5)


def scripted(answers: list[Any]) -> tuple[list[Any], Callable[[Any], Any]]:
    """Performs each step with the next answer (raised when it is an error); records the steps."""
    steps: list[Any] = []

    def perform(step: Any) -> Any:
        steps.append(step)
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return steps, perform


def test_l2_a_grant_in_time_is_kept_and_nothing_is_released() -> None:
    steps, perform = scripted([grant(late=False)])
    assert drive(acquire_flow(0), perform, Exception).lease.fencing_token == 7
    assert steps == [SendAcquire(0)]


def test_l2_a_late_waited_grant_is_confirmed_by_a_reacquire_without_wait() -> None:
    steps, perform = scripted([grant(late=True), grant(late=False)])
    assert not drive(acquire_flow(5.0), perform, Exception).late
    assert steps == [SendAcquire(5.0), SendAcquire(0, confirming=True)]


def test_l2_a_late_grant_is_released_at_once_and_refused() -> None:
    steps, perform = scripted([grant(late=True), None])
    with pytest.raises(LateGrantError):
        drive(acquire_flow(0), perform, Exception)
    assert steps == [SendAcquire(0), SendRelease(background=False)]


def test_s5_an_unanswered_acquire_is_released_in_the_background() -> None:
    steps, perform = scripted([UnavailableError("nobody answered"), None])
    with pytest.raises(UnavailableError):
        drive(acquire_flow(0), perform, Exception)
    assert steps == [SendAcquire(0), SendRelease(background=True)]


@pytest.mark.parametrize(
    "refusal",
    [
        InvalidArgumentError("key.session_id may contain only …", "key.session_id", "…"),
        NotAcquiredError("held by another run", None),
        RuntimeError("the client is closed"),
    ],
)
def test_s5_an_acquire_refused_or_never_sent_is_not_released(refusal: Exception) -> None:
    steps, perform = scripted([refusal])
    with pytest.raises(type(refusal)):
        drive(acquire_flow(0), perform, Exception)
    assert steps == [SendAcquire(0)]


#: A unary call's failover flow, answered with strings here.
Call = Generator[Pause | Send, str | None, Answered[str]]


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name} from the script"

    def trailing_metadata(self) -> Any:
        return ()


def test_an_idempotent_call_tries_each_instance_twice_pausing_before_the_second_round() -> None:
    unavailable = _RpcError(grpc.StatusCode.UNAVAILABLE)
    steps, perform = scripted([unavailable, unavailable, None, unavailable, "answer"])
    flow: Call = failover_flow("Get", lease_pb2.GetRequest(), ["a:1", "b:2"], 0, 10.0)
    answered = drive(flow, perform, grpc.RpcError)
    assert (answered.response, answered.index) == ("answer", 1)
    assert [s.address if isinstance(s, Send) else "pause" for s in steps] == [
        "a:1",
        "b:2",
        "pause",
        "a:1",
        "b:2",
    ]
    assert isinstance(steps[2], Pause) and 0 < steps[2].seconds <= 0.1


def test_a_revoke_tries_each_instance_once_and_names_every_attempt() -> None:
    unavailable = _RpcError(grpc.StatusCode.UNAVAILABLE)
    steps, perform = scripted([unavailable, unavailable])
    flow: Call = failover_flow("Revoke", lease_pb2.RevokeRequest(), ["a:1", "b:2"], 1, 10.0)
    with pytest.raises(UnavailableError) as failed:
        drive(flow, perform, grpc.RpcError)
    assert [a for a, _ in failed.value.attempts] == ["b:2", "a:1"]
    assert steps == [Send("b:2", steps[0].timeout), Send("a:1", steps[1].timeout)]


def test_an_answer_other_than_unavailable_ends_the_call_at_once() -> None:
    steps, perform = scripted([_RpcError(grpc.StatusCode.INVALID_ARGUMENT)])
    flow: Call = failover_flow("Get", lease_pb2.GetRequest(), ["a:1", "b:2"], 0, 10.0)
    with pytest.raises(InvalidArgumentError):
        drive(flow, perform, grpc.RpcError)
    assert len(steps) == 1
