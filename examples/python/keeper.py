#!/usr/bin/env python3
"""Many sessions, one heartbeat: a Python worker on a Leasehold keeper.

It opens one keeper (``client.keeper``: one Keep stream, a heartbeat every
third of its TTL), holds a lease on it for each session given (``k.hold``),
and works on them until ``--seconds`` have passed or the keeper is lost.
Losing the keeper (expired, revoked, its local deadline passed) ends every
lease at once; a revoke of one lease ends only that one. Leaving the
keeper's block closes it, releasing every lease still held. One JSON object
per line on stdout.

    pip install ./clients/python          # or: bash clients/python/scripts/setup.sh
    python examples/python/keeper.py --account acme --sessions s1,s2,s3 --seconds 30

Bearer token: LEASEHOLD_TOKEN (unset: a server in development mode).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

import leasehold

EXIT_FINISHED, EXIT_LOST, EXIT_HELD_ELSEWHERE = 0, 3, 75


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "lang": "python", **fields}), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Hold several sessions on one keeper.")
    p.add_argument("--server", default="127.0.0.1:7070", help="lease server(s), host:port[,…]")
    p.add_argument("--account", required=True)
    p.add_argument("--sessions", required=True, help="session ids, comma-separated")
    p.add_argument("--holder", default="python-keeper")
    p.add_argument("--ttl-ms", type=int, default=10_000, help="the keeper's TTL")
    p.add_argument("--lock-delay-ms", type=int, default=0,
                   help="after the keeper expires, its keys wait this long")
    p.add_argument("--wait-ms", type=int, default=0, help="wait for a session held elsewhere")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to work")
    args = p.parse_args(argv)
    client = leasehold.LeaseClient(args.server, token=os.environ.get("LEASEHOLD_TOKEN") or None)
    code = EXIT_FINISHED
    with client, client.keeper(args.account, ttl=args.ttl_ms / 1000,
                               lock_delay=args.lock_delay_ms / 1000, holder=args.holder) as k:
        emit("keeper_opened", keeper_id=k.keeper_id,
             deadline_in_ms=round(k.remaining().total_seconds() * 1000))
        with contextlib.ExitStack() as held:
            holds: list[leasehold.KeeperHold] = []
            for session in args.sessions.split(","):
                key = leasehold.SessionKey(account_id=args.account, session_id=session.strip())
                try:
                    h = held.enter_context(k.hold(key, wait=args.wait_ms / 1000 or None))
                except leasehold.NotAcquiredError as e:
                    # Held by another run, or in an expired keeper's lock-delay.
                    until = e.lock_delay_until.isoformat() if e.lock_delay_until else None
                    emit("not_acquired", session=key.session_id, holder=e.holder,
                         lock_delay_until=until)
                    code = EXIT_HELD_ELSEWHERE
                    continue
                holds.append(h)
                emit("acquired", session=key.session_id, token=str(h.fencing_token))
            stop_at = time.monotonic() + args.seconds
            while holds and time.monotonic() < stop_at:
                # One step of work per session still held; a lost one stops
                # (its writes would carry h.fencing_metadata(), which raises).
                for h in list(holds):
                    if h.lost.is_set():
                        emit("lost", session=h.key.session_id, reason=h.loss_reason)
                        holds.remove(h)
                if k.lost.wait(0.2):
                    emit("keeper_lost", reason=k.loss_reason)
                    return EXIT_LOST
            emit("heartbeats", sent=k.heartbeats)
    emit("closed")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
