"""Mutual TLS (issue 39, docs/security.md "Client certificates"): both
clients authenticate with a client certificate alone, given as files
(``tls=ClientTls(...)``), against a lease server started with --tls-cert,
--tls-key, --tls-client-ca and --identity-map. The certificates are made
at test time with the openssl command (no private key is checked in), as
test/support/certificates.ts makes the TypeScript suite's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from leasehold import (
    AsyncLeaseClient,
    ClientTls,
    KeepAliveEvent,
    LeaseClient,
    PermissionDeniedError,
    SessionKey,
    UnauthenticatedError,
)
from support import Server, fresh_session, lease_server, wait_for

ACCOUNT = "acme"


def spiffe(workload: str) -> str:
    return f"spiffe://test.example/ns/acme/sa/{workload}"


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class Certificates:
    """A CA and the certificates it signs, in a folder. Leaves are signed
    with `openssl ca`, which takes explicit start and end times (an expired
    certificate, one that expires in a few seconds)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = Pair(folder / "ca.pem", folder / "ca-key.pem")
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(self.ca.key), "-out", str(self.ca.cert), "-days", "30",
            "-subj", "/CN=python-client-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        self.db = folder / "ca-db"
        self.db.mkdir()
        (self.db / "index.txt").write_text("")
        (self.db / "serial").write_text("1000\n")

    def leaf(
        self,
        name: str,
        *,
        spiffe_id: str | None = None,
        ip: str | None = None,
        usage: str = "clientAuth",
        not_before: timedelta = timedelta(days=-1),
        not_after: timedelta = timedelta(days=30),
    ) -> Pair:
        """A certificate valid from now + ``not_before`` to now + ``not_after``."""
        base = self.folder / name
        pair = Pair(base.with_suffix(".pem"), base.with_name(f"{name}-key.pem"))
        csr = base.with_suffix(".csr")
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(pair.key), "-out", str(csr), "-subj", f"/CN={name}",
        )  # fmt: skip
        sans = [f"URI:{spiffe_id}"] if spiffe_id else []
        sans += [f"IP:{ip}"] if ip else []
        ext = base.with_suffix(".ext")
        ext.write_text(
            "\n".join(
                [
                    "[leaf]",
                    "basicConstraints=critical,CA:FALSE",
                    "keyUsage=critical,digitalSignature,keyEncipherment",
                    f"extendedKeyUsage={usage}",
                    *([f"subjectAltName={','.join(sans)}"] if sans else []),
                    "",
                ]
            )
        )
        config = base.with_suffix(".cnf")
        config.write_text(
            "\n".join(
                [
                    "[ca]",
                    "default_ca=test",
                    "[test]",
                    f"dir={self.db}",
                    "database=$dir/index.txt",
                    "serial=$dir/serial",
                    f"new_certs_dir={self.db}",
                    "default_md=sha256",
                    "policy=any",
                    "unique_subject=no",
                    "copy_extensions=none",
                    "[any]",
                    "commonName=optional",
                    "",
                ]
            )
        )
        now = datetime.now(UTC)
        _openssl(
            "ca", "-batch", "-notext", "-config", str(config),
            "-cert", str(self.ca.cert), "-keyfile", str(self.ca.key),
            "-in", str(csr), "-out", str(pair.cert),
            "-startdate", _asn1(now + not_before), "-enddate", _asn1(now + not_after),
            "-extfile", str(ext), "-extensions", "leaf",
        )  # fmt: skip
        return pair


def _asn1(at: datetime) -> str:
    return at.strftime("%Y%m%d%H%M%SZ")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def install(source: Pair, target: Pair) -> None:
    """Replaces the target files by rename, as rotation tools do (never a
    half-written file): the key first, then the certificate."""
    for src, dst in ((source.key, target.key), (source.cert, target.cert)):
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


@dataclass(frozen=True)
class Mtls:
    server: Server
    certs: Certificates
    worker: Pair  # spiffe .../sa/worker: account acme
    ops: Pair  # spiffe .../sa/ops: account acme with the admin scope
    stranger: Pair  # a genuine certificate the identity map does not name
    expired: Pair  # worker's identity, expired yesterday

    def tls(self, pair: Pair) -> ClientTls:
        return ClientTls(ca_file=self.certs.ca.cert, cert_file=pair.cert, key_file=pair.key)


