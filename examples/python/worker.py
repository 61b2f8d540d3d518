#!/usr/bin/env python3
"""A Leasehold worker in Python, on Debian's grpcio.

It acquires one session's lease with its own run_id, keeps the lease alive
over one bidirectional KeepAlive stream, and writes documents to the guarded
store with its fencing token. It stops its work the moment the stream says
`lost`, or when its local deadline passes without a confirmed renewal
(DESIGN.md, L2). Everything it does is reported as one JSON object per line
on stdout, for people and for test/polyglot/.

Generate the stubs first (examples/python/generate.sh), then run it with
Debian's interpreter, which is the one that sees python3-grpcio:

    /usr/bin/python3 examples/python/worker.py --account acme --session s1

See docs/polyglot.md for the flags, the events and the exit statuses.
"""

import argparse
import collections
import json
import os
import queue
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "gen"))

try:
    import grpc
    from google.protobuf import duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    from leasehold.guarded.v1 import guarded_pb2, guarded_pb2_grpc
    from leasehold.v1 import lease_pb2, lease_pb2_grpc
except ImportError as missing:
    sys.exit(f"worker.py: {missing}. Generate the stubs with "
             "examples/python/generate.sh and run this file with Debian's "
             "/usr/bin/python3 (python3-grpcio).")

EXIT_FINISHED = 0
EXIT_ERROR = 1
EXIT_LOST = 3
EXIT_HELD_ELSEWHERE = 75  # as `leasehold run`: EX_TEMPFAIL, try later

FENCING_TOKEN_HEADER = "leasehold-fencing-token"
ACCOUNT_HEADER = "leasehold-account-id"
SESSION_HEADER = "leasehold-session-id"
STATUS_DETAILS_TRAILER = "grpc-status-details-bin"

# Stopping reasons after which the run ended as planned.
FINISHED_REASONS = ("finished", "handoff")


class Events:
    """Writes one JSON object per line on stdout, from any thread."""

    def __init__(self, holder):
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self.holder = holder
        self.run_id = ""

    def ms(self, instant):
        """A monotonic instant as milliseconds since this process started."""
        return round((instant - self._start) * 1000, 1)

    def emit(self, event, **fields):
        record = {
            "event": event,
            "lang": "python",
            "holder": self.holder,
            "run_id": self.run_id,
            "t_ms": self.ms(time.monotonic()),
        }
        record.update(fields)
        line = json.dumps(record)
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def duration(ms):
    value = duration_pb2.Duration()
    value.FromMilliseconds(int(ms))
    return value


def lease_fields(lease):
    return {
        "run_id": lease.run_id,
        "holder": lease.holder,
        # int64 as a string, as protobuf's JSON mapping writes it.
        "token": str(lease.fencing_token),
        "remaining_ms": lease.remaining.ToMilliseconds(),
    }


def error_info(error):
    """The google.rpc.ErrorInfo the server attached to a failed call.

    gRPC carries the full google.rpc.Status, serialized, in the
    grpc-status-details-bin trailer; its details are Any messages.
    """
    for key, value in error.trailing_metadata() or ():
        if key != STATUS_DETAILS_TRAILER:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    return None


def describe_error(error):
    """Code, message and ErrorInfo of a failed call, as event fields."""
    code = error.code()
    fields = {
        "code": code.name if code is not None else "UNKNOWN",
        "message": error.details() or "",
    }
    info = error_info(error)
    if info is not None:
        fields["reason"] = info.reason
        fields["domain"] = info.domain
        fields["metadata"] = dict(info.metadata)
    return fields


