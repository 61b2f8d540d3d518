// `leasehold renew`: extends a lease taken with `leasehold acquire`.

import { durationFromMs } from "../client/index.js";
import { RenewResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientCommand,
  commonHelp,
  ExitCode,
  flagHelp,
  keyOptions,
  required,
  sessionKey,
  ttlOption,
} from "./common.js";
import { keyText, leaseText, printJson } from "./format.js";

export const renewHelp = `Usage: leasehold renew --account A --session S --run-id UUID [--ttl 10s] [flags]

Extends the run's valid lease. Without --ttl the lease keeps its TTL. Fails
(exit 1) with the cause when the run no longer holds the lease: expired,
released, taken over, revoked or not found.

Flags:
${flagHelp.account}
${flagHelp.session}
  --run-id UUID       the run whose lease to renew (required)
  --ttl DURATION      a new TTL such as 30s or 1m (default: the lease's own)

${commonHelp}
`;

export const renew = clientCommand(
  "renew",
  renewHelp,
  { ...keyOptions, ...ttlOption, "run-id": { type: "string" } },
  async ({ values, flags, client }) => {
    const key = sessionKey(flags);
    const runId = required("run-id", values["run-id"]);
    const response = await client.renew({
      key,
      runId,
      ttl: values.ttl !== undefined ? durationFromMs(flags.ttlMs) : undefined,
    });
    if (flags.json) printJson(RenewResponseSchema, response);
    else if (response.lease) {
      process.stdout.write(`renewed ${keyText(key)}: ${leaseText(response.lease)}\n`);
    }
    return ExitCode.ok;
  },
);
