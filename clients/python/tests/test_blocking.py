"""The blocking client's stories (issue 26, "Prove it"), against real
servers: each test names the invariant it checks (DESIGN S1–S9, L1–L2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from leasehold import (
    AsyncHold,
    Hold,
    LateGrantError,
    LeaseClient,
    LeaseLostError,
    NotAcquiredError,
    SessionKey,
    StaleFencingTokenError,
    UnavailableError,
)
from leasehold._gen.leasehold.guarded.v1 import guarded_pb2, guarded_pb2_grpc
from support import (
    Server,
    TcpProxy,
    fresh_session,
    keepalive_streams_ended,
    lease_server,
    metric,
    wait_for,
)

ACCOUNT = "acct-py"
TTL = 3.0
MARGIN = 1.0
#: Runs of each form in the self-release tests.
RUNS = 3

Clients = Callable[..., LeaseClient]
Proxies = Callable[[str], TcpProxy]


def key(label: str) -> SessionKey:
    return SessionKey(ACCOUNT, fresh_session(label))


def put(
    store: Server, k: SessionKey, token: int, text: str, *, bearer: str
) -> guarded_pb2.PutResponse:
    """A Put to the guarded store as the session's account: ``bearer`` is
    that account's token (the store verifies it as the lease server does)."""
    import grpc

    from leasehold.errors import from_rpc_error

    with grpc.insecure_channel(store.address) as channel:
        stub = guarded_pb2_grpc.GuardedStoreServiceStub(channel)
        try:
            response: guarded_pb2.PutResponse = stub.Put(
                guarded_pb2.PutRequest(
                    key=k.to_proto(), name="transcript", value=text.encode(), fencing_token=token
                ),
                metadata=(("authorization", f"Bearer {bearer}"),),
                timeout=10,
            )
            return response
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e


def events_of(admin: LeaseClient, k: SessionKey, run_id: str) -> list[str]:
    return [e.type for e in reversed(admin.history(k).events) if e.run_id == run_id]


#: The server's counters a run that releases its own lease moves (or must not).
SELF_RELEASE_SERIES = (
    'leasehold_lease_losses_total{reason="released"}',
    "leasehold_lease_releases_total",
    "leasehold_lease_renewals_total",
)


def counters(address: str) -> dict[str, float]:
    return {series: metric(address, series) for series in SELF_RELEASE_SERIES}


def assert_released_not_lost(
    before: dict[str, float], after: dict[str, float], holds: list[Hold] | list[AsyncHold]
) -> None:
    """No loss counted for the runs' own releases, each run released once,
    each run's first renewal reached the server while its lease was held,
    and every hold ended as released, not lost."""
    losses, releases, renewals = (after[s] - before[s] for s in SELF_RELEASE_SERIES)
    assert losses == 0
    assert releases == len(holds)
    assert renewals == len(holds)
    for h in holds:
        assert h.released is True and not h.lost.is_set() and h.loss_reason is None
        with pytest.raises(LeaseLostError) as ended:
            h.check()
        assert ended.value.loss_reason == "released"


