// What the call policy (call-policy.ts) asks of a server's access rules: which
// services it guards, who the caller is, and whether each request message may
// be served for them. The lease server's rules are in src/server/rpc/access.ts,
// the guarded store's in src/guarded/caller-auth.ts. Implementations throw
// domain errors; the error table gives them their codes.

import type { DescMessage } from "@bufbuild/protobuf";
import type { Principal } from "../auth/authn.js";
import type { ClientCertificate } from "../auth/client-certificate.js";

export interface Access {
  /** Whether calls of this service are checked at all. */
  protects(serviceName: string): boolean;
  /**
   * The caller of a call of `methodName`, from its request headers (the
   * authorization header, and whatever else the headers already decide) and
   * its connection's client certificate; undefined in development mode.
   * Refuses bad credentials and a method the caller's scopes do not open.
   * Runs before the request's body is read.
   */
  caller(
    methodName: string,
    header: (name: string) => string | null,
    certificate: ClientCertificate | undefined,
  ): Promise<Principal | undefined>;
  /**
   * Checks one request message of the call: its account, then the session
   * authorizer. Returns the principal the call acts as (an anonymous one for
   * the request's account in development mode). `decided` remembers a
   * stream's session decisions for a while.
   */
  check(
    methodName: string,
    input: DescMessage,
    message: object,
    caller: Principal | undefined,
    decided?: Map<string, number>,
  ): Principal | undefined | Promise<Principal | undefined>;
}
