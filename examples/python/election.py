#!/usr/bin/env python3
"""One replica of a service that must run on exactly one replica at a time
(a scheduler, a cron, a compactor), in Python: it campaigns in an election
(``client.run_election``), does the leader's work while it leads — every
write fenced with the term — and campaigns again when its term ends. Start
it three times and stop the leader (Ctrl-C, kill -STOP, a cut network):
another one takes over, with a higher term, only after the old one has
stopped acting. One JSON object per line on stdout.

    pip install ./clients/python          # or: bash clients/python/scripts/setup.sh
    python examples/python/election.py --account acme --election scheduler --name replica-1

Bearer token: LEASEHOLD_TOKEN (unset: a server in development mode).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

import leasehold

_emitting = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    # The callbacks run on the client's threads: one line at a time, whole.
    with _emitting:
        print(json.dumps({"event": event, "lang": "python", **fields}), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Campaign in an election; lead while elected.")
    p.add_argument("--server", default="127.0.0.1:7070", help="lease server(s), host:port[,…]")
    p.add_argument("--account", required=True)
    p.add_argument("--election", default="scheduler")
    p.add_argument("--name", default=f"replica-{os.getpid()}", help="the advertised value")
    p.add_argument("--ttl-ms", type=int, default=5_000, help="the leader's lease TTL")
    args = p.parse_args(argv)
    client = leasehold.LeaseClient(args.server, token=os.environ.get("LEASEHOLD_TOKEN") or None)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def lead(leadership: leasehold.Leadership) -> None:
        """The leader's work: until the term ends (lost, or stop set), never past it."""
        while not leadership.ended.is_set():
            try:
                # A write to a fenced resource carries the term in its
                # headers (fencing_metadata() for gRPC, fencing_headers()
                # for HTTP); both raise LeaseLostError once the term is over.
                metadata = dict(leadership.fencing_metadata())
            except leasehold.LeaseLostError:
                return
            emit("tick", term=int(metadata[leasehold.FENCING_TOKEN_HEADER]))
            leadership.ended.wait(1.0)

    with client:
        client.run_election(
            args.account,
            args.election,
            lead,
            value=args.name,
            ttl=args.ttl_ms / 1000,
            on_started_leading=lambda term: emit("leading", term=term),
            # Called exactly once per term, whatever ended it; before a
            # successor can be granted, unless an operator revoked the term
            # (fences refuse the old term then).
            on_stopped_leading=lambda term, reason: emit(
                "stopped_leading", term=term, reason=reason.kind
            ),
            on_new_leader=lambda leader: emit("leader", value=leader.value, term=leader.term),
            stop=stop,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