class Holding:
    """One grant of the session to this run, bounded by a local deadline.

    The deadline lives on the monotonic clock: when the request that
    confirmed the lease was sent, plus the lease's `remaining` (computed by
    the database), minus a safety margin. The server measured `remaining`
    after the request left, so counting it from the send time errs early,
    never late; neither a slow answer nor a wall-clock jump moves it later.
    """

    def __init__(self, events, lease, sent_at, margin):
        self.events = events
        self.key = lease.key
        self.run_id = lease.run_id
        self.token = lease.fencing_token
        self.handoff = threading.Event()
        self._margin = margin
        self._lock = threading.Lock()
        self._deadline = (sent_at + lease.remaining.ToMilliseconds() / 1000
                          - margin)
        self._stopped = threading.Event()
        self._stop_reason = None
        self._in_flight = None

    @property
    def stopped(self):
        return self._stopped.is_set()

    @property
    def stop_reason(self):
        return self._stop_reason

    def wait_stopped(self, timeout):
        return self._stopped.wait(timeout)

    def time_left(self):
        with self._lock:
            return self._deadline - time.monotonic()

    def confirm(self, sent_at, lease):
        """A renewal sent at `sent_at` succeeded: extend the deadline."""
        with self._lock:
            confirmed = (sent_at + lease.remaining.ToMilliseconds() / 1000
                         - self._margin)
            # Answers can only move the deadline later: an earlier request
            # answered late must not shorten what a later one confirmed.
            self._deadline = max(self._deadline, confirmed)
            return self._deadline - time.monotonic()

    def stop(self, reason, **detail):
        """Stops the work once; later calls change nothing."""
        with self._lock:
            if self._stopped.is_set():
                return False
            now = time.monotonic()
            self._stopped.set()
            self._stop_reason = reason
            if self._in_flight is not None:
                self._in_flight.cancel()
            self.events.emit("stopped", reason=reason,
                             at_ms=self.events.ms(now),
                             slack_ms=round((self._deadline - now) * 1000, 1),
                             **detail)
        return True

    def start_write(self, send):
        """Sends a write unless the run has stopped.

        The check and the send happen under the lock that stop() takes, so
        every write that went out began before the stop; stop() cancels
        the one in flight. Returns (future, started_ms) or None.
        """
        with self._lock:
            if self._stopped.is_set():
                return None
            now = time.monotonic()
            left = self._deadline - now
            if left <= 0:
                return None
            # A write must not outlive the lease as far as this run knows.
            self._in_flight = send(left)
            return self._in_flight, self.events.ms(now)

    def end_write(self):
        with self._lock:
            self._in_flight = None

    def watch(self):
        """Stops the run when the deadline passes (a thread of its own)."""
        while True:
            with self._lock:
                if self._stopped.is_set():
                    return
                left = self._deadline - time.monotonic()
            if left <= 0:
                self.stop("deadline")
                return
            # Woken early only by a stop; a later deadline is re-read.
            self._stopped.wait(left)


class KeepAlive:
    """One bidirectional KeepAlive stream that renews this run's lease."""

    def __init__(self, stub, holding, ttl_ms, renew_every, metadata):
        self._stub = stub
        self._holding = holding
        self._ttl_ms = ttl_ms
        self._renew_every = renew_every
        self._metadata = metadata
        self._requests = queue.Queue()
        # Send times of renewals not answered yet, oldest first: the server
        # answers one run's renewals in order.
        self._sent = collections.deque()
        self._lock = threading.Lock()
        self._call = None

    def start(self):
        self._call = self._stub.KeepAlive(self._request_stream(),
                                          metadata=self._metadata)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._renew, daemon=True).start()

    def close(self):
        self._requests.put(None)
        if self._call is not None:
            self._call.cancel()

    def _request_stream(self):
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _renew(self):
        # The first renewal goes out at once: the server watches a run for
        # `lost` and handoff requests only once the stream has named it.
        while not self._holding.stopped:
            with self._lock:
                self._sent.append(time.monotonic())
            self._requests.put(lease_pb2.KeepAliveRequest(
                key=self._holding.key,
                run_id=self._holding.run_id,
                ttl=duration(self._ttl_ms)))
            if self._holding.wait_stopped(self._renew_every):
                return

    def _read(self):
        holding = self._holding
        try:
            for response in self._call:
                if response.run_id != holding.run_id:
                    continue
                kind = response.WhichOneof("result")
                if kind == "lease":
                    with self._lock:
                        sent_at = self._sent.popleft() if self._sent else None
                    if sent_at is None:
                        continue
                    left = holding.confirm(sent_at, response.lease)
                    holding.events.emit(
                        "renewed",
                        token=str(response.lease.fencing_token),
                        remaining_ms=response.lease.remaining.ToMilliseconds(),
                        deadline_in_ms=round(left * 1000, 1))
                elif kind == "lost":
                    holding.stop("lost", cause=lease_pb2.LossReason.Name(
                        response.lost.reason))
                    return
                elif kind == "handoff_requested":
                    request = response.handoff_requested
                    holding.events.emit(
                        "handoff_requested",
                        requester_holder=request.requester_holder,
                        reason=request.reason)
                    holding.handoff.set()
            holding.stop("stream_ended")
        except grpc.RpcError as error:
            # Our own cancel after a stop ends the stream too: not news.
            if not holding.stopped:
                holding.stop("stream_failed", **describe_error(error))


