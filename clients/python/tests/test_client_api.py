"""The rest of the client's surface: every LeaseService method with typed
results, close() releasing what is held and saying what it could not, the
W3C traceparent and bearer token on outgoing calls, run ids as the server
keeps them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from test_blocking import TTL, key

from leasehold import Event, LeaseClient, Snapshot
from leasehold._gen.leasehold.v1 import lease_pb2, lease_pb2_grpc
from leasehold.types import normalize_run_id
from support import Server, TcpProxy

Clients = Callable[..., LeaseClient]


def test_every_method_answers_with_typed_results(
    server: Server, admin: LeaseClient, token: Callable[..., str], clients: Clients
) -> None:
    """S3, S5: acquire, get, list, renew, check_fence, watch, history,
    release, each a dataclass."""
    c = clients(server.address, token=token())
    k = key("api")
    watch = c.watch(k)
    first = next(watch)
    assert isinstance(first, Snapshot) and first.leases == []
    granted = c.acquire(k, ttl=TTL, holder="api")
    assert granted.acquired and granted.lease is not None
    lease = granted.lease
    assert lease.holder == "api" and lease.ttl.total_seconds() == TTL
    event = next(watch)
    assert isinstance(event, Event) and event.type == "ACQUIRED" and event.run_id == lease.run_id
    watch.close()
    got = c.get(k)
    assert got.held and got.lease is not None and got.lease.fencing_token == lease.fencing_token
    listed = c.list(k.account_id, page_size=1000)
    assert lease.run_id in {item.run_id for item in listed.leases}
    renewed = c.renew(k, lease.run_id.upper())  # run ids are compared as the server keeps them
    assert renewed.run_id == lease.run_id and renewed.fencing_token == lease.fencing_token
    fence = c.check_fence(k, lease.fencing_token)
    assert fence.current and fence.highest_token == lease.fencing_token
    assert c.release(k, lease.run_id)
    assert not c.release(k, lease.run_id)
    assert [e.type for e in c.history(k).events] == ["RELEASED", "ACQUIRED"]
    assert normalize_run_id("AAAAAAAA-0000-4000-8000-000000000000") == (
        "aaaaaaaa-0000-4000-8000-000000000000"
    )


def test_close_releases_what_is_held_and_says_what_it_could_not(
    server: Server,
    admin: LeaseClient,
    token: Callable[..., str],
    proxies: Callable[[str], TcpProxy],
) -> None:
    """close() releases every hold still open; releases that fail are
    returned (and the lease then ends at its deadline)."""
    c = LeaseClient(server.address, token=token())
    k = key("close")
    c.hold(k, ttl=TTL).__enter__()
    assert c.close() == []
    assert admin.history(k).events[0].type == "RELEASED"

    proxy = proxies(server.address)
    cut_off = LeaseClient(proxy.address, token=token(), timeout=1)
    k2 = key("close-failed")
    h = cut_off.hold(k2, ttl=30).__enter__()
    proxy.drop()
    failures = cut_off.close()
    assert [(f.key, f.run_id) for f in failures] == [(k2, h.run_id)]
    assert admin.get(k2).held  # not released: it ends at its deadline


class Recorder(lease_pb2_grpc.LeaseServiceServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def Get(self, request: lease_pb2.GetRequest, context: Any) -> lease_pb2.GetResponse:
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        return lease_pb2.GetResponse(held=False)


@pytest.fixture
def recorder() -> Iterator[tuple[str, Recorder]]:
    servicer = Recorder()  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    lease_pb2_grpc.add_LeaseServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_calls_carry_the_bearer_token_and_the_active_traceparent(
    recorder: tuple[str, Recorder], clients: Clients
) -> None:
    """A callable token is called per call; the active OpenTelemetry span's
    context goes out as W3C traceparent."""
    address, servicer = recorder
    issued = iter(["first", "second"])
    c = clients(address, token=lambda: next(issued))
    span = trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=0x0AF7651916CD43DD8448EB211C80319C,
            span_id=0xB7AD6B7169203331,
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        )
    )
    attached = otel_context.attach(trace.set_span_in_context(span))
    try:
        c.get(key("trace"))
    finally:
        otel_context.detach(attached)
    c.get(key("trace"))
    assert servicer.metadata[0]["authorization"] == "Bearer first"
    assert servicer.metadata[0]["traceparent"] == (
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    )
    assert servicer.metadata[1]["authorization"] == "Bearer second"
    assert "traceparent" not in servicer.metadata[1]


def test_tls_with_root_certificates(
    database_url: str, secret: str, token: Callable[..., str], tmp_path: Any, clients: Clients
) -> None:
    """TLS: the client trusts the given root certificate; a hold is kept
    alive over TLS; a client without that root cannot connect."""
    import subprocess

    from leasehold import UnavailableError
    from support import lease_server

    cert, private = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(private),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    tls = lease_server(database_url, secret, "--tls-cert", str(cert), "--tls-key", str(private))
    try:
        c = clients(tls.address, token=token(), root_certificates=cert.read_bytes())
        k = key("tls")
        with c.hold(k, ttl=1.0) as h:
            renewed_from = h.lease.expires_at
            deadline = time.monotonic() + 10
            while h.lease.expires_at == renewed_from and time.monotonic() < deadline:
                h.lost.wait(0.05)
            assert h.lease.expires_at != renewed_from  # renewed over the TLS stream
            h.check()
        assert h.released is True
        untrusting = clients(tls.address, token=token(), timeout=2)  # plaintext to a TLS port
        with pytest.raises(UnavailableError):
            untrusting.get(k)
    finally:
        tls.stop()
