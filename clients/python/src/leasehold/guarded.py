"""The guarded store's API (``leasehold.guarded.v1.GuardedStoreService``,
proto/leasehold/guarded/v1): its stub and messages, for writing a session's
documents with a lease's fencing token. The stub takes a ``grpc`` channel or
a ``grpc.aio`` one; ``leasehold.from_rpc_error`` maps its errors as the
lease clients do (a stale token is ``StaleFencingTokenError``)."""

from ._gen.leasehold.guarded.v1.guarded_pb2 import (
    DocumentInfo,
    GetRequest,
    GetResponse,
    ListRequest,
    ListResponse,
    PutRequest,
    PutResponse,
)
from ._gen.leasehold.guarded.v1.guarded_pb2_grpc import GuardedStoreServiceStub

__all__ = [
    "DocumentInfo",
    "GetRequest",
    "GetResponse",
    "GuardedStoreServiceStub",
    "ListRequest",
    "ListResponse",
    "PutRequest",
    "PutResponse",
]