@pytest.fixture(scope="module")
def mtls(
    database_url: str, secret: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mtls]:
    folder = tmp_path_factory.mktemp("certificates")
    certs = Certificates(folder)
    server_pair = certs.leaf("server", ip="127.0.0.1", usage="serverAuth")
    identities = folder / "identities.yaml"
    identities.write_text(
        "identities:\n"
        f"  - spiffe_id: {spiffe('ops')}\n"
        f"    account: {ACCOUNT}\n"
        "    scopes: [leasehold:admin]\n"
        "  - spiffe_id_prefix: spiffe://test.example/ns/acme/\n"
        f"    account: {ACCOUNT}\n"
    )
    server = lease_server(
        database_url,
        secret,
        "--tls-cert", str(server_pair.cert), "--tls-key", str(server_pair.key),
        "--tls-client-ca", str(certs.ca.cert), "--identity-map", str(identities),
    )  # fmt: skip
    yield Mtls(
        server=server,
        certs=certs,
        worker=certs.leaf("worker", spiffe_id=spiffe("worker")),
        ops=certs.leaf("ops", spiffe_id=spiffe("ops")),
        stranger=certs.leaf("stranger", spiffe_id="spiffe://elsewhere.example/x"),
        expired=certs.leaf(
            "expired",
            spiffe_id=spiffe("worker"),
            not_before=timedelta(days=-30),
            not_after=timedelta(days=-1),
        ),
    )
    server.stop()


def key(label: str) -> SessionKey:
    return SessionKey(ACCOUNT, fresh_session(label))


def sleep_past_first_ttl(database_url: str, k: SessionKey) -> None:
    """Returns once the lease's first TTL has passed on the database clock,
    which only renewals on the KeepAlive stream survive."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_sleep_until(acquired_at + ttl + interval '50 milliseconds') "
            "FROM leases WHERE account_id = %s AND session_id = %s",
            (k.account_id, k.session_id),
        )


def test_tls_files_are_checked_when_the_client_is_made(mtls: Mtls) -> None:
    """A certificate without its key, a key that is not the certificate's,
    or two CA bundles are refused at once, naming the mistake."""
    with pytest.raises(TypeError, match="cert_file and key_file go together"):
        LeaseClient(mtls.server.address, tls=ClientTls(cert_file=mtls.worker.cert))
    with pytest.raises(ValueError, match="cannot use the TLS files"):
        LeaseClient(
            mtls.server.address,
            tls=ClientTls(cert_file=mtls.worker.cert, key_file=mtls.ops.key),
        )
    with pytest.raises(TypeError, match="not both"):
        LeaseClient(
            mtls.server.address,
            tls=ClientTls(ca_file=mtls.certs.ca.cert),
            root_certificates=mtls.certs.ca.cert.read_bytes(),
        )


def test_holds_a_lease_with_a_certificate_only(mtls: Mtls, database_url: str) -> None:
    """No token: the certificate's SPIFFE ID is the account, for the unary
    calls and the KeepAlive stream that renews the lease past its TTL."""
    with LeaseClient(mtls.server.address, tls=mtls.tls(mtls.worker)) as client:
        k = key("cert-only")
        with client.hold(k, ttl=0.6) as h:
            sleep_past_first_ttl(database_url, k)
            h.check()
            got = client.get(k)
            assert got.lease is not None and got.lease.run_id == h.run_id
        assert h.released is True


async def test_async_holds_a_lease_with_a_certificate_only(mtls: Mtls, database_url: str) -> None:
    async with AsyncLeaseClient(mtls.server.address, tls=mtls.tls(mtls.worker)) as client:
        k = key("cert-only-async")
        async with client.hold(k, ttl=0.6) as h:
            await asyncio.to_thread(sleep_past_first_ttl, database_url, k)
            h.check()
            got = await client.get(k)
            assert got.lease is not None and got.lease.run_id == h.run_id
        assert h.released is True


def test_an_unmapped_certificate_is_permission_denied(mtls: Mtls) -> None:
    with (
        LeaseClient(mtls.server.address, tls=mtls.tls(mtls.stranger)) as client,
        pytest.raises(PermissionDeniedError, match="not in the server's identity map"),
    ):
        client.acquire(key("stranger"), ttl=5)


async def test_async_an_unmapped_certificate_is_permission_denied(mtls: Mtls) -> None:
    async with AsyncLeaseClient(mtls.server.address, tls=mtls.tls(mtls.stranger)) as client:
        with pytest.raises(PermissionDeniedError, match="not in the server's identity map"):
            await client.acquire(key("stranger-async"), ttl=5)


def test_an_expired_certificate_is_unauthenticated_naming_why(mtls: Mtls) -> None:
    with (
        LeaseClient(mtls.server.address, tls=mtls.tls(mtls.expired)) as client,
        pytest.raises(UnauthenticatedError) as raised,
    ):
        client.acquire(key("expired"), ttl=5)
    assert raised.value.failure == "certificate_expired"


async def test_async_an_expired_certificate_is_unauthenticated_naming_why(mtls: Mtls) -> None:
    async with AsyncLeaseClient(mtls.server.address, tls=mtls.tls(mtls.expired)) as client:
        with pytest.raises(UnauthenticatedError) as raised:
            await client.acquire(key("expired-async"), ttl=5)
    assert raised.value.failure == "certificate_expired"


# The rotation tests' first certificate expires this long after it is made:
# time for the client to open its stream with it, on a loaded machine.
SHORT_LIFE = timedelta(seconds=6)


def rotation_files(mtls: Mtls, tmp_path: Path) -> tuple[Pair, Pair]:
    """The live files a client reads (holding a worker certificate that
    expires soon), and the next certificate (ops: the same account, with
    the admin scope that tells the two apart)."""
    short = mtls.certs.leaf(
        f"short-{tmp_path.name}", spiffe_id=spiffe("worker"), not_after=SHORT_LIFE
    )
    live = Pair(tmp_path / "live.pem", tmp_path / "live-key.pem")
    install(short, live)
    return live, mtls.ops


class Events:
    """The client's KeepAlive events, to wait on."""

    def __init__(self) -> None:
        self.seen: list[KeepAliveEvent] = []

    def __call__(self, event: KeepAliveEvent) -> None:
        self.seen.append(event)

    def reopened_after_expiry(self) -> bool:
        """A stream ended at its certificate's expiry (UNAUTHENTICATED
        certificate_expired), and one opened since."""
        ended = [
            i
            for i, e in enumerate(self.seen)
            if e.type == "failed"
            and isinstance(e.error, UnauthenticatedError)
            and e.error.failure == "certificate_expired"
        ]
        return bool(ended) and any(e.type == "open" for e in self.seen[ended[0] :])


