"""A keeper's core on a clock the test moves and a Keep stream the test
answers (the server's part): the local deadline (L2), the stall watch and
the re-attach, and which leases a loss ends. The stories against real
servers are in test_keepers.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from test_core import _Runtime as _CoreRuntime

from leasehold import LeaseLostError, NotAcquiredError, SessionKey
from leasehold._core import lease_timing
from leasehold._gen.leasehold.v1 import lease_pb2
from leasehold._keeper import KeeperCore, KeeperLease, OnKeepEnd, OnKeepMessage
from leasehold.errors import LeaseholdError
from leasehold.types import duration

TTL = 3.0
MARGIN = 0.3  # TTL/10, as a keeper's
INTERVAL = 1.0  # TTL/3
KEEPER_ID = "bbbbbbbb-0000-4000-8000-000000000000"


class _Stream:
    def __init__(self, address: str, on_message: OnKeepMessage, on_end: OnKeepEnd) -> None:
        self.address = address
        self.on_message = on_message
        self.on_end = on_end
        self.sent: list[lease_pb2.KeepRequest] = []
        self.cancelled = False
        self.closed = False

    def send(self, request: lease_pb2.KeepRequest) -> None:
        self.sent.append(request)

    def close(self) -> None:
        self.closed = True

    def cancel(self) -> None:
        self.cancelled = True

    def last(self, op: str) -> lease_pb2.KeepRequest:
        return [r for r in self.sent if r.WhichOneof("op") == op][-1]


class _Runtime(_CoreRuntime):
    """test_core's clock and timers, and the Keep streams opened."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[_Stream] = []

    def open_keep(self, address: str, on_message: OnKeepMessage, on_end: OnKeepEnd) -> _Stream:
        stream = _Stream(address, on_message, on_end)
        self.streams.append(stream)
        return stream


def _keeper_answer(request_id: int, remaining: float) -> lease_pb2.KeepResponse:
    return lease_pb2.KeepResponse(
        id=request_id,
        keeper=lease_pb2.Keeper(
            keeper_id=KEEPER_ID, remaining=duration(timedelta(seconds=remaining))
        ),
    )


def _granted(request_id: int, key: SessionKey, run_id: str, token: int) -> lease_pb2.KeepResponse:
    lease = lease_pb2.Lease(key=key.to_proto(), run_id=run_id, fencing_token=token)
    return lease_pb2.KeepResponse(
        id=request_id, acquire=lease_pb2.AcquireResponse(acquired=True, lease=lease)
    )


class _Harness:
    def __init__(self, addresses: list[str] | None = None) -> None:
        self.rt = _Runtime()
        self.losses: list[str] = []
        self.core = KeeperCore(
            self.rt,
            addresses or ["a:1"],
            account_id="acct",
            keeper_id=KEEPER_ID,
            holder="worker",
            timing=lease_timing(TTL, MARGIN, INTERVAL),
            lock_delay=5.0,
            notify=lambda reason, message: self.losses.append(reason),
            backoff_initial=0.0,
        )
        self.opened: list[object] = []
        self.core.start(self.opened.append)

    @property
    def stream(self) -> _Stream:
        return self.rt.streams[-1]

    def attach(self, remaining: float = TTL) -> None:
        open_request = self.stream.last("open")
        self.stream.on_message(_keeper_answer(open_request.id, remaining))

    def beat(self, remaining: float = TTL) -> None:
        """Answers the last heartbeat sent."""
        self.stream.on_message(_keeper_answer(self.stream.last("heartbeat").id, remaining))

    def acquire(self, session: str, token: int) -> KeeperLease:
        key = SessionKey("acct", session)
        run_id = f"aaaaaaaa-0000-4000-8000-00000000000{token}"
        got: list[KeeperLease | LeaseholdError] = []
        self.core.acquire(key, run_id, 0.0, "worker", got.append)
        self.stream.on_message(_granted(self.stream.last("acquire").id, key, run_id, token))
        lease = got[0]
        assert isinstance(lease, KeeperLease)
        losses: list[str] = []
        lease.notify = lambda reason, message: losses.append(reason)
        self.lease_losses[lease.run_id] = losses
        return lease

    lease_losses: dict[str, list[str]]


@pytest.fixture
def h() -> _Harness:
    harness = _Harness(["a:1", "b:2"])
    harness.lease_losses = {}
    harness.attach()
    return harness


def test_l2_the_keepers_deadline_is_the_heartbeats_send_time_plus_remaining_minus_margin(
    h: _Harness,
) -> None:
    """L2: the open sent at 0 answered with 3 s left: deadline 2.7. A heartbeat
    sent at 1.0 and answered at 1.5 with 3 s left: 1.0 + 3 − 0.3 = 3.7 (its
    send time, not its arrival). One answered with less left never moves it
    earlier."""
    assert h.core.deadline == pytest.approx(TTL - MARGIN)
    h.rt.advance(INTERVAL)
    assert h.stream.last("heartbeat")
    h.rt.advance(1.5)
    h.beat()
    assert h.core.deadline == pytest.approx(1.0 + TTL - MARGIN)
    h.rt.advance(2.0)
    h.beat(remaining=0.5)
    assert h.core.deadline == pytest.approx(1.0 + TTL - MARGIN)
    assert h.losses == []


