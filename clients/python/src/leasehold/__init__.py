"""Leasehold's Python client: hold a session's lease, stop the moment it is
lost, fence every write. See clients/python/README.md and docs/clients.md."""

from ._client import HoldOptions
from ._core import KeepAliveEvent
from ._metadata import ACCOUNT_ID_HEADER, FENCING_TOKEN_HEADER, SESSION_ID_HEADER
from ._tls import ClientTls
from .aio import AsyncHold, AsyncLeaseClient
from .client import Hold, LeaseClient
from .errors import (
    CanceledError,
    DeadlineExceededError,
    InvalidArgumentError,
    LateGrantError,
    LeaseholdError,
    LeaseLostError,
    LeaseNotHeldError,
    NotAcquiredError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StaleFencingTokenError,
    UnauthenticatedError,
    UnavailableError,
    from_rpc_error,
)
from .types import (
    AcquireResult,
    CheckFenceResult,
    Event,
    GetResult,
    HandoffRequest,
    HandoffResult,
    HistoryResult,
    Lease,
    ListResult,
    ReleaseFailure,
    RevokeResult,
    SessionKey,
    Snapshot,
)

__all__ = [
    "ACCOUNT_ID_HEADER",
    "FENCING_TOKEN_HEADER",
    "SESSION_ID_HEADER",
    "AcquireResult",
    "AsyncHold",
    "AsyncLeaseClient",
    "CanceledError",
    "CheckFenceResult",
    "ClientTls",
    "DeadlineExceededError",
    "Event",
    "GetResult",
    "HandoffRequest",
    "HandoffResult",
    "HistoryResult",
    "Hold",
    "HoldOptions",
    "InvalidArgumentError",
    "KeepAliveEvent",
    "LateGrantError",
    "Lease",
    "LeaseClient",
    "LeaseLostError",
    "LeaseNotHeldError",
    "LeaseholdError",
    "ListResult",
    "NotAcquiredError",
    "PermissionDeniedError",
    "ReleaseFailure",
    "ResourceExhaustedError",
    "RevokeResult",
    "SessionKey",
    "Snapshot",
    "StaleFencingTokenError",
    "UnauthenticatedError",
    "UnavailableError",
    "from_rpc_error",
]
