// `leasehold renew`: extends a lease taken with `leasehold acquire`.

import { durationFromMs } from "../client/index.js";
import { RenewResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientFor,
  commonFlags,
  commonHelp,
  ExitCode,
  parseCommandArgs,
  required,
  runCommand,
  sessionKey,
} from "./common.js";
import { keyText, leaseText, printJson } from "./format.js";

export const renewHelp = `Usage: leasehold renew --account A --session S --run-id UUID [--ttl 10s] [flags]

Extends the run's valid lease. Without --ttl the lease keeps its TTL. Fails
(exit 1) with the cause when the run no longer holds the lease: expired,
released, taken over, revoked or not found.

Flags:
  --run-id UUID       the run whose lease to renew (required)
${commonHelp}
`;

export function renew(argv: string[]): Promise<number> {
  return runCommand("renew", renewHelp, argv, async () => {
    const { values } = parseCommandArgs(argv, { "run-id": { type: "string" } });
    const flags = commonFlags(values);
    const key = sessionKey(flags);
    const runId = required("run-id", values["run-id"]);
    const client = clientFor(flags);
    try {
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
    } finally {
      client.close();
    }
  });
}
