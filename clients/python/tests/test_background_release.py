"""A hold's acquire that fails: released in the background only when it may
have been granted, and never heard of after ``close()`` (blocking and aio)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import pytest

from leasehold import (
    AsyncLeaseClient,
    InvalidArgumentError,
    LeaseClient,
    SessionKey,
    UnavailableError,
)
from support import Server, fresh_session

ACCOUNT = "acct-py"


def key(label: str) -> SessionKey:
    return SessionKey(ACCOUNT, fresh_session(label))


def dead_address() -> str:
    """An address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "leasehold"]


def test_an_acquire_refused_for_bad_input_sends_no_release_and_nothing_is_logged_after_close(
    server: Server, token: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """S5: a session id the server refuses, and a TTL over its maximum: the
    acquire granted nothing, so no release is sent for it (it could only
    fail, and was logged as failing after close(): "key.session_id may
    contain only …", "Channel closed!"). Every thread the client started is
    waited for before the log is read."""
    caplog.set_level(logging.WARNING, logger="leasehold")
    before = set(threading.enumerate())
    client = LeaseClient(server.address, token=token())
    with pytest.raises(InvalidArgumentError) as bad_key:
        client.hold(SessionKey(ACCOUNT, "a/b"), ttl=3).__enter__()
    assert bad_key.value.field == "key.session_id"
    with pytest.raises(InvalidArgumentError) as bad_ttl:
        client.hold(key("bad-ttl"), ttl=timedelta(hours=2)).__enter__()
    assert bad_ttl.value.field == "ttl"
    client.close()
    for thread in set(threading.enumerate()) - before:
        thread.join(10)
    assert logged(caplog) == []


def test_close_returns_after_the_background_release_of_a_lost_answer(
    token: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """S5: an acquire nobody answered may have been granted, so it is
    released in the background; close() waits for that release, whose
    failure is logged before close() returns, not after."""
    caplog.set_level(logging.WARNING, logger="leasehold")
    client = LeaseClient(dead_address(), token=token(), timeout=2)
    with pytest.raises(UnavailableError):
        client.hold(key("nobody"), ttl=3).__enter__()
    client.close()
    failures = logged(caplog)
    assert len(failures) == 1 and "release of" in failures[0], failures


async def test_aio_an_acquire_refused_for_bad_input_sends_no_release(
    server: Server, token: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """S5, asyncio: no release for an acquire refused for its input; close()
    waits for the client's background tasks, so the log is complete then."""
    caplog.set_level(logging.WARNING, logger="leasehold")
    client = AsyncLeaseClient(server.address, token=token())
    with pytest.raises(InvalidArgumentError):
        await client.hold(SessionKey(ACCOUNT, "a/b"), ttl=3).__aenter__()
    with pytest.raises(InvalidArgumentError):
        await client.hold(key("bad-ttl"), ttl=timedelta(hours=2)).__aenter__()
    assert not client._background
    await client.close()
    assert logged(caplog) == []


async def test_aio_close_returns_after_the_background_release_of_a_lost_answer(
    token: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """S5, asyncio: the background release of an unanswered acquire is done,
    its failure logged, before close() returns."""
    caplog.set_level(logging.WARNING, logger="leasehold")
    client = AsyncLeaseClient(dead_address(), token=token(), timeout=2)
    with pytest.raises(UnavailableError):
        await client.hold(key("nobody"), ttl=3).__aenter__()
    await client.close()
    failures = logged(caplog)
    assert len(failures) == 1 and "release of" in failures[0], failures