def test_s1_two_holders_race_and_exactly_one_wins(
    server: Server, token: Callable[..., str], clients: Clients
) -> None:
    """S1: two clients hold the same session at once; one gets it, the other
    is told who holds it."""
    k = key("race")
    a, b = clients(server.address, token=token()), clients(server.address, token=token())
    barrier = threading.Barrier(2)
    outcomes: dict[str, object] = {}
    entered: list[Hold] = []

    def race(name: str, client: LeaseClient) -> None:
        barrier.wait()
        h = client.hold(k, ttl=TTL, holder=name)
        try:
            h.__enter__()
            entered.append(h)
            outcomes[name] = h
        except NotAcquiredError as e:
            outcomes[name] = e

    threads = [threading.Thread(target=race, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes.values() if isinstance(o, Hold)]
    losers = [o for o in outcomes.values() if isinstance(o, NotAcquiredError)]
    assert len(winners) == 1 and len(losers) == 1
    assert losers[0].current is not None
    assert losers[0].current.run_id == winners[0].run_id
    assert losers[0].holder == winners[0].holder
    for h in entered:
        h.__exit__(None, None, None)


def test_l2_s6_s7_stalled_winner_stops_before_the_database_deadline_and_is_fenced(
    server: Server,
    store: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """L2: the winner's every route stalls; `lost` is set and its work stops
    while the database still counts the lease valid. S6: the other takes
    over with a larger token. S7: the old holder's late write is refused.
    No release is sent after the loss: History shows the old run's lease
    expired, not released."""
    k = key("stall")
    proxy = proxies(server.address)
    old = clients(proxy.address, token=token())
    new = clients(server.address, token=token())
    wrote: list[float] = []
    with old.hold(k, ttl=TTL, safety_margin=MARGIN, holder="old") as h:
        t1 = h.fencing_token
        put(store, k, t1, "old: first", bearer=token())
        proxy.stall()
        # The work: writes while it holds, checked before every write.
        while True:
            try:
                h.check()
            except LeaseLostError as e:
                stopped_at = time.monotonic()
                assert e.loss_reason == "deadline"
                break
            wrote.append(time.monotonic())
            h.lost.wait(0.05)
        assert h.lost.is_set()
        state = admin.get(k)
        assert state.held and state.lease is not None and state.lease.run_id == h.run_id
        assert state.lease.remaining.total_seconds() > 0
        assert all(t < stopped_at for t in wrote)
        with pytest.raises(LeaseLostError):
            h.fencing_metadata()
    assert h.released is None  # nothing sent
    with new.hold(k, ttl=TTL, wait=30, holder="new") as h2:
        assert h2.fencing_token > t1
        put(store, k, h2.fencing_token, "new: first", bearer=token())
        with pytest.raises(StaleFencingTokenError) as refused:
            put(store, k, t1, "old: late", bearer=token())
        assert refused.value.presented == t1
        assert refused.value.highest == h2.fencing_token
    # No release after loss, from the server: the old run's lease expired.
    assert "RELEASED" not in events_of(admin, k, h.run_id)
    assert events_of(admin, k, h.run_id)[0] == "ACQUIRED"


def test_l2_a_cut_stream_alone_reconnects_and_keeps_the_lease(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """L2: connections reset under the stream; it reconnects and the lease
    is kept, renewed past its first deadline, same run and token."""
    k = key("cut")
    proxy = proxies(server.address)
    c = clients(proxy.address, token=token())
    with c.hold(k, ttl=TTL, safety_margin=MARGIN) as h:
        first = h.lease
        wait_for("a KeepAlive connection", lambda: proxy.accepted >= 2)
        before = proxy.accepted
        proxy.cut()
        wait_for("a reconnected stream", lambda: proxy.accepted > before)
        # Past the first local deadline, the lease is still held: renewed
        # over the new stream.
        first_deadline = time.monotonic() + first.remaining.total_seconds()
        wait_for("the first deadline to pass", lambda: time.monotonic() > first_deadline + 0.1, 10)
        h.check()
        assert not h.lost.is_set()
        state = admin.get(k)
        assert state.lease is not None
        assert (state.lease.run_id, state.lease.fencing_token) == (h.run_id, h.fencing_token)
    assert h.released is True
    assert events_of(admin, k, h.run_id) == ["ACQUIRED", "RELEASED"]


def test_s2_a_retry_after_a_dropped_answer_keeps_the_token(
    servers: list[Server],
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """S2 (idempotent acquire): the proxy resets the connection carrying the
    Acquire's answer; the client retries with the same run id on the next
    instance and gets the same token. The server granted once."""
    k = key("dropped")
    proxy = proxies(servers[0].address)
    c = clients([proxy.address, servers[1].address], token=token())
    c.get(k)  # the connection is up: the next bytes from the server are the answer
    proxy.drop_next_answer()
    with c.hold(k, ttl=TTL) as h:
        assert proxy.dropped_answers == 1
        history = [e for e in reversed(admin.history(k).events) if e.type == "ACQUIRED"]
        assert [(e.run_id, e.fencing_token) for e in history] == [(h.run_id, h.fencing_token)]


def test_s5_a_release_whose_connection_is_reset_is_retried_on_the_same_address(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """S5 (idempotent release): with a single address, the proxy resets the
    connection carrying the Release before the server sees it; the client
    sends it again to the same address and it releases. History shows the
    run released once."""
    k = key("release-reset")
    proxy = proxies(server.address)
    c = clients(proxy.address, token=token())
    granted = c.acquire(k, ttl=30.0)
    assert granted.lease is not None
    run_id = granted.lease.run_id
    proxy.drop_next_request()
    assert c.release(k, run_id) is True
    assert proxy.dropped_requests == 1
    assert events_of(admin, k, run_id) == ["ACQUIRED", "RELEASED"]
    assert admin.get(k).lease is None


def test_a_revoke_whose_connection_is_reset_is_not_sent_again(
    server: Server, token: Callable[..., str], clients: Clients, proxies: Proxies
) -> None:
    """Revoke is not idempotent (sent again it could end a lease granted in
    between): a reset under it is reported as UNAVAILABLE, not retried."""
    k = key("revoke-reset")
    proxy = proxies(server.address)
    c = clients(proxy.address, token=token(scope="leasehold:admin"))
    granted = c.acquire(k, ttl=30.0)
    assert granted.lease is not None
    run_id = granted.lease.run_id
    proxy.drop_next_request()
    with pytest.raises(UnavailableError) as raised:
        c.revoke(k, reason="test")
    assert proxy.dropped_requests == 1
    assert [address for address, _ in raised.value.attempts] == [proxy.address]
    state = c.get(k)
    assert state.lease is not None and state.lease.run_id == run_id


def test_l2_an_instance_stopped_mid_hold_the_lease_is_kept_through_the_other(
    database_url: str,
    secret: str,
    servers: list[Server],
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
) -> None:
    """L2: the instance carrying the stream stops; the stream reconnects to
    the other instance and the lease is renewed there."""
    k = key("failover")
    doomed = lease_server(database_url, secret)
    try:
        c = clients([doomed.address, servers[1].address], token=token())
        with c.hold(k, ttl=TTL, safety_margin=MARGIN) as h:
            doomed.stop()
            first_deadline = time.monotonic() + TTL
            wait_for("the first TTL to pass", lambda: time.monotonic() > first_deadline, 10)
            h.check()
            state = admin.get(k)
            assert state.lease is not None and state.lease.run_id == h.run_id
            assert state.lease.remaining.total_seconds() > 0
        assert h.released is True
    finally:
        doomed.stop()


def test_l1_a_thousand_leases_share_one_stream(
    database_url: str, secret: str, token: Callable[..., str], clients: Clients
) -> None:
    """One KeepAlive stream carries all of a client's 1,000 leases (counted
    by the server when the stream ends)."""
    own = lease_server(database_url, secret)
    try:
        c = clients(own.address, token=token())
        holds = [c.hold(key("many"), ttl=10.0) for _ in range(1000)]
        for h in holds:
            h.__enter__()
        first = {h.run_id: h.lease.expires_at for h in holds}
        # Every lease renewed at least once on the stream.
        wait_for(
            "a renewal of every lease",
            lambda: all(h.lease.expires_at != first[h.run_id] for h in holds),
            30,
        )
        assert c.keepalive_streams == 1
        assert not any(h.lost.is_set() for h in holds)
        for h in holds:
            h.__exit__(None, None, None)
        wait_for("the stream to end", lambda: keepalive_streams_ended(own.address) >= 1)
        assert keepalive_streams_ended(own.address) == 1
    finally:
        own.stop()


def test_l2_a_client_past_max_leases_per_stream_opens_another_stream(
    database_url: str, secret: str, token: Callable[..., str], clients: Clients
) -> None:
    """L2: a server bounded to two leases per stream refuses the third with
    LIMIT_EXCEEDED (limit, max); the client (at its default bound) lowers
    its bound and spreads five leases over three streams; all are held past
    their first deadline."""
    own = lease_server(database_url, secret, "--max-leases-per-stream", "2")
    try:
        events: list[object] = []
        c = clients(own.address, token=token(), on_event=events.append)
        holds = [c.hold(key("lanes"), ttl=TTL, safety_margin=MARGIN) for _ in range(5)]
        for h in holds:
            h.__enter__()
        first_deadline = time.monotonic() + TTL
        wait_for("the first TTL to pass", lambda: time.monotonic() > first_deadline, 10)
        for h in holds:
            h.check()
        assert c.keepalive_streams == 3
        refused = [
            e
            for e in events
            if getattr(e, "type", "") == "failed"
            and getattr(getattr(e, "error", None), "reason", None) == "LIMIT_EXCEEDED"
        ]
        assert len(refused) == 1
        assert refused[0].error.metadata == {"limit": "max-leases-per-stream", "max": "2"}  # type: ignore[attr-defined]
        for h in holds:
            h.__exit__(None, None, None)
    finally:
        own.stop()


def test_l2_a_late_grant_is_refused_and_released(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """L2: an answer that arrives after its own local deadline is not used:
    LateGrantError, and the grant is released."""
    k = key("late")
    proxy = proxies(server.address)
    c = clients(proxy.address, token=token())
    c.get(k)
    proxy.answer_delay = 0.8  # the Acquire's answer
    with pytest.raises(LateGrantError) as late:
        c.hold(k, ttl=1.0, safety_margin=0.5).__enter__()
    assert late.value.late_lease is not None
    run_id = late.value.late_lease.run_id
    assert events_of(admin, k, run_id) == ["ACQUIRED", "RELEASED"]


def test_l2_work_that_ends_at_once_releases_after_its_renewal_is_answered(
    database_url: str,
    secret: str,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """L2: work that ends at once (run_exclusive, and a hold block) releases
    only after its first renewal, sent as the KeepAlive stream opens, is
    answered: every answer reaches the client 300 ms late, so a Release sent
    at once would reach the server before the renewal, which the server then
    refuses as "released" and counts as a lost lease. No loss is counted or
    reported. A server of its own: its counters move only for these runs."""
    own = lease_server(database_url, secret)
    try:
        proxy = proxies(own.address)
        c = clients(proxy.address, token=token())
        before = counters(own.address)
        proxy.answer_lag = 0.3
        holds: list[Hold] = []
        for _ in range(RUNS):
            c.run_exclusive(key("release-not-loss"), holds.append, ttl=30.0)
        for _ in range(RUNS):
            with c.hold(key("release-not-loss"), ttl=30.0) as h:
                holds.append(h)
        assert_released_not_lost(before, counters(own.address), holds)
    finally:
        own.stop()


def test_s5_a_hold_ended_by_its_own_handoff_listener_releases_at_once(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """S5: a listener that ends its hold runs on the thread that reads the
    KeepAlive stream: the hold cannot wait there for the answer to a renewal
    in flight (one is put in flight first), so it releases at once instead
    of stalling the stream until the local deadline passes."""
    k = key("handoff-exit")
    c = clients(server.address, token=token())
    h = c.hold(k, ttl=10.0)
    h.__enter__()
    granted = h.lease.expires_at
    wait_for("a first renewal on the stream", lambda: h.lease.expires_at != granted)
    took: list[float] = []

    def end_the_hold(request: object) -> None:
        core = h._core
        assert core is not None and core.registration is not None
        core.registration.renew()
        started = time.monotonic()
        h.__exit__(None, None, None)
        took.append(time.monotonic() - started)

    h.on_handoff(end_the_hold)
    assert admin.request_handoff(k, requester_holder="browser").delivered
    wait_for("the listener to end the hold", lambda: len(took) > 0, 20)
    assert took[0] < 2.0
    assert h.released is True and not h.lost.is_set()
    assert events_of(admin, k, h.run_id) == ["ACQUIRED", "HANDOFF_REQUESTED", "RELEASED"]


def test_s3_a_handoff_request_is_delivered(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """S3: a handoff request reaches the holder (event, list and callback)
    and takes nothing away."""
    k = key("handoff")
    c = clients(server.address, token=token())
    with c.hold(k, ttl=TTL) as h:
        # The server tells a stream of the handoffs of the leases it carries:
        # wait until the stream has renewed this one.
        granted = h.lease.expires_at
        wait_for("a first renewal on the stream", lambda: h.lease.expires_at != granted)
        seen: list[str] = []
        h.on_handoff(lambda r: seen.append(r.requester_holder))
        answer = admin.request_handoff(k, requester_holder="browser", reason="continue there")
        assert answer.delivered
        assert h.handoff_requested.wait(10)
        assert h.handoff_requests[0].requester_holder == "browser"
        assert h.handoff_requests[0].reason == "continue there"
        assert seen == ["browser"]
        h.check()
    assert h.released is True


def test_s5_revoked_lease_is_lost_and_not_released(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """A revoke reaches the holder's stream as lost (reason revoked); the
    hold's own release is not a loss; a result returned after loss is not
    returned by run_exclusive."""
    k = key("revoke")
    c = clients(server.address, token=token())

    def work(h: Hold) -> str:
        admin.revoke(k, reason="test")
        assert h.lost.wait(10)
        return "done after loss"

    with pytest.raises(LeaseLostError) as lost:
        c.run_exclusive(k, work, ttl=TTL)
    assert lost.value.loss_reason == "revoked"
    # The lost lease left the client's KeepAlive bookkeeping.
    assert c._keepalive.placed == {}

    with c.hold(k, ttl=TTL) as h:
        pass
    assert h.released is True and not h.lost.is_set()
    with pytest.raises(LeaseLostError) as after:
        h.check()
    assert after.value.loss_reason == "released"
    assert c.run_exclusive(k, lambda h: h.fencing_token, ttl=TTL) > 0
