"""The blocking and the asyncio client offer one API: every public name of
one is in the other, with the same parameters and a docstring in both, and
what does I/O in the blocking client is awaited in the asyncio one
(httpcore's ``unasync --check``, read with ``inspect``). No server needed."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from leasehold import (
    AsyncElectionObserver,
    AsyncHold,
    AsyncKeeper,
    AsyncKeeperHold,
    AsyncLeadership,
    AsyncLeaseClient,
    ElectionObserver,
    Hold,
    Keeper,
    KeeperHold,
    Leadership,
    LeaseClient,
    SessionKey,
)
from leasehold._client import rpc

#: A blocking name whose asyncio twin has another name.
TWINS = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
ADDRESS = "127.0.0.1:1"  # never dialled: nothing here sends a call


def public_names(cls: type[Any], instance: object) -> set[str]:
    """Public attributes of the class and of an instance, and its context manager methods."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    names |= {n for n in vars(instance) if not n.startswith("_")}
    return names | {n for n in (*TWINS, *TWINS.values()) if hasattr(cls, n)}


def parameters(member: Any) -> list[tuple[str, Any, Any]]:
    """Name, kind and default of each parameter (annotations name each client's own types)."""
    signature = inspect.signature(member)
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def is_async(member: Any) -> bool:
    return inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)


def pairs() -> list[tuple[str, type[Any], type[Any]]]:
    return [
        ("client", LeaseClient, AsyncLeaseClient),
        ("hold", Hold, AsyncHold),
        ("keeper", Keeper, AsyncKeeper),
        ("keeper hold", KeeperHold, AsyncKeeperHold),
        ("leadership", Leadership, AsyncLeadership),
        ("election observer", ElectionObserver, AsyncElectionObserver),
    ]


@pytest.fixture
def instances() -> dict[type[Any], object]:
    """One of each class, made without a call or an event loop."""
    client = LeaseClient(ADDRESS)
    aclient = AsyncLeaseClient(ADDRESS)
    keeper = client.keeper("acct", ttl=3)
    akeeper = aclient.keeper("acct", ttl=3)
    return {
        LeaseClient: client,
        AsyncLeaseClient: aclient,
        Hold: client.hold(SessionKey("acct", "parity")),
        AsyncHold: aclient.hold(SessionKey("acct", "parity")),
        Keeper: keeper,
        AsyncKeeper: akeeper,
        KeeperHold: keeper.hold(SessionKey("acct", "parity")),
        AsyncKeeperHold: akeeper.hold(SessionKey("acct", "parity")),
        Leadership: client.campaign("acct", "parity", value="v"),
        AsyncLeadership: aclient.campaign("acct", "parity", value="v"),
        ElectionObserver: client.observe("acct", "parity"),
        AsyncElectionObserver: aclient.observe("acct", "parity"),
    }


@pytest.mark.parametrize(("what", "blocking", "asyncio"), pairs())
def test_every_public_name_of_one_client_is_in_the_other(
    what: str, blocking: type[Any], asyncio: type[Any], instances: dict[type[Any], object]
) -> None:
    ours = {TWINS.get(n, n) for n in public_names(blocking, instances[blocking])}
    theirs = public_names(asyncio, instances[asyncio])
    assert sorted(ours - theirs) == [], f"in {blocking.__name__}, not in {asyncio.__name__}"
    assert sorted(theirs - ours) == [], f"in {asyncio.__name__}, not in {blocking.__name__}"


@pytest.mark.parametrize(("what", "blocking", "asyncio"), pairs())
def test_twins_take_the_same_parameters_and_both_say_what_they_do(
    what: str, blocking: type[Any], asyncio: type[Any], instances: dict[type[Any], object]
) -> None:
    assert (blocking.__doc__ or "").strip() and (asyncio.__doc__ or "").strip()
    for name in sorted(
        n for n in public_names(blocking, instances[blocking]) if hasattr(blocking, n)
    ):
        ours = getattr(blocking, name)
        theirs = getattr(asyncio, TWINS.get(name, name))
        if callable(ours) and not name.startswith("__"):
            assert parameters(ours) == parameters(theirs), name
        if not name.startswith("__"):
            assert (ours.__doc__ or "").strip(), f"{blocking.__name__}.{name} has no docstring"
            assert (theirs.__doc__ or "").strip(), f"{asyncio.__name__}.{name} has no docstring"


@pytest.mark.parametrize(("what", "blocking", "asyncio"), pairs())
def test_what_does_io_in_the_blocking_client_is_awaited_in_the_asyncio_one(
    what: str, blocking: type[Any], asyncio: type[Any], instances: dict[type[Any], object]
) -> None:
    ours, theirs = instances[blocking], instances[asyncio]
    for name in sorted(public_names(blocking, ours)):
        # Its own methods, and the RPCs of both (``rpc``); what the two
        # share from the base does no I/O.
        does_io = name in vars(blocking) or isinstance(inspect.getattr_static(ours, name), rpc)
        if does_io and callable(getattr(ours, name)):
            assert is_async(getattr(theirs, TWINS.get(name, name))), name
