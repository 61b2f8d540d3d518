"""CPU of the Python client per renewal and per acquire→release cycle.

Measured, not asserted (docs/clients.md, "Cost"). Against a running lease
server (development mode, or LEASEHOLD_TOKEN): ``--leases`` holds renewed
every ``--interval`` seconds on the client's one KeepAlive stream for
``--seconds``, then ``--cycles`` sequential hold() enter/exit (Acquire, the
lease registered on the stream, Release). CPU is this process's user +
system time, all threads (resource.getrusage); renewals are counted by the
server (``leasehold_lease_renewals_total`` on its /metrics), so nothing is
inferred from timers. bench/client-cpu.ts measures the TypeScript client
the same way. One JSON line on stdout.

    clients/python/.venv/bin/python clients/python/bench/client_cpu.py --server 127.0.0.1:7070
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import time
import urllib.request
import uuid

import leasehold


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def renewals(server: str) -> int:
    body = urllib.request.urlopen(f"http://{server}/metrics", timeout=10).read().decode()
    m = re.search(r"^leasehold_lease_renewals_total (\d+)", body, re.M)
    return int(m.group(1)) if m else 0


def key(label: str) -> leasehold.SessionKey:
    return leasehold.SessionKey("bench-py", f"{label}-{uuid.uuid4().hex[:12]}")


def blocking(args: argparse.Namespace) -> dict[str, float]:
    client = leasehold.LeaseClient(args.server, token=os.environ.get("LEASEHOLD_TOKEN") or None)
    holds = [
        client.hold(key("renew"), ttl=args.ttl, renew_interval=args.interval)
        for _ in range(args.leases)
    ]
    for h in holds:
        h.__enter__()
    time.sleep(args.interval * 2)  # every lease on the stream, renewals steady
    n0, c0 = renewals(args.server), cpu()
    time.sleep(args.seconds)
    n1, c1 = renewals(args.server), cpu()
    for h in holds:
        h.__exit__(None, None, None)
    assert not any(h.lost.is_set() for h in holds)
    c2 = cpu()
    for _ in range(args.cycles):
        with client.hold(key("cycle"), ttl=args.ttl):
            pass
    c3 = cpu()
    client.close()
    return {
        "renewals_per_s": (n1 - n0) / args.seconds,
        "cpu_us_per_renewal": (c1 - c0) / max(1, n1 - n0) * 1e6,
        "cpu_us_per_cycle": (c3 - c2) / args.cycles * 1e6,
    }


async def asynchronous(args: argparse.Namespace) -> dict[str, float]:
    client = leasehold.AsyncLeaseClient(
        args.server, token=os.environ.get("LEASEHOLD_TOKEN") or None
    )
    holds = [
        client.hold(key("arenew"), ttl=args.ttl, renew_interval=args.interval)
        for _ in range(args.leases)
    ]
    for h in holds:
        await h.__aenter__()
    await asyncio.sleep(args.interval * 2)
    n0, c0 = renewals(args.server), cpu()
    await asyncio.sleep(args.seconds)
    n1, c1 = renewals(args.server), cpu()
    for h in holds:
        await h.__aexit__(None, None, None)
    assert not any(h.lost.is_set() for h in holds)
    c2 = cpu()
    for _ in range(args.cycles):
        async with client.hold(key("acycle"), ttl=args.ttl):
            pass
    c3 = cpu()
    await client.close()
    return {
        "renewals_per_s": (n1 - n0) / args.seconds,
        "cpu_us_per_renewal": (c1 - c0) / max(1, n1 - n0) * 1e6,
        "cpu_us_per_cycle": (c3 - c2) / args.cycles * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="127.0.0.1:7070")
    p.add_argument("--leases", type=int, default=500)
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--client", choices=["blocking", "async"], default="blocking")
    args = p.parse_args()
    result = blocking(args) if args.client == "blocking" else asyncio.run(asynchronous(args))
    print(
        json.dumps(
            {"client": f"python-{args.client}", **{k: round(v, 1) for k, v in result.items()}}
        )
    )


if __name__ == "__main__":
    main()
