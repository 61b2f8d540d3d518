"""Leader election (E1) against real servers and PostgreSQL, with the
blocking client and then the asyncio client: campaign, resign, proclaim,
observe and the callbacks, through real sockets and a TCP proxy that stalls
or drops the leader's or a candidate's connection. The TypeScript twin is
test/election.test.ts; docs/clients.md has the rows.

A candidate is "waiting" once the server has queued its Acquire: the
election server's debug log says so ("acquire waiting"), counted per
election by ``Server.waiting_acquires``. That a lost, cancelled or timed-out
candidate left nothing behind is read from what happens next: a third
candidate is granted the moment the leader resigns, and History shows a
grant to the leader and to the third, none to the one that gave up (a
waiter left queued would be first in line, and granted)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import datetime, timedelta

import psycopg
import pytest
from test_async import AsyncClients, aclients, until
from test_blocking import ACCOUNT, Clients, Proxies, put

from leasehold import (
    AsyncLeadership,
    AsyncLeaseClient,
    CanceledError,
    ElectionChange,
    InvalidArgumentError,
    KeepAliveEvent,
    Leadership,
    LeaseClient,
    LeaseLostError,
    NotAcquiredError,
    SessionKey,
    StaleFencingTokenError,
    StopReason,
    UnavailableError,
)
from support import Server, TcpProxy, fresh_session, lease_server, wait_for

__all__ = ["aclients"]  # the fixture, imported for this file's async tests

#: A term long enough that only a release, never an expiry, can end it in a test.
LONG = 60.0


@pytest.fixture(scope="module")
def eserver(database_url: str, secret: str) -> Iterator[Server]:
    """A lease server whose waiting Acquires are counted (its debug log)."""
    started = lease_server(database_url, secret, waiters=True)
    yield started
    started.stop()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for blocking campaigns that wait while the test goes on."""
    with ThreadPoolExecutor(8) as executor:
        yield executor


def election(label: str) -> str:
    return fresh_session(label)


def waiting(server: Server, name: str) -> int:
    return server.waiting_acquires(ACCOUNT, name)


def queued(server: Server, name: str, n: int) -> Callable[[], bool]:
    """Whether the server has queued ``n`` waiting Acquires of the election."""
    return lambda: waiting(server, name) >= n


def grants(admin: LeaseClient, name: str) -> list[str]:
    """The holder label of every grant of the election, oldest first."""
    events = admin.history(SessionKey(ACCOUNT, name), page_size=100).events
    return [e.holder for e in reversed(events) if e.type == "ACQUIRED"]


def database_now(database_url: str) -> datetime:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    now: datetime = row[0]
    return now


def sleep_until_keeper_expired(database_url: str, keeper_id: str) -> None:
    """Waits on the database clock until the keeper's deadline has passed."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_sleep_until(expires_at) FROM keepers WHERE id = %s::uuid", (keeper_id,)
        )


def granted_well_before(won: Leadership | AsyncLeadership, expires_at: datetime | None) -> None:
    """Granted long before the previous term's 60 s deadline: by its release."""
    assert won.lease.acquired_at is not None and expires_at is not None
    assert won.lease.acquired_at < expires_at - timedelta(seconds=50)


# Election: three candidates, one leader at a time, terms strictly increasing;
# candidates waiting on one instance lead in arrival order


