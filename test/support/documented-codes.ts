// The codes a hostile request may be answered with: each names what the
// caller got wrong or may not do. Never INTERNAL, UNKNOWN or anything else.

import { Code } from "@connectrpc/connect";

export const documentedCodes: ReadonlySet<Code> = new Set([
  Code.InvalidArgument,
  Code.FailedPrecondition,
  Code.PermissionDenied,
  Code.Unauthenticated,
  Code.ResourceExhausted,
]);
