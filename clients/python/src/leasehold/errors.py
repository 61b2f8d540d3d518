"""Typed errors of the client, named as the TypeScript client names them.

Every error a call raises is a :class:`LeaseholdError`; ``code`` is the gRPC
status code, ``reason`` and ``metadata`` the server's ``google.rpc.ErrorInfo``
(domain ``leasehold.dev``), and ``__cause__`` the original ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2

if TYPE_CHECKING:
    from datetime import datetime

    from .types import Lease

ERROR_DOMAIN = "leasehold.dev"

#: ErrorInfo reasons the server sends (src/protocol/errors.ts).
LEASE_NOT_HELD = "LEASE_NOT_HELD"
STALE_FENCING_TOKEN = "STALE_FENCING_TOKEN"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
UNAUTHENTICATED = "UNAUTHENTICATED"
LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
#: A keeper named is not valid (``cause``: expired, revoked, closed, not_found).
KEEPER_NOT_HELD = "KEEPER_NOT_HELD"

#: The ``limit`` a KeepAlive stream refused for carrying too many leases names.
LIMIT_LEASES_PER_STREAM = "max-leases-per-stream"

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class LeaseholdError(Exception):
    """Base class of every error this client raises."""

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        *,
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        #: The gRPC status code of the failure.
        self.code = code
        #: The ErrorInfo reason the server sent, if any (e.g. ``LEASE_NOT_HELD``).
        self.reason = reason
        #: The ErrorInfo metadata the server sent (empty when none).
        self.metadata: dict[str, str] = metadata or {}


class InvalidArgumentError(LeaseholdError):
    """A request field broke a rule (INVALID_ARGUMENT); ``field`` names it, ``rule`` says how."""

    def __init__(self, message: str, field: str, rule: str) -> None:
        super().__init__(
            message,
            grpc.StatusCode.INVALID_ARGUMENT,
            reason=INVALID_ARGUMENT,
            metadata={"field": field},
        )
        self.field = field
        self.rule = rule


class LeaseNotHeldError(LeaseholdError):
    """A renewal of a lease the run does not hold (FAILED_PRECONDITION, LEASE_NOT_HELD).

    ``loss_cause`` is ``expired``, ``released``, ``taken_over``, ``revoked`` or
    ``not_found`` (None when the server did not say).
    """

    def __init__(self, message: str, loss_cause: str | None) -> None:
        super().__init__(
            message,
            grpc.StatusCode.FAILED_PRECONDITION,
            reason=LEASE_NOT_HELD,
            metadata={"cause": loss_cause} if loss_cause else {},
        )
        self.loss_cause = loss_cause


class StaleFencingTokenError(LeaseholdError):
    """A guarded resource refused a token below the highest it has seen (ABORTED).

    The write did not happen; do not retry it: a newer run holds, or held, the session.
    """

    def __init__(
        self,
        message: str,
        presented: int | None,
        highest: int | None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            message, grpc.StatusCode.ABORTED, reason=STALE_FENCING_TOKEN, metadata=metadata
        )
        self.presented = presented
        self.highest = highest


class NotAcquiredError(LeaseholdError):
    """The session is held by another run; ``current`` is the lease that blocked the grant.

    ``lock_delay_until``: when no lease holds it but the key's last lease was
    on a keeper that expired, the end of its lock-delay (database clock, K2).
    """

    def __init__(
        self, message: str, current: Lease | None, *, lock_delay_until: datetime | None = None
    ) -> None:
        super().__init__(message, grpc.StatusCode.FAILED_PRECONDITION)
        self.current = current
        self.lock_delay_until = lock_delay_until

    @property
    def holder(self) -> str:
        """The holder label of the blocking lease ("" when none or unknown)."""
        return self.current.holder if self.current is not None else ""


class LateGrantError(NotAcquiredError):
    """A grant whose answer arrived after its own local deadline (L2); it was released."""

    def __init__(self, late_lease: Lease | None, elapsed_seconds: float) -> None:
        super().__init__(
            f"the grant arrived {elapsed_seconds * 1000:.0f}ms after the request was sent, "
            "past its local deadline; it was released",
            None,
        )
        self.late_lease = late_lease
        self.elapsed_seconds = elapsed_seconds


class LeaseLostError(LeaseholdError):
    """The run lost (or can no longer vouch for) its lease.

    ``reason`` (also ``loss_reason``) is a server cause (``expired``,
    ``released``, ``taken_over``, ``revoked``, ``not_found``), ``deadline``
    (the local deadline passed without a confirmed renewal),
    ``renewal_failed`` (the server refused renewals for good) or
    ``token_expired`` (the stream had to reopen and the static bearer token
    had expired).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message, grpc.StatusCode.FAILED_PRECONDITION)
        self.loss_reason = reason
        self.reason = reason


