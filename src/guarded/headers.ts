// The request headers that carry a fencing token to a downstream service
// (DESIGN §5). The client library sets them; the fencing interceptor reads
// them. Header names are the field names of every error about them.

import { InvalidArgumentError } from "../lease/errors.js";
import type { Limits } from "../lease/limits.js";
import type { SessionKey } from "../lease/types.js";
import { checkId } from "../lease/validation.js";
import { fencingHeaderNames } from "../protocol/headers.js";

/** The session and token a request claims to write with. */
export interface FenceClaim {
  key: SessionKey;
  token: bigint;
}

const maxToken = 9_223_372_036_854_775_807n;

/** Reads and validates the three headers; throws InvalidArgumentError naming the header. */
export function readFenceClaim(headers: Headers, limits: Pick<Limits, "maxIdLength">): FenceClaim {
  const text = required(headers, fencingHeaderNames.fencingToken);
  // Only plain decimal digits: no sign, spaces, exponent or hex that a
  // lenient parser would turn into some other number.
  if (!/^\d{1,19}$/.test(text) || BigInt(text) > maxToken) {
    throw new InvalidArgumentError(
      fencingHeaderNames.fencingToken,
      `must be a decimal int64 fencing token, got ${JSON.stringify(clip(text))}`,
    );
  }
  const token = BigInt(text);
  if (token <= 0n) {
    throw new InvalidArgumentError(
      fencingHeaderNames.fencingToken,
      `must be a positive fencing token, got ${token}`,
    );
  }
  return {
    key: {
      accountId: checkId(
        fencingHeaderNames.accountId,
        required(headers, fencingHeaderNames.accountId),
        limits,
      ),
      sessionId: checkId(
        fencingHeaderNames.sessionId,
        required(headers, fencingHeaderNames.sessionId),
        limits,
      ),
    },
    token,
  };
}

/** The headers a client sends to write with `claim`. */
export function fenceClaimHeaders(claim: FenceClaim): Record<string, string> {
  return {
    [fencingHeaderNames.fencingToken]: claim.token.toString(),
    [fencingHeaderNames.accountId]: claim.key.accountId,
    [fencingHeaderNames.sessionId]: claim.key.sessionId,
  };
}

function required(headers: Headers, name: string): string {
  const value = headers.get(name);
  if (value === null || value === "") throw new InvalidArgumentError(name, "is required");
  return value;
}

function clip(value: string): string {
  return value.length > 40 ? `${value.slice(0, 40)}…` : value;
}
