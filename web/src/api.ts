// The browser's LeaseService client: the Connect protocol over fetch, same
// origin as the page, with the bearer token (when one is given) on every call.

import {
  type Client,
  Code,
  ConnectError,
  createClient,
  type Interceptor,
} from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-web";
import { ErrorInfoSchema } from "../../src/gen/google/rpc/error_details_pb.js";
import { LeaseService } from "../../src/gen/leasehold/v1/lease_pb.js";
import { ErrorReason } from "../../src/protocol/errors.js";

export type LeaseClient = Client<typeof LeaseService>;

/** A client whose calls carry `authorization: Bearer <token()>` when token() is not empty. */
export function createLeaseClient(
  baseUrl: string,
  token: () => string,
  interceptors: Interceptor[] = [],
): LeaseClient {
  const bearer: Interceptor = (next) => (req) => {
    const value = token().trim();
    if (value !== "") req.header.set("authorization", `Bearer ${value}`);
    return next(req);
  };
  return createClient(
    LeaseService,
    createConnectTransport({ baseUrl, interceptors: [bearer, ...interceptors] }),
  );
}

/** The ErrorInfo reason and metadata of a Connect error, when the server sent one. */
export function errorInfo(error: unknown): { reason: string; metadata: Record<string, string> } {
  const ce = ConnectError.from(error);
  const [info] = ce.findDetails(ErrorInfoSchema);
  return { reason: info?.reason ?? "", metadata: info?.metadata ?? {} };
}

/** True for the answer that says a run no longer holds its lease (a definite loss). */
export function isLeaseNotHeld(error: unknown): boolean {
  const ce = ConnectError.from(error);
  return ce.code === Code.FailedPrecondition && errorInfo(ce).reason === ErrorReason.leaseNotHeld;
}

/** A short human text for an error: its code name and the server's message. */
export function describeError(error: unknown): string {
  const ce = ConnectError.from(error);
  return ce.rawMessage === "" ? Code[ce.code] : `${Code[ce.code]}: ${ce.rawMessage}`;
}