class UnauthenticatedError(LeaseholdError):
    """The server did not accept the credentials; ``failure`` says why (e.g. ``expired``)."""

    @property
    def failure(self) -> str | None:
        return self.metadata.get("cause")


class PermissionDeniedError(LeaseholdError):
    """The caller may not touch this account, session or method."""


class ResourceExhaustedError(LeaseholdError):
    """A bound was reached; ``limit`` names it and ``max`` is its value, when the server said."""

    @property
    def limit(self) -> str | None:
        return self.metadata.get("limit")

    @property
    def max(self) -> int | None:
        value = self.metadata.get("max")
        return int(value) if value is not None and value.isdigit() else None


class UnavailableError(LeaseholdError):
    """No configured instance could answer; ``attempts`` names every attempt's
    instance and why it failed (an idempotent call tries each instance twice)."""

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        *,
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
        attempts: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message, code, reason=reason, metadata=metadata)
        self.attempts = list(attempts)


class DeadlineExceededError(LeaseholdError):
    """The call or the database statement ran out of time."""


class CanceledError(LeaseholdError):
    """The call was cancelled."""


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def status_details(trailing: Iterable[tuple[str, Any]] | None) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` a server put in the trailers, if any."""
    for key, value in trailing or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status()
            status.ParseFromString(value)
            return status
    return None


def from_status(
    code: grpc.StatusCode, message: str, trailing: Iterable[tuple[str, Any]] | None
) -> LeaseholdError:
    """Maps a gRPC status and its ``google.rpc`` details to a typed error."""
    info: error_details_pb2.ErrorInfo | None = None
    bad_request: error_details_pb2.BadRequest | None = None
    status = status_details(trailing)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and info is None:
                candidate = error_details_pb2.ErrorInfo()
                detail.Unpack(candidate)
                if candidate.domain in (ERROR_DOMAIN, ""):
                    info = candidate
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and bad_request is None:
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
    reason = info.reason if info is not None else None
    metadata = dict(info.metadata) if info is not None else {}
    if reason == LEASE_NOT_HELD or (code == grpc.StatusCode.FAILED_PRECONDITION and not reason):
        return LeaseNotHeldError(message, metadata.get("cause"))
    if reason == STALE_FENCING_TOKEN or (code == grpc.StatusCode.ABORTED and info is not None):
        return StaleFencingTokenError(
            message,
            _int_or_none(metadata.get("presented_token")),
            _int_or_none(metadata.get("highest_token")),
            metadata,
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = metadata.get("field", "")
        rule = message
        if bad_request is not None and bad_request.field_violations:
            violation = bad_request.field_violations[0]
            field = violation.field or field
            rule = violation.description or rule
        return InvalidArgumentError(message, field, rule)
    classes: dict[grpc.StatusCode, type[LeaseholdError]] = {
        grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
        grpc.StatusCode.UNAVAILABLE: UnavailableError,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
        grpc.StatusCode.CANCELLED: CanceledError,
        # A connection cut under a call, with no detail from any server: as
        # retryable as UNAVAILABLE, and never a stale token.
        grpc.StatusCode.ABORTED: UnavailableError,
    }
    cls = classes.get(code, LeaseholdError)
    return cls(message, code, reason=reason, metadata=metadata)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status_message(status: status_pb2.Status) -> LeaseholdError:
    """Maps a ``google.rpc.Status`` message (a Keep stream's refused
    request) to a typed error, as a call's status with those details."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    trailing = [(_STATUS_DETAILS_KEY, status.SerializeToString())]
    return from_status(code, status.message or str(code), trailing)


def from_rpc_error(error: grpc.RpcError) -> LeaseholdError:
    """Converts a ``grpc.RpcError`` (blocking or ``grpc.aio``) to a typed error."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    trailing_fn = getattr(error, "trailing_metadata", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    message = (details_fn() if callable(details_fn) else None) or str(code)
    trailing = trailing_fn() if callable(trailing_fn) else None
    typed = from_status(code or grpc.StatusCode.UNKNOWN, message, trailing)
    typed.__cause__ = error
    return typed
