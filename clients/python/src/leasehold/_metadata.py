"""What goes out with every call: the bearer token, the active trace
context, and the fencing headers of a call made on behalf of a lease."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import UnauthenticatedError
from .types import SessionKey

_otel_propagate: Any
try:  # Optional: the active OpenTelemetry context's traceparent goes out with calls.
    from opentelemetry import propagate as _otel_propagate
except ImportError:  # pragma: no cover - depends on the environment
    _otel_propagate = None

Token = str | Callable[[], str] | None
Metadata = tuple[tuple[str, str], ...]

#: The headers a call made on behalf of a lease carries (DESIGN §5).
FENCING_TOKEN_HEADER = "leasehold-fencing-token"
ACCOUNT_ID_HEADER = "leasehold-account-id"
SESSION_ID_HEADER = "leasehold-session-id"


class Auth:
    """The bearer token: a string, or a callable returning the current one."""

    def __init__(self, token: Token) -> None:
        if token is not None and not isinstance(token, str) and not callable(token):
            raise TypeError("token must be a string or a callable returning one")
        self.token = token

    @property
    def refreshable(self) -> bool:
        return callable(self.token)

    def metadata(self) -> Metadata:
        token = self.token
        if token is None:
            value = None
        elif isinstance(token, str):
            value = token
        else:
            try:
                value = token()
            except Exception as error:
                raise UnauthenticatedError(f"the token callable failed: {error!r}") from error
        md: list[tuple[str, str]] = []
        if value:
            md.append(("authorization", f"Bearer {value}"))
        if _otel_propagate is not None:
            carrier: dict[str, str] = {}
            _otel_propagate.inject(carrier)
            md.extend(carrier.items())
        return tuple(md)


def fencing_metadata(key: SessionKey, token: int) -> Metadata:
    return (
        (FENCING_TOKEN_HEADER, str(token)),
        (ACCOUNT_ID_HEADER, key.account_id),
        (SESSION_ID_HEADER, key.session_id),
    )