def test_rotated_files_are_used_for_new_connections(mtls: Mtls, tmp_path: Path) -> None:
    """The files are replaced while the client runs: the next unary call
    goes on a new connection with the new certificate (its admin scope
    opens Revoke); the lease's KeepAlive stream keeps its connection until
    the old certificate expires, then the server ends it and the client
    reopens it with the new files, and the lease goes on."""
    live, next_pair = rotation_files(mtls, tmp_path)
    events = Events()
    tls = ClientTls(ca_file=mtls.certs.ca.cert, cert_file=live.cert, key_file=live.key)
    with LeaseClient(mtls.server.address, tls=tls, on_event=events) as client:
        k = key("rotation")
        with client.hold(k, ttl=2.0) as h:
            with pytest.raises(PermissionDeniedError):
                client.revoke(key("not-held"), reason="needs the admin scope")
            # A renewal answered: the KeepAlive stream's connection was made
            # with the first certificate, before the rotation.
            granted = h.lease.expires_at
            wait_for("a renewal on the first stream", lambda: h.lease.expires_at != granted)
            install(next_pair, live)
            assert client.revoke(key("not-held"), reason="the new certificate").revoked is False
            wait_for(
                "the stream to end at the old certificate's expiry and reopen",
                events.reopened_after_expiry,
                timeout=SHORT_LIFE.total_seconds() + 20,
            )
            renewed_from = h.lease.expires_at
            wait_for("a renewal on the reopened stream", lambda: h.lease.expires_at != renewed_from)
            h.check()
        assert h.released is True


async def test_async_rotated_files_are_used_for_new_connections(mtls: Mtls, tmp_path: Path) -> None:
    live, next_pair = rotation_files(mtls, tmp_path)
    events = Events()
    tls = ClientTls(ca_file=mtls.certs.ca.cert, cert_file=live.cert, key_file=live.key)
    async with AsyncLeaseClient(mtls.server.address, tls=tls, on_event=events) as client:
        k = key("rotation-async")
        async with client.hold(k, ttl=2.0) as h:
            with pytest.raises(PermissionDeniedError):
                await client.revoke(key("not-held"), reason="needs the admin scope")
            granted = h.lease.expires_at
            await until("a renewal on the first stream", lambda: h.lease.expires_at != granted)
            install(next_pair, live)
            revoked = await client.revoke(key("not-held"), reason="the new certificate")
            assert revoked.revoked is False
            await until(
                "the stream to end at the old certificate's expiry and reopen",
                events.reopened_after_expiry,
                SHORT_LIFE.total_seconds() + 20,
            )
            renewed_from = h.lease.expires_at
            await until(
                "a renewal on the reopened stream", lambda: h.lease.expires_at != renewed_from
            )
            h.check()
        assert h.released is True


async def until(what: str, predicate: Callable[[], object], limit: float = 20.0) -> None:
    """Waits, yielding to the event loop, until ``predicate()`` holds."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {limit}s")
        await asyncio.sleep(0.01)
