"""What observe() makes of Watch and History (``_election.ElectionView``),
shared by the blocking and the asyncio observer: events, snapshots and
History pages given by hand, no server. The stories against real servers
are in test_election.py."""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest

from leasehold import ElectionChange, Event, HistoryResult, Lease, SessionKey, Snapshot
from leasehold._election import ElectionView
from leasehold._flow import drive
from leasehold.errors import UnavailableError

KEY = SessionKey("acct", "scheduler")


def lease(term: int, value: str) -> Lease:
    return Lease(KEY, f"run-{term}", term, value, timedelta(seconds=10), None, None, timedelta(0))


def event(kind: str, term: int, value: str = "", *, with_lease: bool = False) -> Event:
    return Event(
        kind,
        KEY,
        f"run-{term}",
        term,
        value,
        "",
        None,
        lease(term, value) if with_lease else None,
        "",
        0,
    )


def snapshot(view: ElectionView, leases: list[Lease], pages: list[HistoryResult]) -> list[str]:
    """The changes a snapshot brings, History answered page by page."""
    asked: list[str] = []
    tokens = iter(pages)

    def page(token: object) -> HistoryResult | Lease | None:
        assert isinstance(token, str), "no lease is read when History and the snapshot agree"
        asked.append(token)
        return next(tokens)

    changes = drive(view.snapshot_flow(Snapshot(leases, None)), page, ())
    return [*map(described, changes), *(f"asked {t!r}" for t in asked[1:])]


def described(change: ElectionChange | None) -> str:
    if change is None:
        return "-"
    value = change.leader.value if change.leader is not None else ""
    return f"{change.type} {change.term} {value or change.how}".strip()


def test_the_first_snapshot_is_the_current_leader_and_older_terms_are_no_change() -> None:
    view = ElectionView(KEY, highest=10)
    assert snapshot(view, [lease(10, "a")], []) == ["current 10 a"]
    # A grant older than observing (a late event) is not a change.
    assert described(view.apply(event("ACQUIRED", 8, "old"))) == "-"
    nobody = ElectionView(KEY, highest=3)
    assert snapshot(nobody, [], []) == ["current 0"]


def test_each_event_makes_one_change_once() -> None:
    view = ElectionView(KEY, highest=4)
    snapshot(view, [], [])
    seen = [
        described(view.apply(e))
        for e in (
            event("ACQUIRED", 5, "a", with_lease=True),
            event("ACQUIRED", 5, "a", with_lease=True),  # seen again (History, then the stream)
            event("RENEWED", 5, "a", with_lease=True),  # a renewal: same value
            event("RENEWED", 5, "a2", with_lease=True),  # proclaimed
            event("HANDOFF_REQUESTED", 5, "a2"),
            event("RELEASED", 5, "a2"),
            event("RELEASED", 5, "a2"),
            event("ACQUIRED", 6, "b"),  # History's events carry no lease
            event("REVOKED", 6, "b"),
        )
    ]
    assert seen == [
        "elected 5 a",
        "-",
        "-",
        "proclaimed 5 a2",
        "-",
        "ended 5 resigned",
        "-",
        "elected 6 b",
        "ended 6 revoked",
    ]


def test_a_later_snapshot_reads_history_back_to_the_last_term_seen_over_pages() -> None:
    """Terms 7 and 9 began (7 also ended) while the stream was away: both
    come from History, oldest first, in order, before the snapshot's own."""
    view = ElectionView(KEY, highest=4)
    snapshot(view, [lease(5, "a")], [])
    newest_first = [
        HistoryResult([event("ACQUIRED", 9, "c"), event("RELEASED", 7, "b")], "p2"),
        HistoryResult([event("ACQUIRED", 7, "b"), event("RELEASED", 5, "a")], "p3"),
        HistoryResult([event("ACQUIRED", 5, "a"), event("RELEASED", 3, "z")], ""),
    ]
    assert snapshot(view, [lease(9, "c")], newest_first) == [
        "ended 5 resigned",
        "elected 7 b",
        "ended 7 resigned",
        "elected 9 c",
        "asked 'p2'",
        "asked 'p3'",
    ]


def test_what_history_cannot_show_is_said_from_the_snapshot() -> None:
    """History trimmed or not yet written: a term in the snapshot is
    elected, a leader gone from it ended (expired), a new value proclaimed."""
    view = ElectionView(KEY, highest=4)
    snapshot(view, [lease(5, "a")], [])
    assert snapshot(view, [lease(5, "a2")], [HistoryResult([], "")]) == ["proclaimed 5 a2"]
    assert snapshot(view, [], [HistoryResult([], "")]) == ["ended 5 expired"]
    assert snapshot(view, [lease(8, "d")], [HistoryResult([], "")]) == ["elected 8 d"]
    assert snapshot(view, [lease(8, "d")], [HistoryResult([], "")]) == []


def resync(
    view: ElectionView, leases: list[Lease], pages: list[HistoryResult], now: Lease | None
) -> list[str]:
    """The changes a later snapshot brings: History answered page by page,
    and the election's lease read now (a Get), ``now``, when it is asked."""
    tokens = iter(pages)

    def perform(step: object) -> HistoryResult | Lease | None:
        return next(tokens) if isinstance(step, str) else now

    return [*map(described, drive(view.snapshot_flow(Snapshot(leases, None)), perform, ()))]


def test_a_term_history_shows_but_the_snapshot_does_not_is_ended_only_if_it_no_longer_leads() -> (
    None
):
    """History is read after the snapshot: a term granted in between is in
    History and not in the snapshot, which then cannot say it ended. The
    lease read now decides: still held, the term goes on (its end comes on
    the stream, once); not held, it had ended before the snapshot (an expiry
    History records only at the next grant), and ends here."""
    view = ElectionView(KEY, highest=4)
    snapshot(view, [lease(5, "a")], [])
    granted_in_between = [
        HistoryResult(
            [event("ACQUIRED", 6, "b"), event("RELEASED", 5, "a"), event("ACQUIRED", 5, "a")], ""
        )
    ]
    assert resync(view, [], granted_in_between, lease(6, "b")) == [
        "ended 5 resigned",
        "elected 6 b",
    ]
    assert described(view.apply(event("ACQUIRED", 6, "b", with_lease=True))) == "-"
    assert described(view.apply(event("RELEASED", 6, "b"))) == "ended 6 resigned"
    expired_unrecorded = [HistoryResult([event("ACQUIRED", 7, "c"), event("RELEASED", 6, "b")], "")]
    assert resync(view, [], expired_unrecorded, None) == ["elected 7 c", "ended 7 expired"]
    assert described(view.apply(event("ACQUIRED", 7, "c", with_lease=True))) == "-"


def test_a_lease_read_that_fails_loses_no_change_history_showed() -> None:
    """The lease read after History fails (an instance gone at that moment):
    observing reconnects and resyncs. The changes History showed are not
    yielded then, and must not count as seen either: the next snapshot reads
    them from History again and yields each once."""
    view = ElectionView(KEY, highest=4)
    snapshot(view, [lease(5, "a")], [])
    granted_in_between = HistoryResult(
        [event("ACQUIRED", 6, "b"), event("RELEASED", 5, "a"), event("ACQUIRED", 5, "a")], ""
    )

    def unreachable(step: object) -> HistoryResult | Lease | None:
        if isinstance(step, str):
            return granted_in_between
        raise UnavailableError("no instance answered", grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(UnavailableError):
        drive(view.snapshot_flow(Snapshot([], None)), unreachable, ())
    assert resync(view, [lease(6, "b")], [granted_in_between], None) == [
        "ended 5 resigned",
        "elected 6 b",
    ]
