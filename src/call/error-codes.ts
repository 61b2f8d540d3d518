// The one home of error codes: the table from domain errors to Connect codes,
// messages and details, which the call policy (call-policy.ts) applies to
// every call, once. Handlers and policy steps throw domain errors as they are.
// There are no user-defined codes: every answer uses the fixed gRPC set.

import { create } from "@bufbuild/protobuf";
import { type Any, AnySchema, anyPack } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import {
  BadRequest_FieldViolationSchema,
  BadRequestSchema,
  ErrorInfoSchema,
} from "../gen/google/rpc/error_details_pb.js";
import { type Status, StatusSchema } from "../gen/google/rpc/status_pb.js";
import {
  DatabaseTimeoutError,
  DatabaseUnavailableError,
  InvalidArgumentError,
  KeeperNotHeldError,
  LeaseNotHeldError,
  NotFoundError,
  PermissionDeniedError,
  ResourceExhaustedError,
  StaleFencingTokenError,
  UnauthenticatedError,
} from "../lease/errors.js";
import { ErrorMetadata, ErrorReason, errorDomain } from "../protocol/errors.js";
import { requestParseErrorAsInvalidArgument } from "./parse-errors.js";

function errorInfo(reason: string, metadata: Record<string, string>) {
  return { desc: ErrorInfoSchema, value: { reason, domain: errorDomain, metadata } };
}

/**
 * Maps any error thrown by a handler to a ConnectError. Unknown errors become
 * INTERNAL with a generic message: they are bugs, never caused by input.
 */
export function toConnectError(error: unknown): ConnectError {
  if (error instanceof ConnectError) return requestParseErrorAsInvalidArgument(error);
  if (error instanceof InvalidArgumentError) {
    return new ConnectError(error.message, Code.InvalidArgument, undefined, [
      {
        desc: BadRequestSchema,
        value: create(BadRequestSchema, {
          fieldViolations: [
            create(BadRequest_FieldViolationSchema, {
              field: error.field,
              description: error.rule,
            }),
          ],
        }),
      },
      errorInfo(ErrorReason.invalidArgument, { [ErrorMetadata.field]: error.field }),
    ]);
  }
  if (error instanceof LeaseNotHeldError) {
    return new ConnectError(error.message, Code.FailedPrecondition, undefined, [
      errorInfo(ErrorReason.leaseNotHeld, { [ErrorMetadata.cause]: error.reason }),
    ]);
  }
  if (error instanceof KeeperNotHeldError) {
    return new ConnectError(error.message, Code.FailedPrecondition, undefined, [
      errorInfo(ErrorReason.keeperNotHeld, { [ErrorMetadata.cause]: error.ended }),
    ]);
  }
  if (error instanceof StaleFencingTokenError) {
    return new ConnectError(error.message, Code.Aborted, undefined, [
      errorInfo(ErrorReason.staleFencingToken, {
        [ErrorMetadata.presentedToken]: error.presented.toString(),
        [ErrorMetadata.highestToken]: error.highest.toString(),
      }),
    ]);
  }
  if (error instanceof NotFoundError) {
    return new ConnectError(error.message, Code.NotFound);
  }
  if (error instanceof ResourceExhaustedError) {
    return new ConnectError(error.message, Code.ResourceExhausted, undefined, [
      errorInfo(ErrorReason.limitExceeded, {
        [ErrorMetadata.limit]: error.limit,
        [ErrorMetadata.max]: String(error.max),
      }),
    ]);
  }
  if (error instanceof PermissionDeniedError) {
    return new ConnectError(error.message, Code.PermissionDenied);
  }
  if (error instanceof UnauthenticatedError) {
    return new ConnectError(error.message, Code.Unauthenticated, undefined, [
      errorInfo(ErrorReason.unauthenticated, { [ErrorMetadata.cause]: error.failure }),
    ]);
  }
  if (error instanceof DatabaseUnavailableError) {
    return new ConnectError(error.message, Code.Unavailable, undefined, [
      errorInfo(ErrorReason.databaseUnavailable, {
        [ErrorMetadata.sqlState]: error.sqlState ?? "",
      }),
    ]);
  }
  if (error instanceof DatabaseTimeoutError) {
    return new ConnectError(error.message, Code.DeadlineExceeded);
  }
  return new ConnectError("internal error", Code.Internal, undefined, undefined, error);
}

/**
 * An error as one request's answer inside a stream (a Keep request's
 * `error`, a KeepAlive renewal's `undecided`): the code, message and
 * details this table gives it, as a google.rpc.Status.
 */
export function statusOf(error: unknown): Status {
  const ce = toConnectError(error);
  const details: Any[] = ce.details.map((d) =>
    "desc" in d
      ? anyPack(d.desc, create(d.desc, d.value))
      : create(AnySchema, { typeUrl: `type.googleapis.com/${d.type}`, value: d.value }),
  );
  return create(StatusSchema, { code: ce.code, message: ce.rawMessage, details });
}
