"""TLS of both clients: the CA bundle a server's certificate is checked
against, and the client certificate presented to a server that asks for one
(mutual TLS, docs/security.md "Client certificates"), given as files.

grpcio fixes a channel's credentials when the channel is made and offers no
way to change them (its certificate providers, which reload files, are not
exposed to Python), so the files are read again, once they change on disk,
for every channel the client makes after that: each KeepAlive stream opens
on a channel of its own, and the unary calls move to new channels once a
file has changed (``TlsCredentials.current``). A connection already open
keeps the certificate it was made with, as in the TypeScript client.
"""

from __future__ import annotations

import os
import ssl
import threading
from dataclasses import dataclass

import grpc

Path = str | os.PathLike[str]


@dataclass(frozen=True)
class ClientTls:
    """TLS files of a client; every one is optional.

    ``ca_file``: PEM CA bundle that replaces grpcio's default roots for the
    server's certificate. ``cert_file`` and ``key_file``: the client
    certificate chain and its private key (PEM, unencrypted), presented to a
    server that authenticates clients by certificate. Read again for new
    connections once they change on disk (a rotation by cert-manager or
    SPIRE's helper needs no restart).
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


# What identifies a file's content without reading it: a rotation that
# renames a new file into place changes the inode, an in-place rewrite the
# modification time or size.
_Stamp = tuple[int, int, int, int]


def _stamp(path: Path) -> _Stamp:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class TlsCredentials:
    """The channel credentials of a client: fixed root certificates, or the
    files of a :class:`ClientTls`, read again when one has changed."""

    def __init__(self, tls: ClientTls | None, root_certificates: bytes | None) -> None:
        tls = tls or ClientTls()
        if (tls.cert_file is None) != (tls.key_file is None):
            raise TypeError(
                "tls: cert_file and key_file go together (a client certificate needs its key)"
            )
        if tls.ca_file is not None and root_certificates is not None:
            raise TypeError(
                "give the CA bundle as tls=ClientTls(ca_file=...) or as root_certificates=, "
                "not both"
            )
        self._tls = tls
        self._root_certificates = root_certificates
        self._files = [f for f in (tls.ca_file, tls.cert_file, tls.key_file) if f is not None]
        self._lock = threading.Lock()
        self._stamps: list[_Stamp] | None = None
        self._credentials: grpc.ChannelCredentials | None = None
        self._generation = 0
        self.current()  # an unreadable or mismatched file fails here, when the client is made

    @property
    def presents_certificate(self) -> bool:
        """Whether the client authenticates with a certificate read from files."""
        return self._tls.cert_file is not None

    def current(self) -> tuple[int, grpc.ChannelCredentials]:
        """The credentials for a channel made now, and their generation,
        which grows each time the files are read again. A file being
        replaced (absent for a moment, or a new certificate beside the old
        key) keeps the last good credentials; the next call looks again."""
        with self._lock:
            try:
                self._reload()
            except (OSError, ssl.SSLError) as error:
                if self._credentials is None:
                    raise ValueError(f"cannot use the TLS files of the client: {error}") from error
            assert self._credentials is not None
            return self._generation, self._credentials

    def _reload(self) -> None:
        before = [_stamp(f) for f in self._files]
        if self._credentials is not None and before == self._stamps:
            return
        tls = self._tls
        ca = _read(tls.ca_file) if tls.ca_file is not None else self._root_certificates
        cert = _read(tls.cert_file) if tls.cert_file is not None else None
        key = _read(tls.key_file) if tls.key_file is not None else None
        # The same checks a TLS stack makes, so that a mistake is named here
        # and not as an UNAVAILABLE handshake failure: the key is the
        # certificate's (a rotation halfway through has a new certificate
        # beside the old key), and the CA bundle is PEM.
        if tls.cert_file is not None and tls.key_file is not None:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(tls.cert_file, tls.key_file)
        if tls.ca_file is not None and ca is not None:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=ca.decode())
        if [_stamp(f) for f in self._files] != before:
            raise OSError("a TLS file changed while it was read")
        self._credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        self._stamps = before
        self._generation += 1


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def credentials_of(tls: ClientTls | None, root_certificates: bytes | None) -> TlsCredentials | None:
    """None for plaintext: neither TLS files nor root certificates."""
    if tls is None and root_certificates is None:
        return None
    return TlsCredentials(tls, root_certificates)
