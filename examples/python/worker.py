#!/usr/bin/env python3
"""A Leasehold worker in Python, built on the `leasehold` client library.

It holds one session's lease (``client.hold``: a client-chosen run id,
renewals on the client's KeepAlive stream, a local deadline from each
renewal's send time), writes to the guarded store with its fencing token in
the message and in the fencing headers, and stops the moment ``lost`` is set
(DESIGN.md, L2). Each step is one JSON object per line on stdout, for people
and for test/polyglot/.

    pip install ./clients/python          # or: bash clients/python/scripts/setup.sh
    python examples/python/worker.py --account acme --session s1

See docs/polyglot.md for the flags, the events and the exit statuses.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any

import grpc

import leasehold
from leasehold import guarded

EXIT_FINISHED, EXIT_ERROR, EXIT_LOST, EXIT_HELD_ELSEWHERE = 0, 1, 3, 75
START = time.monotonic()


def ms(instant: float) -> float:
    return round((instant - START) * 1000, 1)


class Events:
    def __init__(self, holder: str, run_id: str) -> None:
        self.holder, self.run_id, self.lock = holder, run_id, threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "lang": "python", "holder": self.holder,
                  "run_id": self.run_id, "t_ms": ms(time.monotonic()), **fields}
        with self.lock:
            print(json.dumps(record), flush=True)


def lease_fields(lease: leasehold.Lease | None) -> dict[str, Any]:
    if lease is None:
        return {}
    return {"run_id": lease.run_id, "holder": lease.holder, "token": str(lease.fencing_token),
            "remaining_ms": round(lease.remaining.total_seconds() * 1000)}


def error_fields(error: leasehold.LeaseholdError) -> dict[str, Any]:
    return {"code": error.code.name, "message": error.message, "reason": error.reason,
            "domain": "leasehold.dev" if error.reason else None, "metadata": error.metadata}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Hold a session's lease and write through the fence; "
                                "one JSON event per line. Bearer token: LEASEHOLD_TOKEN.")
    p.add_argument("--server", default="127.0.0.1:7070", help="lease server(s), host:port[,…]")
    p.add_argument("--store", default="127.0.0.1:7071", help="guarded store, host:port")
    p.add_argument("--account", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--holder", default="python-worker")
    p.add_argument("--run-id", default=str(uuid.uuid4()))
    p.add_argument("--ttl-ms", type=int, default=10_000)
    p.add_argument("--margin-ms", type=int, help="safety margin (default TTL/10)")
    p.add_argument("--renew-ms", type=int, help="renewal interval (default (TTL − margin)/3)")
    p.add_argument("--wait-ms", type=int, default=0, help="when held elsewhere, wait this long")
    p.add_argument("--writes", type=int, default=0, help="writes before releasing (0: until stopped)")
    p.add_argument("--write-every-ms", type=int, default=200)
    p.add_argument("--document", default="transcript")
    p.add_argument("--release-timeout-ms", type=int, default=1_000,
                   help="deadline of every unary call, the final Release included")
    p.add_argument("--control", action="store_true",
                   help="read commands from stdin: go, late-write (after stopping), quit")
    args = p.parse_args(argv)
    events = Events(args.holder, args.run_id)
    key = leasehold.SessionKey(account_id=args.account, session_id=args.session)
    commands: queue.Queue[str] = queue.Queue()
    if args.control:
        def read() -> None:
            for line in sys.stdin:
                if line.strip():
                    commands.put(line.strip())
            commands.put("quit")
        threading.Thread(target=read, daemon=True).start()

    client = leasehold.LeaseClient(args.server, token=os.environ.get("LEASEHOLD_TOKEN") or None,
                                   timeout=args.release_timeout_ms / 1000)
    store = guarded.GuardedStoreServiceStub(grpc.insecure_channel(args.store))
    # The guarded store authenticates its callers as the lease server does.
    bearer = os.environ.get("LEASEHOLD_TOKEN")
    store_auth = [("authorization", f"Bearer {bearer}")] if bearer else []
    hold_options = dict(ttl=args.ttl_ms / 1000, holder=args.holder, run_id=args.run_id,
                        safety_margin=None if args.margin_ms is None else args.margin_ms / 1000,
                        renew_interval=None if args.renew_ms is None else args.renew_ms / 1000)

    def put(token: int, text: str, metadata: Any, timeout: float) -> guarded.PutResponse:
        request = guarded.PutRequest(key=key.to_proto(), name=args.document,
                                     value=text.encode(), fencing_token=token)
        try:
            return store.Put(  # type: ignore[no-any-return]
                request, timeout=timeout, metadata=[*metadata, *store_auth])
        except grpc.RpcError as e:
            raise leasehold.from_rpc_error(e) from e

    events.emit("ready", server=args.server, store=args.store)
    if args.control and commands.get() != "go":
        return EXIT_FINISHED

    def enter(wait_ms: int) -> leasehold.Hold | None:
        try:
            h = client.hold(key, wait=wait_ms / 1000 or None, **hold_options).__enter__()
        except leasehold.LateGrantError as e:
            events.emit("grant_too_late", elapsed_ms=round(e.elapsed_seconds * 1000))
            return None
        except leasehold.NotAcquiredError as e:
            events.emit("not_acquired", wait_ms=wait_ms, current=lease_fields(e.current))
            return None
        events.emit("acquired", wait_ms=wait_ms, confirmed=h.confirmed, **lease_fields(h.lease),
                    deadline_in_ms=round(h.remaining().total_seconds() * 1000, 1))
        return h

    h = enter(0) or (enter(args.wait_ms) if args.wait_ms else None)
    if h is None:
        client.close()
        return EXIT_HELD_ELSEWHERE
    h.on_handoff(lambda r: events.emit("handoff_requested", requester_holder=r.requester_holder,
                                       reason=r.reason))
    count, renewed_at, reason, detail = 0, h.lease.expires_at, "finished", {}
    with h:
        while True:
            if h.lease.expires_at != renewed_at:
                renewed_at = h.lease.expires_at
                events.emit("renewed", token=str(h.fencing_token))
            try:
                h.check()  # reads the clock: a passed local deadline stops here
            except leasehold.LeaseLostError as lost:
                reason = "deadline" if lost.loss_reason == "deadline" else "lost"
                detail = {"cause": f"LOSS_REASON_{lost.loss_reason.upper()}", "loss": lost.message}
                break
            if args.writes and count >= args.writes:
                break
            if h.handoff_requested.is_set():
                reason = "handoff"  # cooperative: the step in progress is done
                break
            count += 1
            started = time.monotonic()
            try:
                # The token in the message and in the headers; no longer than
                # the local deadline allows.
                answer = put(h.fencing_token, f"{args.holder}: write {count} with token "
                             f"{h.fencing_token}", h.fencing_metadata(),
                             max(0.001, h.remaining().total_seconds()))
                events.emit("wrote", n=count, token=str(h.fencing_token),
                            highest_token=str(answer.highest_token), started_ms=ms(started))
            except leasehold.LeaseholdError as e:
                events.emit("write_failed", n=count, started_ms=ms(started), **error_fields(e))
                if isinstance(e, leasehold.StaleFencingTokenError):
                    reason = "write_refused"
                    break
            h.lost.wait(args.write_every_ms / 1000)
        events.emit("stopped", reason=reason, writes=count, at_ms=ms(time.monotonic()), **detail)
    # Never released after loss: `released` is then false, and nothing was sent.
    events.emit("released", released=bool(h.released), sent=h.released is not None)
    code = EXIT_FINISHED if reason in ("finished", "handoff") else EXIT_LOST
    while args.control:
        command = commands.get()
        if command == "quit":
            break
        if command == "late-write":
            # What a paused run sends when it wakes: old token, no checks.
            metadata = [(leasehold.FENCING_TOKEN_HEADER, str(h.fencing_token)),
                        (leasehold.ACCOUNT_ID_HEADER, key.account_id),
                        (leasehold.SESSION_ID_HEADER, key.session_id)]
            try:
                answer = put(h.fencing_token, f"{args.holder}: late write", metadata, 10)
                events.emit("late_write_accepted", token=str(h.fencing_token),
                            highest_token=str(answer.highest_token))
            except leasehold.LeaseholdError as e:
                events.emit("late_write_refused", token=str(h.fencing_token), **error_fields(e))
    client.close()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