def test_l2_a_stalled_heartbeat_loses_every_lease_at_the_local_deadline_before_the_databases(
    h: _Harness,
) -> None:
    """No heartbeat answered (the stall watch moves to the next address at
    2.0, whose re-attach is not answered either): at the local deadline (2.7)
    the keeper and both of its leases are lost at once, 0.3 s before the
    database's deadline (3.0); the re-attach answered after that does not
    revive them."""
    first = h.acquire("s1", 1)
    second = h.acquire("s2", 2)
    h.rt.advance(TTL - MARGIN - 0.001)
    assert h.losses == []
    h.rt.advance(TTL - MARGIN)
    assert h.losses == ["deadline"]
    assert h.lease_losses == {first.run_id: ["deadline"], second.run_id: ["deadline"]}
    with pytest.raises(LeaseLostError) as lost:
        first.check()
    assert lost.value.loss_reason == "deadline"
    assert [s.address for s in h.rt.streams] == ["a:1", "b:2"]
    assert all(s.cancelled for s in h.rt.streams)
    h.attach()
    assert h.core.loss is not None and h.core.remaining() == 0.0


def test_l2_a_passed_deadline_is_seen_from_the_clock_before_the_timer_runs(h: _Harness) -> None:
    lease = h.acquire("s1", 1)
    h.rt.t = TTL  # the timer has not run: a blocked thread or event loop
    assert lease.loss_reason() == "deadline"
    assert h.losses == ["deadline"]


def test_a_heartbeat_unanswered_for_one_interval_reattaches_to_the_next_address(
    h: _Harness,
) -> None:
    """The stall watch: the heartbeat sent at 1.0 is unanswered at 2.0, the
    stream is cut and the next address opened with the same keeper id; an
    Acquire sent on the stalled stream is sent again (same run id) once the
    re-attach is answered, and the re-attach moves the deadline."""
    key = SessionKey("acct", "s9")
    got: list[KeeperLease | LeaseholdError] = []
    h.rt.advance(INTERVAL)
    h.core.acquire(key, "cccccccc-0000-4000-8000-000000000000", 0.0, "", got.append)
    stalled = h.stream
    h.rt.advance(2 * INTERVAL)
    assert stalled.cancelled
    h.rt.advance(2 * INTERVAL)  # the reconnect's backoff (0 here)
    assert [s.address for s in h.rt.streams] == ["a:1", "b:2"]
    reopened = h.stream
    assert reopened.sent[0].open.keeper_id == KEEPER_ID
    assert [r.WhichOneof("op") for r in reopened.sent] == ["open"]
    h.attach()
    assert [r.WhichOneof("op") for r in reopened.sent] == ["open", "acquire"]
    assert reopened.last("acquire").acquire.run_id == stalled.last("acquire").acquire.run_id
    assert h.core.deadline == pytest.approx(2 * INTERVAL + TTL - MARGIN)
    reopened.on_message(
        _granted(reopened.last("acquire").id, key, "cccccccc-0000-4000-8000-000000000000", 7)
    )
    assert isinstance(got[0], KeeperLease) and got[0].lease.fencing_token == 7
    assert h.losses == []


def test_k1_the_keeper_lost_ends_every_lease_a_lease_lost_only_that_one(h: _Harness) -> None:
    first = h.acquire("s1", 1)
    second = h.acquire("s2", 2)
    third = h.acquire("s3", 3)
    h.stream.on_message(
        lease_pb2.KeepResponse(
            lease_lost=lease_pb2.KeeperLeaseLost(
                key=first.key.to_proto(),
                run_id=first.run_id,
                reason=lease_pb2.LOSS_REASON_REVOKED,
            )
        )
    )
    assert h.lease_losses == {first.run_id: ["revoked"], second.run_id: [], third.run_id: []}
    assert h.losses == []
    h.stream.on_message(
        lease_pb2.KeepResponse(
            lost=lease_pb2.KeeperLost(reason=lease_pb2.LOSS_REASON_REVOKED, detail="drill")
        )
    )
    assert h.losses == ["revoked"]
    assert h.lease_losses == {
        first.run_id: ["revoked"],
        second.run_id: ["revoked"],
        third.run_id: ["revoked"],
    }


def test_k2_a_refused_acquire_says_until_when_the_lock_delay_runs(h: _Harness) -> None:
    key = SessionKey("acct", "delayed")
    got: list[KeeperLease | LeaseholdError] = []
    h.core.acquire(key, "dddddddd-0000-4000-8000-000000000000", 0.0, "", got.append)
    until = datetime(2030, 1, 1, 12, 0, 5, tzinfo=UTC)
    refused = lease_pb2.AcquireResponse(acquired=False)
    refused.lock_delay_until.FromDatetime(until)
    h.stream.on_message(lease_pb2.KeepResponse(id=h.stream.last("acquire").id, acquire=refused))
    error = got[0]
    assert isinstance(error, NotAcquiredError)
    assert error.lock_delay_until == until
    assert error.current is None
    assert "lock-delay until 2030-01-01T12:00:05" in error.message


