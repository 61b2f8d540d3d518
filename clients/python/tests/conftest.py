"""Fixtures: the lease server (two instances on one database, bearer tokens
required), the guarded store, a TCP proxy factory, clients and tokens."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import pytest

from leasehold import LeaseClient
from support import Server, TcpProxy, guarded_server, jwt, lease_server, require_env

ACCOUNT = "acct-py"
ADMIN_SCOPE = "leasehold:admin"


@pytest.fixture(scope="session")
def secret() -> str:
    return secrets.token_urlsafe(32)


@pytest.fixture(scope="session")
def database_url() -> str:
    return require_env("LEASEHOLD_TEST_DATABASE_URL")


@pytest.fixture(scope="session")
def servers(database_url: str, secret: str) -> Iterator[list[Server]]:
    """Two instances of the lease server on one database."""
    started = [lease_server(database_url, secret), lease_server(database_url, secret)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(servers: list[Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="session")
def store(server: Server, secret: str) -> Iterator[Server]:
    """The guarded store, its callers verified with the lease server's
    secret and its fence confirmed by the first lease server instance."""
    started = guarded_server(
        require_env("LEASEHOLD_TEST_STORE_DATABASE_URL"), secret, server.address
    )
    yield started
    started.stop()


@pytest.fixture(scope="session")
def token(secret: str) -> Callable[..., str]:
    def make(account: str = ACCOUNT, *, expires_in: float = 600, scope: str | None = None) -> str:
        return jwt(secret, account, expires_in=expires_in, scope=scope)

    return make


@pytest.fixture(scope="session")
def admin(server: Server, token: Callable[..., str]) -> Iterator[LeaseClient]:
    """A client with the admin scope, straight to the first instance: the
    test's view of the server."""
    client = LeaseClient(server.address, token=token(scope=ADMIN_SCOPE))
    yield client
    client.close()


@pytest.fixture
def proxies() -> Iterator[Callable[[str], TcpProxy]]:
    made: list[TcpProxy] = []

    def make(target: str) -> TcpProxy:
        proxy = TcpProxy(target)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., LeaseClient]]:
    made: list[LeaseClient] = []

    def make(*args: object, **kwargs: object) -> LeaseClient:
        client = LeaseClient(*args, **kwargs)  # type: ignore[arg-type]
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
