"""The README's guarded-store example, run as written, against the test's
lease server and guarded store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

import leasehold
from leasehold import guarded
from support import Server

README = Path(__file__).resolve().parents[1] / "README.md"


def guarded_store_example() -> str:
    section = README.read_text().split("## Writing to the guarded store", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "the README's guarded-store section has no Python example"
    return found.group(1)


def test_s7_the_readmes_guarded_store_example_runs_as_written_and_a_stale_token_is_refused(
    server: Server, store: Server, token: Callable[..., str]
) -> None:
    """S7: the example holds acme/s1 and writes with its token; a write with
    an older token afterwards is ABORTED, which the public from_rpc_error
    maps to StaleFencingTokenError with both tokens."""
    bearer = token("acme")
    env = {
        **os.environ,
        "LEASEHOLD_SERVER": server.address,
        "LEASEHOLD_STORE": store.address,
        "LEASEHOLD_TOKEN": bearer,
    }
    ran = subprocess.run(
        [sys.executable, "-c", guarded_store_example()],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    written = re.search(r"written with token (\d+); highest seen (\d+)", ran.stdout)
    assert written is not None, ran.stdout
    assert written.group(1) == written.group(2)

    stale = int(written.group(1)) - 1
    key = leasehold.SessionKey("acme", "s1")
    with grpc.insecure_channel(store.address) as channel:
        stub = guarded.GuardedStoreServiceStub(channel)
        request = guarded.PutRequest(
            key=key.to_proto(), name="transcript", value=b"late", fencing_token=stale
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.Put(request, metadata=(("authorization", f"Bearer {bearer}"),), timeout=10)
    error = leasehold.from_rpc_error(refused.value)
    assert isinstance(error, leasehold.StaleFencingTokenError)
    assert (error.presented, error.highest) == (stale, int(written.group(1)))