def test_close_releases_nothing_once_lost_and_sends_close_while_valid(h: _Harness) -> None:
    h.acquire("s1", 1)
    answers: list[object] = []
    h.core.close(answers.append)
    close = h.stream.last("close")
    h.stream.on_message(_keeper_answer(close.id, 0))
    assert h.core.closed and h.stream.closed and len(answers) == 1
    assert h.core.leases == {}

    lost = _Harness()
    lost.attach()
    lost.rt.advance(TTL)
    lost.core.close(answers.append)
    assert [r.WhichOneof("op") for r in lost.stream.sent].count("close") == 0
    assert isinstance(answers[-1], LeaseLostError)


def test_a_handoff_request_reaches_only_the_lease_it_names(h: _Harness) -> None:
    first = h.acquire("s1", 1)
    second = h.acquire("s2", 2)
    asked: list[tuple[str, str]] = []
    first.on_handoff = lambda request: asked.append(("s1", request.requester_holder))
    second.on_handoff = lambda request: asked.append(("s2", request.requester_holder))
    h.stream.on_message(
        lease_pb2.KeepResponse(
            handoff_requested=lease_pb2.KeeperHandoffRequested(
                key=second.key.to_proto(),
                run_id=second.run_id,
                request=lease_pb2.HandoffRequested(requester_holder="browser"),
            )
        )
    )
    assert asked == [("s2", "browser")]


def test_an_acquire_on_a_lost_keeper_is_refused_with_its_loss_and_nothing_sent(
    h: _Harness,
) -> None:
    h.rt.advance(TTL)
    sent = len(h.stream.sent)
    got: list[KeeperLease | LeaseholdError] = []
    h.core.acquire(
        SessionKey("acct", "late"), "eeeeeeee-0000-4000-8000-000000000000", 0, "", got.append
    )
    assert isinstance(got[0], LeaseLostError) and got[0].loss_reason == "deadline"
    assert len(h.stream.sent) == sent


def test_a_waiting_acquire_sent_again_after_a_reattach_waits_only_what_is_left_of_its_wait(
    h: _Harness,
) -> None:
    """An Acquire that waits 5 s, sent at 1.0 on a stream that then stalls,
    is sent again on the re-attached stream at 2.0 with the 4 s left of its
    wait, not a whole new wait (its caller gives up at 1.0 + 5 s + the call
    timeout, and a campaign's timeout counts from its start); one whose wait
    has run out by then is sent without a wait, answered at once."""
    waiting = SessionKey("acct", "waits")
    short = SessionKey("acct", "short")
    h.rt.advance(INTERVAL)
    h.core.acquire(waiting, "cccccccc-0000-4000-8000-000000000001", 5.0, "", lambda _: None)
    h.core.acquire(short, "cccccccc-0000-4000-8000-000000000002", 0.5, "", lambda _: None)
    h.rt.advance(2 * INTERVAL)
    h.rt.advance(2 * INTERVAL)  # the reconnect's backoff (0 here)
    h.attach()
    again = {r.acquire.key.session_id: r.acquire for r in h.stream.sent if r.HasField("acquire")}
    assert again["waits"].wait.ToTimedelta() == timedelta(seconds=4)
    assert not again["short"].HasField("wait")


def test_a_waiting_acquire_given_up_is_released_on_the_stream_and_so_is_a_grant_that_still_comes(
    h: _Harness,
) -> None:
    """A waiting Acquire given up (its campaign cancelled) sends a Release of
    its run at once, which gives the waiter up on the server; a grant that
    raced it is released again when it arrives, and never held. One that
    was answered, or never waited, sends nothing."""
    key = SessionKey("acct", "given-up")
    run_id = "cccccccc-0000-4000-8000-000000000003"
    got: list[KeeperLease | LeaseholdError] = []
    give_up = h.core.acquire(key, run_id, 60.0, "", got.append)
    acquire = h.stream.last("acquire")
    give_up()
    give_up()
    releases = [r.release for r in h.stream.sent if r.HasField("release")]
    assert [(r.key.session_id, r.run_id) for r in releases] == [("given-up", run_id)]
    h.stream.on_message(_granted(acquire.id, key, run_id, 9))
    releases = [r.release for r in h.stream.sent if r.HasField("release")]
    assert [r.run_id for r in releases] == [run_id, run_id]
    assert h.core.leases == {}
    assert not isinstance(got[0], KeeperLease)
    no_wait = h.core.acquire(SessionKey("acct", "at-once"), run_id, 0.0, "", got.append)
    no_wait()
    assert len([r for r in h.stream.sent if r.HasField("release")]) == 2