class Worker:
    def __init__(self, args, events):
        self.args = args
        self.events = events
        self.key = lease_pb2.SessionKey(account_id=args.account,
                                        session_id=args.session)
        bearer = os.environ.get("LEASEHOLD_TOKEN")
        self.auth = (("authorization", f"Bearer {bearer}"),) if bearer else ()
        self.lease_channel = grpc.insecure_channel(args.server)
        self.store_channel = grpc.insecure_channel(args.store)
        self.leases = lease_pb2_grpc.LeaseServiceStub(self.lease_channel)
        self.store = guarded_pb2_grpc.GuardedStoreServiceStub(
            self.store_channel)
        self.commands = queue.Queue()

    def connect(self, timeout):
        grpc.channel_ready_future(self.lease_channel).result(timeout=timeout)
        grpc.channel_ready_future(self.store_channel).result(timeout=timeout)

    def read_commands(self):
        for line in sys.stdin:
            if line.strip():
                self.commands.put(line.strip())
        self.commands.put("quit")

    def ask(self, wait_ms):
        """One Acquire with this run's id; returns (sent_at, response)."""
        args = self.args
        request = lease_pb2.AcquireRequest(
            key=self.key, run_id=args.run_id, ttl=duration(args.ttl_ms),
            holder=args.holder)
        if wait_ms:
            request.wait.CopyFrom(duration(wait_ms))
        sent_at = time.monotonic()
        response = self.leases.Acquire(
            request, timeout=(wait_ms + 10_000) / 1000, metadata=self.auth)
        if not response.acquired:
            self.events.emit("not_acquired", wait_ms=wait_ms,
                             current=lease_fields(response.current))
        return sent_at, response

    def acquire(self, wait_ms):
        args = self.args
        margin = args.margin_ms / 1000
        sent_at, response = self.ask(wait_ms)
        if not response.acquired:
            return None
        holding = Holding(self.events, response.lease, sent_at, margin)
        confirmed = False
        if holding.time_left() <= 0 and wait_ms:
            # A waited grant is late by construction when the wait outlasted
            # the window: the server granted it some time after the request
            # left. The same run_id asks again without waiting (idempotent:
            # the same token), and the deadline counts from that request.
            sent_at, response = self.ask(0)
            if not response.acquired:
                return None
            holding = Holding(self.events, response.lease, sent_at, margin)
            confirmed = True
        left = holding.time_left()
        if left <= 0:
            # The answer came after the local deadline it grants: this run
            # cannot vouch for the lease, so it gives the grant back.
            self.events.emit("grant_too_late", token=str(holding.token),
                             late_ms=round(-left * 1000, 1))
            self.release(holding)
            return None
        remaining_ms = response.lease.remaining.ToMilliseconds()
        self.events.emit("acquired", wait_ms=wait_ms, confirmed=confirmed,
                         token=str(holding.token), remaining_ms=remaining_ms,
                         ttl_ms=args.ttl_ms, margin_ms=args.margin_ms,
                         deadline_in_ms=round(left * 1000, 1))
        return holding

    def fence_metadata(self, token):
        """The three headers a fenced service reads (docs/fencing.md), and
        the bearer token: the guarded store authenticates as the lease
        server does."""
        return self.auth + (
            (FENCING_TOKEN_HEADER, str(token)),
            (ACCOUNT_HEADER, self.key.account_id),
            (SESSION_HEADER, self.key.session_id),
        )

    def put_request(self, token, text):
        return guarded_pb2.PutRequest(key=self.key, name=self.args.document,
                                      value=text.encode(),
                                      fencing_token=token)

    def work(self, holding):
        args = self.args
        count = 0
        while not holding.stopped:
            if args.writes and count >= args.writes:
                holding.stop("finished", writes=count)
                break
            if holding.handoff.is_set():
                # Cooperative: the step in progress is done; hand over now.
                holding.stop("handoff", writes=count)
                break
            count += 1
            request = self.put_request(
                holding.token,
                f"{args.holder}: write {count} with token {holding.token}")
            started = holding.start_write(
                lambda left, request=request: self.store.Put.future(
                    request, timeout=left,
                    metadata=self.fence_metadata(holding.token)))
            if started is None:
                break
            future, started_ms = started
            try:
                response = future.result()
                self.events.emit("wrote", n=count, token=str(holding.token),
                                 highest_token=str(response.highest_token),
                                 started_ms=started_ms)
            except grpc.FutureCancelledError:
                self.events.emit("write_cancelled", n=count,
                                 started_ms=started_ms)
            except grpc.RpcError as error:
                detail = describe_error(error)
                self.events.emit("write_failed", n=count,
                                 started_ms=started_ms, **detail)
                if detail.get("reason") == "STALE_FENCING_TOKEN":
                    # A newer run has written: this one is over.
                    holding.stop("write_refused")
            finally:
                holding.end_write()
            holding.wait_stopped(args.write_every_ms / 1000)

    def release(self, holding):
        try:
            response = self.leases.Release(
                lease_pb2.ReleaseRequest(key=self.key,
                                         run_id=holding.run_id),
                timeout=self.args.release_timeout_ms / 1000,
                metadata=self.auth)
            self.events.emit("released", released=response.released)
        except grpc.RpcError as error:
            self.events.emit("release_failed", **describe_error(error))

    def late_write(self, holding):
        """The write a paused run sends when it wakes up, token and all.

        It skips every check on purpose: it shows what the guarded store
        does with a write from a run that no longer holds the lease.
        """
        request = self.put_request(
            holding.token, f"{self.args.holder}: late write with token "
            f"{holding.token}")
        try:
            response = self.store.Put(
                request, timeout=10,
                metadata=self.fence_metadata(holding.token))
            self.events.emit("late_write_accepted",
                             token=str(holding.token),
                             highest_token=str(response.highest_token))
        except grpc.RpcError as error:
            self.events.emit("late_write_refused", token=str(holding.token),
                             **describe_error(error))

    def hold(self):
        """Acquires, works until stopped, releases. Returns the holding."""
        holding = self.acquire(0)
        if holding is None and self.args.wait_ms:
            holding = self.acquire(self.args.wait_ms)
        if holding is None:
            return None
        keepalive = KeepAlive(self.leases, holding, self.args.ttl_ms,
                              self.args.renew_ms / 1000, self.auth)
        keepalive.start()
        threading.Thread(target=holding.watch, daemon=True).start()
        self.work(holding)
        # The stream goes first: a release would otherwise come back on it
        # as `lost`.
        keepalive.close()
        self.release(holding)
        return holding

    def run(self):
        args = self.args
        if args.control:
            threading.Thread(target=self.read_commands, daemon=True).start()
        self.connect(timeout=10)
        self.events.emit("ready", server=args.server, store=args.store)
        if args.control:
            while True:
                command = self.commands.get()
                if command == "go":
                    break
                if command == "quit":
                    return EXIT_FINISHED
                self.events.emit("unknown_command", command=command)
        holding = self.hold()
        if holding is None:
            code = EXIT_HELD_ELSEWHERE
        elif holding.stop_reason in FINISHED_REASONS:
            code = EXIT_FINISHED
        else:
            code = EXIT_LOST
        if not args.control:
            return code
        while True:
            command = self.commands.get()
            if command == "quit":
                return code
            if command == "late-write" and holding is not None:
                self.late_write(holding)
            else:
                self.events.emit("unknown_command", command=command)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Hold a Leasehold session's lease and write through "
        "the fence; one JSON event per line on stdout. The bearer token "
        "for the lease server and the guarded store, if they need one, is "
        "read from LEASEHOLD_TOKEN.")
    parser.add_argument("--server", default="127.0.0.1:7070",
                        help="lease server, host:port (gRPC over h2c)")
    parser.add_argument("--store", default="127.0.0.1:7071",
                        help="guarded store, host:port (gRPC over h2c)")
    parser.add_argument("--account", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--holder", default="python-worker",
                        help="label other clients see as the holder")
    parser.add_argument("--run-id", default=str(uuid.uuid4()),
                        help="this run's UUID (default: a new one)")
    parser.add_argument("--ttl-ms", type=int, default=10_000)
    parser.add_argument("--margin-ms", type=int,
                        help="safety margin of the local deadline "
                        "(default: a tenth of the TTL)")
    parser.add_argument("--renew-ms", type=int,
                        help="renewal interval (default: a third of TTL "
                        "minus margin)")
    parser.add_argument("--wait-ms", type=int, default=0,
                        help="when held elsewhere, wait this long for it")
    parser.add_argument("--writes", type=int, default=0,
                        help="writes before releasing (0: until stopped)")
    parser.add_argument("--write-every-ms", type=int, default=200)
    parser.add_argument("--document", default="transcript",
                        help="name of the document written")
    parser.add_argument("--release-timeout-ms", type=int, default=1_000)
    parser.add_argument("--control", action="store_true",
                        help="read commands from stdin: go (start), "
                        "late-write (after stopping), quit")
    args = parser.parse_args(argv)
    if args.ttl_ms <= 0:
        parser.error("--ttl-ms must be positive")
    if args.margin_ms is None:
        args.margin_ms = args.ttl_ms // 10
    if not 0 <= args.margin_ms < args.ttl_ms:
        parser.error("--margin-ms must be at least 0 and below --ttl-ms")
    usable = args.ttl_ms - args.margin_ms
    if args.renew_ms is None:
        args.renew_ms = usable // 3
    # With renewals close to the usable window, one slow answer would
    # stop the run.
    if not 0 < args.renew_ms <= usable / 2:
        parser.error("--renew-ms must be above 0 and at most half of "
                     "--ttl-ms minus --margin-ms")
    return args


def main(argv):
    args = parse_args(argv)
    events = Events(args.holder)
    events.run_id = args.run_id
    worker = Worker(args, events)
    try:
        return worker.run()
    except grpc.RpcError as error:
        events.emit("error", **describe_error(error))
        return EXIT_ERROR
    except grpc.FutureTimeoutError:
        events.emit("error", code="UNAVAILABLE",
                    message=f"cannot connect to {args.server} or "
                    f"{args.store}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