def test_e1_s1_s6_three_candidates_one_leader_at_a_time_terms_strictly_increasing(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """E1, S1, S6: three candidates campaign at once; each leader resigns in
    turn. No term starts while another runs (the callbacks), the terms are
    the grants' fencing tokens in increasing order, and leader() names each
    leader while it leads."""
    name = election("three")
    lock = threading.Lock()
    leading: set[str] = set()
    overlaps: list[str] = []
    terms: list[int] = []

    def candidate(who: str) -> Leadership:
        def started(term: int) -> None:
            with lock:
                if leading:
                    overlaps.append(f"{who} started while {sorted(leading)} led")
                leading.add(who)
                terms.append(term)

        def stopped(term: int, reason: StopReason) -> None:
            with lock:
                leading.discard(who)

        client = clients(eserver.address, token=token())
        return client.campaign(
            ACCOUNT,
            name,
            value=who,
            ttl=5,
            on_started_leading=started,
            on_stopped_leading=stopped,
        )

    order: list[Leadership] = []
    with ThreadPoolExecutor(3) as threads:
        pending: set[Future[Leadership]] = {
            threads.submit(candidate(who).__enter__) for who in "abc"
        }
        for round_ in range(3):
            done, pending = wait(pending, timeout=20, return_when=FIRST_COMPLETED)
            assert len(done) == 1, f"leader number {round_ + 1}"
            leadership = done.pop().result()
            order.append(leadership)
            now = admin.leader(ACCOUNT, name)
            assert now is not None
            assert (now.value, now.term, now.run_id) == (
                leadership.value,
                leadership.term,
                leadership.run_id,
            )
            if round_ == 0:
                wait_for("the others waiting", lambda: waiting(eserver, name) >= 2)
            leadership.resign()
    assert overlaps == []
    assert terms == [leadership.term for leadership in order]
    assert terms[0] < terms[1] < terms[2]
    assert len({leadership.value for leadership in order}) == 3
    assert admin.leader(ACCOUNT, name) is None


def test_e1_candidates_waiting_on_one_instance_lead_in_their_arrival_order(
    eserver: Server, token: Callable[..., str], clients: Clients, pool: ThreadPoolExecutor
) -> None:
    """E1: three candidates queue behind a leader, one after another; when
    it resigns they lead in their arrival order (the server's FIFO per key)."""
    name = election("fifo")
    client = clients(eserver.address, token=token())
    first = client.campaign(ACCOUNT, name, value="first", ttl=LONG)
    first.__enter__()
    wins: list[Future[Leadership]] = []
    for i, who in enumerate("bcd"):
        client = clients(eserver.address, token=token())
        wins.append(pool.submit(client.campaign(ACCOUNT, name, value=who, ttl=LONG).__enter__))
        wait_for(f"{who} waiting", queued(eserver, name, i + 1))
    first.resign()
    order: list[str] = []
    for win in wins:
        leadership = win.result(timeout=5)
        order.append(leadership.value)
        leadership.resign()
    assert order == ["b", "c", "d"]


async def test_e1_async_three_candidates_one_leader_at_a_time_terms_strictly_increasing(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("athree")
    leading: set[str] = set()
    overlaps: list[str] = []
    terms: list[int] = []

    def candidate(who: str) -> AsyncLeadership:
        def started(term: int) -> None:
            if leading:
                overlaps.append(f"{who} started while {sorted(leading)} led")
            leading.add(who)
            terms.append(term)

        return aclients(eserver.address, token=token()).campaign(
            ACCOUNT,
            name,
            value=who,
            ttl=5,
            on_started_leading=started,
            on_stopped_leading=lambda term, reason: leading.discard(who),
        )

    pending = {asyncio.ensure_future(candidate(who).__aenter__()) for who in "abc"}
    order: list[AsyncLeadership] = []
    for round_ in range(3):
        done, pending = await asyncio.wait(pending, timeout=20, return_when=FIRST_COMPLETED)
        assert len(done) == 1, f"leader number {round_ + 1}"
        leadership = done.pop().result()
        order.append(leadership)
        now = admin.leader(ACCOUNT, name)
        assert now is not None and (now.value, now.term) == (leadership.value, leadership.term)
        if round_ == 0:
            await until("the others waiting", lambda: waiting(eserver, name) >= 2)
        await leadership.resign()
    assert overlaps == []
    assert terms == [leadership.term for leadership in order]
    assert terms[0] < terms[1] < terms[2]
    assert admin.leader(ACCOUNT, name) is None


async def test_e1_async_candidates_waiting_on_one_instance_lead_in_their_arrival_order(
    eserver: Server, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("afifo")
    first = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="first", ttl=LONG
    )
    await first.__aenter__()
    wins: list[asyncio.Future[AsyncLeadership]] = []
    for i, who in enumerate("bcd"):
        client = aclients(eserver.address, token=token())
        wins.append(
            asyncio.ensure_future(client.campaign(ACCOUNT, name, value=who, ttl=LONG).__aenter__())
        )
        await until(f"{who} waiting", queued(eserver, name, i + 1))
    await first.resign()
    order: list[str] = []
    for win in wins:
        leadership = await asyncio.wait_for(win, 5)
        order.append(leadership.value)
        await leadership.resign()
    assert order == ["b", "c", "d"]


def test_e1_a_campaign_asks_again_with_the_same_run_id_whenever_one_wait_runs_out(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: one waiting Acquire is bounded (the server's --max-wait; here a
    0.2 s ``wait_chunk``): the campaign asks again, with the same run id,
    until the leader resigns, and then leads."""
    name = election("chunks")
    holder = clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="holder", ttl=LONG
    )
    holder.__enter__()
    patient = clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="patient", ttl=LONG, wait_chunk=0.2
    )
    campaigning = pool.submit(patient.__enter__)
    wait_for("three waits, one after another", lambda: waiting(eserver, name) >= 3)
    holder.resign()
    won = campaigning.result(timeout=5)
    assert won.run_id == patient.run_id and won.term > holder.term
    # One grant to the candidate, after the holder's: no wait left anything.
    events = admin.history(won.key).events
    grantees = [e.run_id for e in reversed(events) if e.type == "ACQUIRED"]
    assert grantees == [holder.run_id, patient.run_id]
    won.resign()


async def test_e1_async_a_campaign_asks_again_with_the_same_run_id_whenever_one_wait_runs_out(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("achunks")
    holder = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="holder", ttl=LONG
    )
    await holder.__aenter__()
    patient = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="patient", ttl=LONG, wait_chunk=0.2
    )
    campaigning = asyncio.ensure_future(patient.__aenter__())
    await until("three waits, one after another", lambda: waiting(eserver, name) >= 3)
    await holder.resign()
    won = await asyncio.wait_for(campaigning, 5)
    assert won.run_id == patient.run_id and won.term > holder.term
    await won.resign()


# Election: the leader's stream stalled stops leading before the next one is
# granted; the new term passes a fence that then refuses the old term


def test_e1_l2_s7_the_leaders_stream_stalled_stops_leading_before_the_next_starts_and_the_fence_refuses_the_old_term(  # noqa: E501
    eserver: Server,
    store: Server,
    database_url: str,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
) -> None:
    """E1, L2: every route of the leader stalls; its term ends (``lost``,
    ``deadline``) before the successor is granted, on the database clock.
    S7: the successor's write with its term passes the guarded store's
    fence, which then refuses the old term's late write."""
    name = election("stall")
    key = SessionKey(ACCOUNT, name)
    proxy = proxies(eserver.address)
    old = clients(proxy.address, token=token()).campaign(
        ACCOUNT, name, value="old", ttl=2, safety_margin=0.6
    )
    old.__enter__()
    put(store, key, old.term, "old", bearer=token())
    client = clients(eserver.address, token=token())
    succeeding = pool.submit(client.campaign(ACCOUNT, name, value="new", ttl=5).__enter__)
    wait_for("the next candidate waiting", lambda: waiting(eserver, name) >= 1)
    proxy.stall()
    assert old.ended.wait(20)
    stopped_before = database_now(database_url)
    assert old.lost.is_set()
    assert old.stop_reason is not None and old.stop_reason.kind == "lost"
    assert isinstance(old.stop_reason.cause, LeaseLostError)
    assert old.stop_reason.cause.loss_reason == "deadline"
    successor = succeeding.result(timeout=20)
    assert successor.lease.acquired_at is not None
    assert stopped_before < successor.lease.acquired_at
    assert successor.term > old.term
    put(store, key, successor.term, "new", bearer=token())
    with pytest.raises(StaleFencingTokenError) as refused:
        put(store, key, old.term, "old again", bearer=token())
    assert (refused.value.presented, refused.value.highest) == (old.term, successor.term)
    with pytest.raises(LeaseLostError):
        old.fencing_metadata()
    proxy.pass_()
    successor.resign()


async def test_e1_l2_s7_async_the_leaders_stream_stalled_stops_leading_before_the_next_starts_and_the_fence_refuses_the_old_term(  # noqa: E501
    eserver: Server,
    store: Server,
    database_url: str,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("astall")
    key = SessionKey(ACCOUNT, name)
    proxy = proxies(eserver.address)
    old = aclients(proxy.address, token=token()).campaign(
        ACCOUNT, name, value="old", ttl=2, safety_margin=0.6
    )
    await old.__aenter__()
    put(store, key, old.term, "old", bearer=token())
    client = aclients(eserver.address, token=token())
    succeeding = asyncio.ensure_future(client.campaign(ACCOUNT, name, value="new").__aenter__())
    await until("the next candidate waiting", lambda: waiting(eserver, name) >= 1)
    proxy.stall()
    await asyncio.wait_for(old.ended.wait(), 20)
    stopped_before = database_now(database_url)
    assert old.stop_reason is not None and old.stop_reason.kind == "lost"
    assert old.loss_reason == "deadline"
    successor = await asyncio.wait_for(succeeding, 20)
    assert successor.lease.acquired_at is not None
    assert stopped_before < successor.lease.acquired_at
    assert successor.term > old.term
    put(store, key, successor.term, "new", bearer=token())
    with pytest.raises(StaleFencingTokenError):
        put(store, key, old.term, "old again", bearer=token())
    with pytest.raises(LeaseLostError):
        old.fencing_metadata()
    proxy.pass_()
    await successor.resign()


# Election: a waiting candidate whose connection is lost aborts and leaves no
# candidate behind; so does one cancelled or past its timeout


def next_candidate_leads_at_once(
    eserver: Server,
    admin: LeaseClient,
    client: LeaseClient,
    pool: ThreadPoolExecutor,
    name: str,
    holder: Leadership,
) -> None:
    """Nothing was left of the candidate that gave up: a third one, queued
    now, leads the moment the holder resigns, and History shows no grant but
    the holder's and the third's."""
    queued = waiting(eserver, name)
    third = pool.submit(client.campaign(ACCOUNT, name, value="third", ttl=LONG).__enter__)
    wait_for("the third candidate waiting", lambda: waiting(eserver, name) > queued)
    expires_at = holder.lease.expires_at
    holder.resign()
    won = third.result(timeout=5)
    assert won.value == "third"
    granted_well_before(won, expires_at)
    assert grants(admin, name) == ["holder", "third"]
    won.resign()


async def next_candidate_leads_at_once_async(
    eserver: Server,
    admin: LeaseClient,
    client: AsyncLeaseClient,
    name: str,
    holder: AsyncLeadership,
) -> None:
    queued = waiting(eserver, name)
    third = asyncio.ensure_future(
        client.campaign(ACCOUNT, name, value="third", ttl=LONG).__aenter__()
    )
    await until("the third candidate waiting", lambda: waiting(eserver, name) > queued)
    expires_at = holder.lease.expires_at
    await holder.resign()
    won = await asyncio.wait_for(third, 5)
    assert won.value == "third"
    granted_well_before(won, expires_at)
    assert grants(admin, name) == ["holder", "third"]
    await won.resign()


def test_e1_a_waiting_candidate_whose_connection_is_lost_aborts_and_leaves_no_candidate_behind(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: a candidate waits through a proxy that then resets and refuses its
    connections: the campaign raises UnavailableError, no term is reported,
    and the server dropped its waiter with the call."""
    name = election("lost-waiter")
    direct = clients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    holder.__enter__()
    proxy = proxies(eserver.address)
    stopped: list[int] = []
    lost = clients(proxy.address, token=token()).campaign(
        ACCOUNT, name, value="lost", ttl=LONG, on_stopped_leading=lambda t, r: stopped.append(t)
    )
    campaigning = pool.submit(lost.__enter__)
    wait_for("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    proxy.drop()
    with pytest.raises(UnavailableError):
        campaigning.result(timeout=20)
    next_candidate_leads_at_once(eserver, admin, direct, pool, name, holder)
    assert stopped == []


def test_e1_a_campaign_cancelled_while_waiting_raises_canceled_error_and_leaves_no_waiter(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: cancel() from another thread ends a waiting campaign with
    CanceledError; its waiting call is cancelled, and nothing is left."""
    name = election("cancel-waiting")
    direct = clients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    holder.__enter__()
    waiter = clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="waiter", ttl=LONG
    )
    campaigning = pool.submit(waiter.__enter__)
    wait_for("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    waiter.cancel()
    with pytest.raises(CanceledError):
        campaigning.result(timeout=20)
    assert waiter.stop_reason is None  # no term began
    next_candidate_leads_at_once(eserver, admin, direct, pool, name, holder)


def test_e1_a_campaign_whose_timeout_passes_is_not_acquired_and_names_the_leader(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: a campaign with a 0.3 s timeout raises NotAcquiredError naming
    the leader (its last wait was cut to end then: the server's own answer
    says who leads), and leaves nothing behind."""
    name = election("timeout")
    direct = clients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    holder.__enter__()
    late = clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="late", timeout=0.3
    )
    with pytest.raises(NotAcquiredError) as refused:
        late.__enter__()
    assert refused.value.holder == "holder"
    next_candidate_leads_at_once(eserver, admin, direct, pool, name, holder)


def late_grants_then_prompt(
    admin: LeaseClient, name: str, proxy: TcpProxy, lag: float
) -> Callable[[], str | None]:
    """Every answer comes ``lag`` seconds late (past a 1 s lease's local
    deadline) until a late grant of the election has ended; answers are
    prompt from then on. Returns a predicate: the late run, once it ended."""

    def ended() -> str | None:
        events = admin.history(SessionKey(ACCOUNT, name), page_size=100).events
        late = next((e.run_id for e in events if e.type == "ACQUIRED"), None)
        leader = admin.leader(ACCOUNT, name)
        if late is None or (leader is not None and leader.run_id == late):
            return None
        proxy.answer_lag = 0.0
        return late

    proxy.answer_lag = lag
    return ended


#: Answers 0.8 s late: the re-acquire confirming the waited grant comes back
#: late too (LateGrantError, released). 1.5 s: the grant's 1 s lease has
#: expired when its answer comes, and the re-acquire finds it ended
#: (LeaseNotHeldError).
LAGS = pytest.mark.parametrize(
    "lag", [0.8, 1.5], ids=["confirmed-late", "expired-before-confirmed"]
)


@LAGS
def test_e1_l2_a_campaign_whose_grant_came_late_goes_on_with_a_new_run_and_leads(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
    lag: float,
) -> None:
    """E1, L2, S4: a grant whose answer came after its local deadline is
    released (or found ended) and the campaign goes on; that run never holds
    the election again (S4), so the campaign asks with a new run and leads."""
    name = election("late")
    proxy = proxies(eserver.address)
    c = clients(proxy.address, token=token())
    c.get(SessionKey(ACCOUNT, name))
    ended = late_grants_then_prompt(admin, name, proxy, lag)
    leadership = c.campaign(ACCOUNT, name, value="patient", ttl=1.0, safety_margin=0.5)
    entering = pool.submit(leadership.__enter__)
    late = wait_for("a late grant ended", ended)
    assert entering.result(timeout=20) is leadership
    assert leadership.run_id != late
    leader = admin.leader(ACCOUNT, name)
    assert leader is not None and leader.run_id == leadership.run_id
    leadership.resign()


@LAGS
async def test_e1_l2_async_a_campaign_whose_grant_came_late_goes_on_with_a_new_run_and_leads(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
    lag: float,
) -> None:
    name = election("alate")
    proxy = proxies(eserver.address)
    c = aclients(proxy.address, token=token())
    await c.get(SessionKey(ACCOUNT, name))
    ended = late_grants_then_prompt(admin, name, proxy, lag)
    leadership = c.campaign(ACCOUNT, name, value="patient", ttl=1.0, safety_margin=0.5)
    entering = asyncio.ensure_future(leadership.__aenter__())
    await until("a late grant ended", ended)
    late = ended()
    assert await asyncio.wait_for(entering, 20) is leadership
    assert late is not None and leadership.run_id != late
    leader = admin.leader(ACCOUNT, name)
    assert leader is not None and leader.run_id == leadership.run_id
    await leadership.resign()


async def test_e1_async_a_waiting_candidate_whose_connection_is_lost_aborts_and_leaves_no_candidate_behind(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("alost-waiter")
    direct = aclients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    await holder.__aenter__()
    proxy = proxies(eserver.address)
    stopped: list[int] = []
    lost = aclients(proxy.address, token=token()).campaign(
        ACCOUNT, name, value="lost", ttl=LONG, on_stopped_leading=lambda t, r: stopped.append(t)
    )
    campaigning = asyncio.ensure_future(lost.__aenter__())
    await until("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    proxy.drop()
    with pytest.raises(UnavailableError):
        await asyncio.wait_for(campaigning, 20)
    await next_candidate_leads_at_once_async(eserver, admin, direct, name, holder)
    assert stopped == []


async def test_e1_async_a_campaign_cancelled_while_waiting_leaves_no_waiter(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """E1: the task that campaigns is cancelled while waiting
    (asyncio.CancelledError); cancel() ends another with CanceledError.
    Neither leaves anything behind."""
    name = election("acancel-waiting")
    direct = aclients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    await holder.__aenter__()
    waiter = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="waiter", ttl=LONG
    )
    campaigning = asyncio.ensure_future(waiter.__aenter__())
    await until("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    campaigning.cancel()
    with pytest.raises(asyncio.CancelledError):
        await campaigning
    other = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="other", ttl=LONG
    )
    campaigning = asyncio.ensure_future(other.__aenter__())
    await until("the other candidate waiting", lambda: waiting(eserver, name) >= 2)
    await other.cancel()
    with pytest.raises(CanceledError):
        await campaigning
    assert waiter.stop_reason is None and other.stop_reason is None
    await next_candidate_leads_at_once_async(eserver, admin, direct, name, holder)


async def test_e1_async_a_campaign_whose_task_is_cancelled_as_its_grant_arrives_leaves_no_lease(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """E1: the task that campaigns is cancelled in the instant its grant
    arrives (after the hold was granted, before the campaign resumed: the
    client's KeepAlive stream opening for the grant is that instant). The
    campaign raises asyncio.CancelledError, no term is reported, and the
    grant is released before it does: nobody leads, and the next candidate
    leads at once."""
    name = election("acancel-granted")
    direct = aclients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    await holder.__aenter__()
    loop = asyncio.get_running_loop()
    campaigning: list[asyncio.Future[AsyncLeadership]] = []

    def cancel_as_granted(event: KeepAliveEvent) -> None:
        if event.type == "open":
            loop.call_soon(campaigning[0].cancel)

    client = aclients(eserver.address, token=token(), on_event=cancel_as_granted)
    started: list[int] = []
    waiter = client.campaign(
        ACCOUNT, name, value="waiter", ttl=LONG, on_started_leading=started.append
    )
    campaigning.append(asyncio.ensure_future(waiter.__aenter__()))
    await until("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    await holder.resign()
    with pytest.raises(asyncio.CancelledError):
        await campaigning[0]
    assert started == [] and waiter.stop_reason is None
    assert admin.leader(ACCOUNT, name) is None
    assert grants(admin, name) == ["holder", "waiter"]
    nxt = direct.campaign(ACCOUNT, name, value="next", ttl=LONG)
    await asyncio.wait_for(nxt.__aenter__(), 5)
    await nxt.resign()


async def test_e1_async_a_campaign_whose_timeout_passes_is_not_acquired_and_names_the_leader(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("atimeout")
    direct = aclients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    await holder.__aenter__()
    late = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="late", timeout=0.3
    )
    with pytest.raises(NotAcquiredError) as refused:
        await late.__aenter__()
    assert refused.value.holder == "holder"
    await next_candidate_leads_at_once_async(eserver, admin, direct, name, holder)


# Election: resign hands over at once


def test_e1_resign_hands_over_at_once_to_the_waiting_candidate(
    eserver: Server, token: Callable[..., str], clients: Clients, pool: ThreadPoolExecutor
) -> None:
    """E1: the leader resigns (leaving its block); the waiting candidate is
    granted at once, long before the first term's deadline, with a larger term."""
    name = election("resign")
    second = clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="second", ttl=LONG
    )
    with clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="first", ttl=LONG
    ) as first:
        next_ = pool.submit(second.__enter__)
        wait_for("the second candidate waiting", lambda: waiting(eserver, name) >= 1)
        expires_at = first.lease.expires_at
    assert first.ended.is_set() and first.stop_reason == StopReason("resigned")
    assert not first.lost.is_set()
    won = next_.result(timeout=5)
    assert won.term > first.term
    granted_well_before(won, expires_at)
    won.resign()


async def test_e1_async_resign_hands_over_at_once_to_the_waiting_candidate(
    eserver: Server, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("aresign")
    second = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="second", ttl=LONG
    )
    async with aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="first", ttl=LONG
    ) as first:
        next_ = asyncio.ensure_future(second.__aenter__())
        await until("the second candidate waiting", lambda: waiting(eserver, name) >= 1)
        expires_at = first.lease.expires_at
    assert first.ended.is_set() and first.stop_reason == StopReason("resigned")
    won = await asyncio.wait_for(next_, 5)
    assert won.term > first.term
    granted_well_before(won, expires_at)
    await won.resign()


# Election: proclaim changes the value in the same term; refused once over


def test_e1_proclaim_changes_the_value_in_the_same_term_and_is_refused_once_leadership_is_over(
    eserver: Server, token: Callable[..., str], clients: Clients
) -> None:
    """E1: proclaim re-acquires by the same run: the value changes and the
    term does not. After resign it raises LeaseLostError and nothing is
    granted. A value longer than the holder label is refused naming it."""
    name = election("proclaim")
    client = clients(eserver.address, token=token())
    leadership = client.campaign(ACCOUNT, name, value="v1", ttl=10)
    with leadership:
        leadership.proclaim("v2")
        assert leadership.value == "v2"
        now = client.leader(ACCOUNT, name)
        assert now is not None and (now.value, now.term) == ("v2", leadership.term)
    with pytest.raises(LeaseLostError):
        leadership.proclaim("v3")
    assert client.leader(ACCOUNT, name) is None
    with pytest.raises(InvalidArgumentError) as bad:
        client.campaign(ACCOUNT, name, value="x" * 65)
    assert bad.value.field == "value"


async def test_e1_async_proclaim_changes_the_value_in_the_same_term_and_is_refused_once_leadership_is_over(  # noqa: E501
    eserver: Server, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("aproclaim")
    client = aclients(eserver.address, token=token())
    async with client.campaign(ACCOUNT, name, value="v1", ttl=10) as leadership:
        await leadership.proclaim("v2")
        assert leadership.value == "v2"
        now = await client.leader(ACCOUNT, name)
        assert now is not None and (now.value, now.term) == ("v2", leadership.term)
    with pytest.raises(LeaseLostError):
        await leadership.proclaim("v3")
    assert await client.leader(ACCOUNT, name) is None
    with pytest.raises(InvalidArgumentError) as bad:
        client.campaign(ACCOUNT, name, value="x" * 65)
    assert bad.value.field == "value"


# Election: observe yields the current leader, then every change in order,
# across an instance stopped mid-watch


def changes_of(seen: list[ElectionChange]) -> list[tuple[str, int]]:
    return [(c.type, c.term) for c in seen]


def test_e1_observe_yields_the_current_leader_then_every_change_in_order_across_an_instance_stopped_mid_watch(  # noqa: E501
    database_url: str, secret: str, token: Callable[..., str], clients: Clients, proxies: Proxies
) -> None:
    """E1: the watcher's instance stops; before its watch is back (the other
    instance is refused to it meanwhile) two terms begin and one ends. They
    are yielded in order from History, then the stream goes on."""
    one, two = lease_server(database_url, secret), lease_server(database_url, secret)
    try:
        name = election("observe")
        to_two = proxies(two.address)
        watcher = clients([one.address, to_two.address], token=token())
        actor = clients(two.address, token=token())
        first = actor.campaign(ACCOUNT, name, value="first", ttl=10)
        first.__enter__()
        seen: list[ElectionChange] = []
        observer = watcher.observe(ACCOUNT, name)

        def read() -> None:
            for change in observer:
                seen.append(change)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def count(n: int) -> None:
            wait_for(f"change number {n}", lambda: len(seen) >= n)

        count(1)
        first.proclaim("first-v2")
        count(2)
        first.resign()
        count(3)
        to_two.drop()
        one.stop()
        with actor.campaign(ACCOUNT, name, value="second", ttl=10) as second:
            pass
        third = actor.campaign(ACCOUNT, name, value="third", ttl=10)
        third.__enter__()
        to_two.pass_()
        count(6)
        third.resign()
        count(7)
        observer.close()
        reader.join(10)
        assert not reader.is_alive()
        assert changes_of(seen) == [
            ("current", first.term),
            ("proclaimed", first.term),
            ("ended", first.term),
            ("elected", second.term),
            ("ended", second.term),
            ("elected", third.term),
            ("ended", third.term),
        ]
        assert seen[1].leader is not None and seen[1].leader.value == "first-v2"
        assert seen[3].leader is not None and seen[3].leader.value == "second"
        assert seen[6].how == "resigned"
    finally:
        one.stop()
        two.stop()


def test_e1_observe_sees_a_term_that_expires_with_no_successor_as_ended_expired(
    eserver: Server, token: Callable[..., str], clients: Clients, proxies: Proxies
) -> None:
    """E1: a leader cut off expires; nobody succeeds it: ended, expired."""
    name = election("observe-expiry")
    proxy = proxies(eserver.address)
    seen: list[ElectionChange] = []
    with clients(eserver.address, token=token()).observe(ACCOUNT, name) as observer:

        def read() -> None:
            for change in observer:
                seen.append(change)
                if change.type == "ended":
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for("the current leader (none)", lambda: len(seen) >= 1)
        brief = clients(proxy.address, token=token()).campaign(
            ACCOUNT, name, value="brief", ttl=1, safety_margin=0.3
        )
        brief.__enter__()
        proxy.drop()
        reader.join(20)
        assert not reader.is_alive()
    assert [c.type for c in seen] == ["current", "elected", "ended"]
    assert seen[0].leader is None
    assert (seen[2].term, seen[2].how) == (brief.term, "expired")


async def test_e1_async_observe_yields_the_current_leader_then_every_change_in_order_across_an_instance_stopped_mid_watch(  # noqa: E501
    database_url: str,
    secret: str,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    one, two = lease_server(database_url, secret), lease_server(database_url, secret)
    try:
        name = election("aobserve")
        to_two = proxies(two.address)
        watcher = aclients([one.address, to_two.address], token=token())
        actor = aclients(two.address, token=token())
        first = actor.campaign(ACCOUNT, name, value="first", ttl=10)
        await first.__aenter__()
        seen: list[ElectionChange] = []
        observer = watcher.observe(ACCOUNT, name)

        async def read() -> None:
            async for change in observer:
                seen.append(change)

        reader = asyncio.ensure_future(read())

        async def count(n: int) -> None:
            await until(f"change number {n}", lambda: len(seen) >= n)

        await count(1)
        await first.proclaim("first-v2")
        await count(2)
        await first.resign()
        await count(3)
        to_two.drop()
        await asyncio.to_thread(one.stop)
        async with actor.campaign(ACCOUNT, name, value="second", ttl=10) as second:
            pass
        third = actor.campaign(ACCOUNT, name, value="third", ttl=10)
        await third.__aenter__()
        to_two.pass_()
        await count(6)
        await third.resign()
        await count(7)
        await observer.close()
        await asyncio.wait_for(reader, 10)
        assert changes_of(seen) == [
            ("current", first.term),
            ("proclaimed", first.term),
            ("ended", first.term),
            ("elected", second.term),
            ("ended", second.term),
            ("elected", third.term),
            ("ended", third.term),
        ]
        assert seen[1].leader is not None and seen[1].leader.value == "first-v2"
        assert seen[6].how == "resigned"
    finally:
        one.stop()
        two.stop()


async def test_e1_async_observe_sees_a_term_that_expires_with_no_successor_as_ended_expired(
    eserver: Server, token: Callable[..., str], aclients: AsyncClients, proxies: Proxies
) -> None:
    name = election("aobserve-expiry")
    proxy = proxies(eserver.address)
    seen: list[ElectionChange] = []

    async def read() -> None:
        async with aclients(eserver.address, token=token()).observe(ACCOUNT, name) as observer:
            async for change in observer:
                seen.append(change)
                if change.type == "ended":
                    return

    reader = asyncio.ensure_future(read())
    await until("the current leader (none)", lambda: len(seen) >= 1)
    brief = aclients(proxy.address, token=token()).campaign(
        ACCOUNT, name, value="brief", ttl=1, safety_margin=0.3
    )
    await brief.__aenter__()
    proxy.drop()
    await asyncio.wait_for(reader, 20)
    assert [c.type for c in seen] == ["current", "elected", "ended"]
    assert seen[0].leader is None
    assert (seen[2].term, seen[2].how) == (brief.term, "expired")


# Election: on_stopped_leading exactly once per term in every ending; the
# election helper campaigns again after a term, and after a lost waiting call

Calls = list[tuple[int, StopReason]]


def ended_by(
    client: LeaseClient, admin: LeaseClient, end: Callable[[Leadership], object], **options: float
) -> tuple[Calls, int, object]:
    """A term ended by ``end``; then resign and cancel, which must not call again."""
    name = election("stopped")
    calls: Calls = []
    started: list[int] = []
    leadership = client.campaign(
        ACCOUNT,
        name,
        value="me",
        ttl=options.get("ttl", 5),
        safety_margin=options.get("safety_margin"),
        on_started_leading=started.append,
        on_stopped_leading=lambda term, reason: calls.append((term, reason)),
    )
    leadership.__enter__()
    assert started == [leadership.term]
    end(leadership)
    assert leadership.ended.wait(20)
    leadership.resign()
    leadership.cancel()
    return calls, leadership.term, admin.leader(ACCOUNT, name)


def test_e1_stopped_leading_exactly_once_per_term_when_it_resigns(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    calls, term, left = ended_by(clients(eserver.address, token=token()), admin, Leadership.resign)
    assert left is None
    assert calls == [(term, StopReason("resigned"))]


def test_e1_stopped_leading_exactly_once_per_term_when_it_is_revoked(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    calls, term, _ = ended_by(
        clients(eserver.address, token=token()),
        admin,
        lambda leadership: admin.revoke(leadership.key, reason="an operator ended it"),
    )
    assert [(t, r.kind) for t, r in calls] == [(term, "lost")]
    cause = calls[0][1].cause
    assert isinstance(cause, LeaseLostError) and cause.loss_reason == "revoked"


def test_e1_stopped_leading_exactly_once_per_term_when_its_caller_cancels_and_the_lease_is_released(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    calls, term, left = ended_by(clients(eserver.address, token=token()), admin, Leadership.cancel)
    assert left is None
    assert [(t, r.kind) for t, r in calls] == [(term, "cancelled")]


def test_e1_l2_stopped_leading_exactly_once_per_term_when_its_stream_stalls_past_the_local_deadline(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    proxy = proxies(eserver.address)
    calls, term, _ = ended_by(
        clients(proxy.address, token=token()),
        admin,
        lambda leadership: proxy.stall(),
        ttl=1.5,
        safety_margin=0.5,
    )
    proxy.pass_()
    assert [(t, r.kind) for t, r in calls] == [(term, "lost")]
    cause = calls[0][1].cause
    assert isinstance(cause, LeaseLostError) and cause.loss_reason == "deadline"


def test_e1_run_election_runs_lead_per_term_calls_the_callbacks_once_per_term_and_campaigns_again(
    eserver: Server, token: Callable[..., str], clients: Clients
) -> None:
    """E1: run_election leads, resigns when lead returns, and campaigns
    again, until ``stop``; on_new_leader hears of this candidate's terms."""
    name = election("run")
    client = clients(eserver.address, token=token())
    stop = threading.Event()
    started: list[int] = []
    stopped: list[int] = []
    leaders: list[int] = []
    terms: list[int] = []

    def lead(leadership: Leadership) -> None:
        assert not leadership.ended.is_set()
        terms.append(leadership.term)
        if len(terms) == 2:
            stop.set()

    client.run_election(
        ACCOUNT,
        name,
        lead,
        value="me",
        ttl=5,
        on_started_leading=started.append,
        on_stopped_leading=lambda term, reason: stopped.append(term),
        on_new_leader=lambda leader: leaders.append(leader.term),
        stop=stop,
    )
    assert terms == started and len(terms) == 2
    assert stopped == started
    assert started[0] < started[1]
    assert client.leader(ACCOUNT, name) is None
    assert set(leaders) <= set(started)


def test_e1_run_election_starts_a_campaign_again_after_its_waiting_call_is_lost(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: the waiting call's connection is reset, and refused for a while;
    run_election campaigns again, and leads once the leader resigns."""
    name = election("run-retry")
    holder = clients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="holder", ttl=LONG
    )
    holder.__enter__()
    proxy = proxies(eserver.address)
    led: list[int] = []
    running = pool.submit(
        clients(proxy.address, token=token()).run_election,
        ACCOUNT,
        name,
        lambda leadership: led.append(leadership.term),
        value="patient",
        ttl=LONG,
        again=False,
    )
    wait_for("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    proxy.drop()
    accepted = proxy.accepted
    wait_for("the campaign started again (refused)", lambda: proxy.accepted > accepted)
    proxy.pass_()
    wait_for("the candidate waiting again", lambda: waiting(eserver, name) >= 2)
    holder.resign()
    running.result(timeout=20)
    assert len(led) == 1 and led[0] > holder.term
    assert grants(admin, name) == ["holder", "patient"]
    assert admin.leader(ACCOUNT, name) is None


def test_e1_run_election_calls_on_new_leader_after_the_servers_were_out_of_reach_at_start(
    eserver: Server,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    """E1: run_election started while no instance answers still calls
    on_new_leader once one does: its observer keeps trying, as after a
    reconnect, rather than ending with its first failed call."""
    name = election("run-early")
    proxy = proxies(eserver.address)
    proxy.drop()
    leaders: list[int] = []
    led: list[int] = []

    def admit() -> None:
        # The campaign has been refused twice (and the observer's first
        # calls with it); then the instance is in reach again.
        wait_for("two refused connections", lambda: proxy.accepted >= 2)
        proxy.pass_()

    def lead(leadership: Leadership) -> None:
        led.append(leadership.term)
        wait_for("on_new_leader with this term", lambda: leadership.term in leaders, timeout=10)

    admitting = threading.Thread(target=admit)
    admitting.start()
    clients(proxy.address, token=token()).run_election(
        ACCOUNT,
        name,
        lead,
        on_new_leader=lambda leader: leaders.append(leader.term),
        value="started-early",
        ttl=5,
        again=False,
    )
    admitting.join()
    assert len(led) == 1


async def ended_by_async(
    client: AsyncLeaseClient,
    admin: LeaseClient,
    end: Callable[[AsyncLeadership, asyncio.Task[None]], object],
    **options: float,
) -> tuple[Calls, int, object]:
    """A term held by a task, ended by ``end`` (given the task); then resign
    and cancel, which must not call again."""
    name = election("astopped")
    calls: Calls = []
    started: list[int] = []
    leadership = client.campaign(
        ACCOUNT,
        name,
        value="me",
        ttl=options.get("ttl", 5),
        safety_margin=options.get("safety_margin"),
        on_started_leading=started.append,
        on_stopped_leading=lambda term, reason: calls.append((term, reason)),
    )
    leading = asyncio.Event()

    async def lead() -> None:
        async with leadership:
            leading.set()
            await leadership.ended.wait()

    task = asyncio.ensure_future(lead())
    await asyncio.wait_for(leading.wait(), 20)
    assert started == [leadership.term]
    outcome = end(leadership, task)
    if asyncio.iscoroutine(outcome):
        await outcome
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 20)
    await leadership.resign()
    await leadership.cancel()
    return calls, leadership.term, admin.leader(ACCOUNT, name)


async def test_e1_async_stopped_leading_exactly_once_per_term_when_it_resigns(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    calls, term, left = await ended_by_async(
        aclients(eserver.address, token=token()),
        admin,
        lambda leadership, task: leadership.resign(),
    )
    assert left is None
    assert calls == [(term, StopReason("resigned"))]


async def test_e1_async_stopped_leading_exactly_once_per_term_when_it_is_revoked(
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    calls, term, _ = await ended_by_async(
        aclients(eserver.address, token=token()),
        admin,
        lambda leadership, task: admin.revoke(leadership.key, reason="an operator ended it"),
    )
    assert [(t, r.kind) for t, r in calls] == [(term, "lost")]
    cause = calls[0][1].cause
    assert isinstance(cause, LeaseLostError) and cause.loss_reason == "revoked"


async def test_e1_async_stopped_leading_exactly_once_per_term_when_its_task_is_cancelled_and_the_lease_is_released(  # noqa: E501
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    calls, term, left = await ended_by_async(
        aclients(eserver.address, token=token()), admin, lambda leadership, task: task.cancel()
    )
    assert left is None
    assert [(t, r.kind) for t, r in calls] == [(term, "cancelled")]


async def test_e1_l2_async_stopped_leading_exactly_once_per_term_when_its_stream_stalls_past_the_local_deadline(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    proxy = proxies(eserver.address)
    calls, term, _ = await ended_by_async(
        aclients(proxy.address, token=token()),
        admin,
        lambda leadership, task: proxy.stall(),
        ttl=1.5,
        safety_margin=0.5,
    )
    proxy.pass_()
    assert [(t, r.kind) for t, r in calls] == [(term, "lost")]
    cause = calls[0][1].cause
    assert isinstance(cause, LeaseLostError) and cause.loss_reason == "deadline"


async def test_e1_async_run_election_runs_lead_per_term_calls_the_callbacks_once_per_term_and_campaigns_again(  # noqa: E501
    eserver: Server, token: Callable[..., str], aclients: AsyncClients
) -> None:
    name = election("arun")
    client = aclients(eserver.address, token=token())
    stop = asyncio.Event()
    started: list[int] = []
    stopped: list[int] = []
    leaders: list[int] = []
    terms: list[int] = []

    async def lead(leadership: AsyncLeadership) -> None:
        assert not leadership.ended.is_set()
        terms.append(leadership.term)
        if len(terms) == 2:
            stop.set()

    await asyncio.wait_for(
        client.run_election(
            ACCOUNT,
            name,
            lead,
            value="me",
            ttl=5,
            on_started_leading=started.append,
            on_stopped_leading=lambda term, reason: stopped.append(term),
            on_new_leader=lambda leader: leaders.append(leader.term),
            stop=stop,
        ),
        30,
    )
    assert terms == started and len(terms) == 2
    assert stopped == started
    assert started[0] < started[1]
    assert await client.leader(ACCOUNT, name) is None
    assert set(leaders) <= set(started)


async def test_e1_async_run_election_starts_a_campaign_again_after_its_waiting_call_is_lost(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("arun-retry")
    holder = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="holder", ttl=LONG
    )
    await holder.__aenter__()
    proxy = proxies(eserver.address)
    led: list[int] = []

    async def lead(leadership: AsyncLeadership) -> None:
        led.append(leadership.term)

    running = asyncio.ensure_future(
        aclients(proxy.address, token=token()).run_election(
            ACCOUNT, name, lead, value="patient", ttl=LONG, again=False
        )
    )
    await until("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    proxy.drop()
    accepted = proxy.accepted
    await until("the campaign started again (refused)", lambda: proxy.accepted > accepted)
    proxy.pass_()
    await until("the candidate waiting again", lambda: waiting(eserver, name) >= 2)
    await holder.resign()
    await asyncio.wait_for(running, 20)
    assert len(led) == 1 and led[0] > holder.term
    assert grants(admin, name) == ["holder", "patient"]
    assert admin.leader(ACCOUNT, name) is None


async def test_e1_async_run_election_calls_on_new_leader_after_the_servers_were_out_of_reach_at_start(  # noqa: E501
    eserver: Server,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("arun-early")
    proxy = proxies(eserver.address)
    proxy.drop()
    leaders: list[int] = []
    led: list[int] = []

    async def admit() -> None:
        await until("two refused connections", lambda: proxy.accepted >= 2)
        proxy.pass_()

    async def lead(leadership: AsyncLeadership) -> None:
        led.append(leadership.term)
        await until("on_new_leader with this term", lambda: leadership.term in leaders, limit=10)

    admitting = asyncio.ensure_future(admit())
    await aclients(proxy.address, token=token()).run_election(
        ACCOUNT,
        name,
        lead,
        on_new_leader=lambda leader: leaders.append(leader.term),
        value="started-early",
        ttl=5,
        again=False,
    )
    await admitting
    assert len(led) == 1


async def test_e1_async_run_election_cancelled_as_its_grant_arrives_ends_the_term_once_and_releases_it(  # noqa: E501
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """E1: the task running run_election is cancelled in the instant its
    campaign's grant arrives (the client's KeepAlive stream opening for the
    grant is that instant): it raises asyncio.CancelledError, ``lead`` never
    runs, a term that began is ended once (``cancelled``) and its lease
    released: nobody leads once it has returned."""
    name = election("arun-cancel-granted")
    holder = aclients(eserver.address, token=token()).campaign(
        ACCOUNT, name, value="holder", ttl=LONG
    )
    await holder.__aenter__()
    loop = asyncio.get_running_loop()
    running: list[asyncio.Future[None]] = []

    def cancel_as_granted(event: KeepAliveEvent) -> None:
        if event.type == "open":
            loop.call_soon(running[0].cancel)

    client = aclients(eserver.address, token=token(), on_event=cancel_as_granted)
    started: list[int] = []
    stopped: list[tuple[int, str]] = []
    led: list[int] = []

    async def lead(leadership: AsyncLeadership) -> None:
        led.append(leadership.term)

    running.append(
        asyncio.ensure_future(
            client.run_election(
                ACCOUNT,
                name,
                lead,
                value="waiter",
                ttl=LONG,
                on_started_leading=started.append,
                on_stopped_leading=lambda term, reason: stopped.append((term, reason.kind)),
            )
        )
    )
    await until("the candidate waiting", lambda: waiting(eserver, name) >= 1)
    await holder.resign()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running[0], 20)
    assert led == []
    assert stopped == [(term, "cancelled") for term in started]
    assert admin.leader(ACCOUNT, name) is None


# Election on a keeper: the leader's lease is on the keeper and proclaim keeps
# the term there; the keeper's stall ends the term once; a waiting candidate
# whose keeper is lost (cut or stalled) aborts and leaves nothing behind


def test_e1_k1_the_leaders_lease_is_on_the_keeper_proclaim_keeps_the_term_there_and_the_keepers_stall_ends_the_term_once(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
) -> None:
    name = election("keeper-leader")
    proxy = proxies(eserver.address)
    client = clients(proxy.address, token=token())
    calls: Calls = []
    with client.keeper(ACCOUNT, ttl=2) as k:
        leadership = client.campaign(
            ACCOUNT,
            name,
            value="on-keeper",
            keeper=k,
            on_stopped_leading=lambda term, reason: calls.append((term, reason)),
        )
        leadership.__enter__()
        state = admin.get(leadership.key)
        assert state.lease is not None and state.lease.keeper_id == k.keeper_id
        leadership.proclaim("on-keeper-2")
        now = admin.leader(ACCOUNT, name)
        assert now is not None and (now.value, now.term) == ("on-keeper-2", leadership.term)
        proxy.stall()
        assert leadership.ended.wait(20)
        assert k.lost.is_set()
        leadership.resign()
    proxy.pass_()
    assert [(t, r.kind) for t, r in calls] == [(leadership.term, "lost")]


def keeper_candidate_lost(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
    name: str,
    *,
    stalled_until: str | None = None,
) -> None:
    """A candidate waits on a keeper whose every route is then dropped (reset
    and refused) or, given the database's URL in ``stalled_until``, stalled
    (the server sees nothing, and the test waits on the database clock until
    the keeper's deadline has passed). The keeper is lost at its local
    deadline and the campaign raises LeaseLostError; nothing is left that
    can be granted."""
    direct = clients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    holder.__enter__()
    proxy = proxies(eserver.address)
    client = clients(proxy.address, token=token())
    with client.keeper(ACCOUNT, ttl=1.5) as k:
        campaigning = pool.submit(client.campaign(ACCOUNT, name, value="lost", keeper=k).__enter__)
        wait_for("the candidate waiting on its keeper", lambda: waiting(eserver, name) >= 1)
        if stalled_until is None:
            proxy.drop()
        else:
            proxy.stall()
        with pytest.raises(LeaseLostError):
            campaigning.result(timeout=20)
        if stalled_until is not None:
            sleep_until_keeper_expired(stalled_until, k.keeper_id)
    next_candidate_leads_at_once(eserver, admin, direct, pool, name, holder)
    proxy.pass_()


def test_e1_a_waiting_candidate_whose_keeper_is_lost_aborts_and_leaves_no_candidate_behind(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: the keeper's connections are reset and refused; the server
    dropped the waiter with the Keep stream."""
    name = election("keeper-waiter")
    keeper_candidate_lost(eserver, admin, token, clients, proxies, pool, name)


def test_e1_k1_a_waiting_candidate_whose_keeper_stalls_aborts_and_the_server_refuses_its_stale_waiter_once_the_keeper_expired(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    database_url: str,
    token: Callable[..., str],
    clients: Clients,
    proxies: Proxies,
    pool: ThreadPoolExecutor,
) -> None:
    """E1, K1: the keeper's stream stalls: the waiter stays queued on the
    server until the keeper's deadline passes on the database clock, and is
    never granted after it: the next candidate leads the moment the leader
    resigns."""
    name = election("keeper-waiter-stall")
    keeper_candidate_lost(
        eserver, admin, token, clients, proxies, pool, name, stalled_until=database_url
    )


def test_e1_a_campaign_on_a_keeper_cancelled_while_waiting_leaves_no_waiter_and_the_keeper_goes_on(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    clients: Clients,
    pool: ThreadPoolExecutor,
) -> None:
    """E1: cancel() ends a campaign waiting on a keeper with CanceledError;
    the keeper releases its run on the stream, so the server gives the
    waiting Acquire up at once (not when its 60 s wait runs out): a third
    candidate leads the moment the leader resigns, and the cancelled run was
    never granted. The keeper goes on, and holds another lease."""
    name = election("keeper-cancel")
    direct = clients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    holder.__enter__()
    client = clients(eserver.address, token=token())
    with client.keeper(ACCOUNT, ttl=30) as k:
        waiter = client.campaign(ACCOUNT, name, value="cancelled", keeper=k)
        campaigning = pool.submit(waiter.__enter__)
        wait_for("the candidate waiting on its keeper", lambda: waiting(eserver, name) >= 1)
        waiter.cancel()
        with pytest.raises(CanceledError):
            campaigning.result(timeout=20)
        assert waiter.stop_reason is None
        next_candidate_leads_at_once(eserver, admin, direct, pool, name, holder)
        assert not k.lost.is_set()
        with k.hold(SessionKey(ACCOUNT, fresh_session("keeper-cancel-other"))) as other:
            assert other.fencing_token > 0


async def test_e1_k1_async_the_leaders_lease_is_on_the_keeper_proclaim_keeps_the_term_there_and_the_keepers_stall_ends_the_term_once(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("akeeper-leader")
    proxy = proxies(eserver.address)
    client = aclients(proxy.address, token=token())
    calls: Calls = []
    async with client.keeper(ACCOUNT, ttl=2) as k:
        leadership = client.campaign(
            ACCOUNT,
            name,
            value="on-keeper",
            keeper=k,
            on_stopped_leading=lambda term, reason: calls.append((term, reason)),
        )
        await leadership.__aenter__()
        state = admin.get(leadership.key)
        assert state.lease is not None and state.lease.keeper_id == k.keeper_id
        await leadership.proclaim("on-keeper-2")
        now = admin.leader(ACCOUNT, name)
        assert now is not None and (now.value, now.term) == ("on-keeper-2", leadership.term)
        proxy.stall()
        await asyncio.wait_for(leadership.ended.wait(), 20)
        assert k.lost.is_set()
        await leadership.resign()
    proxy.pass_()
    assert [(t, r.kind) for t, r in calls] == [(leadership.term, "lost")]


async def keeper_candidate_lost_async(
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
    name: str,
    *,
    stalled_until: str | None = None,
) -> None:
    """``keeper_candidate_lost`` with the asyncio client."""
    direct = aclients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    await holder.__aenter__()
    proxy = proxies(eserver.address)
    client = aclients(proxy.address, token=token())
    async with client.keeper(ACCOUNT, ttl=1.5) as k:
        campaigning = asyncio.ensure_future(
            client.campaign(ACCOUNT, name, value="lost", keeper=k).__aenter__()
        )
        await until("the candidate waiting on its keeper", lambda: waiting(eserver, name) >= 1)
        if stalled_until is None:
            proxy.drop()
        else:
            proxy.stall()
        with pytest.raises(LeaseLostError):
            await asyncio.wait_for(campaigning, 20)
        if stalled_until is not None:
            await asyncio.to_thread(sleep_until_keeper_expired, stalled_until, k.keeper_id)
    await next_candidate_leads_at_once_async(eserver, admin, direct, name, holder)
    proxy.pass_()


async def test_e1_async_a_campaign_on_a_keeper_cancelled_while_waiting_leaves_no_waiter_and_the_keeper_goes_on(  # noqa: E501
    eserver: Server, admin: LeaseClient, token: Callable[..., str], aclients: AsyncClients
) -> None:
    """E1: a campaign on a keeper whose task is cancelled while waiting
    (asyncio.CancelledError), and another ended by cancel() (CanceledError):
    each run is released on the keeper's stream, so neither waiter is left
    on the server, and the keeper goes on."""
    name = election("akeeper-cancel")
    direct = aclients(eserver.address, token=token())
    holder = direct.campaign(ACCOUNT, name, value="holder", ttl=LONG)
    await holder.__aenter__()
    client = aclients(eserver.address, token=token())
    async with client.keeper(ACCOUNT, ttl=30) as k:
        waiter = client.campaign(ACCOUNT, name, value="cancelled", keeper=k)
        campaigning = asyncio.ensure_future(waiter.__aenter__())
        await until("the candidate waiting on its keeper", lambda: waiting(eserver, name) >= 1)
        campaigning.cancel()
        with pytest.raises(asyncio.CancelledError):
            await campaigning
        other = client.campaign(ACCOUNT, name, value="cancelled-too", keeper=k)
        campaigning = asyncio.ensure_future(other.__aenter__())
        await until("the other candidate waiting", lambda: waiting(eserver, name) >= 2)
        await other.cancel()
        with pytest.raises(CanceledError):
            await campaigning
        assert waiter.stop_reason is None and other.stop_reason is None
        await next_candidate_leads_at_once_async(eserver, admin, direct, name, holder)
        assert not k.lost.is_set()
        async with k.hold(SessionKey(ACCOUNT, fresh_session("akeeper-cancel-other"))) as held:
            assert held.fencing_token > 0


async def test_e1_async_a_waiting_candidate_whose_keeper_is_lost_aborts_and_leaves_no_candidate_behind(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("akeeper-waiter")
    await keeper_candidate_lost_async(eserver, admin, token, aclients, proxies, name)


async def test_e1_k1_async_a_waiting_candidate_whose_keeper_stalls_aborts_and_the_server_refuses_its_stale_waiter_once_the_keeper_expired(  # noqa: E501
    eserver: Server,
    admin: LeaseClient,
    database_url: str,
    token: Callable[..., str],
    aclients: AsyncClients,
    proxies: Proxies,
) -> None:
    name = election("akeeper-waiter-stall")
    await keeper_candidate_lost_async(
        eserver, admin, token, aclients, proxies, name, stalled_until=database_url
    )


def test_a_campaign_refuses_bad_settings_naming_them(
    eserver: Server, token: Callable[..., str], clients: Clients
) -> None:
    """Bad input is refused before any call, naming the field and the rule."""
    client = clients(eserver.address, token=token())
    with pytest.raises(ValueError, match="wait_chunk must be a positive duration"):
        client.campaign(ACCOUNT, "e", value="v", wait_chunk=0)
    with pytest.raises(ValueError, match="timeout must be at least 0"):
        client.campaign(ACCOUNT, "e", value="v", timeout=-1)
    with client.keeper(ACCOUNT, ttl=5) as k:
        with pytest.raises(ValueError, match="leave them out"):
            client.campaign(ACCOUNT, "e", value="v", keeper=k, ttl=5)
        with pytest.raises(ValueError, match="keeper is of account"):
            client.campaign("another", "e", value="v", keeper=k)
