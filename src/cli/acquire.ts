// `leasehold acquire`: takes a session's lease once and prints it. The lease
// is not kept alive: renew it with `leasehold renew`, or use `leasehold run`.

import { randomUUID } from "node:crypto";
import { durationFromMs } from "../client/index.js";
import { AcquireResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientCommand,
  commonHelp,
  durationFlag,
  ExitCode,
  flagHelp,
  holderOption,
  keyOptions,
  sessionKey,
  ttlOption,
} from "./common.js";
import { keyText, leaseText, printJson } from "./format.js";

export const acquireHelp = `Usage: leasehold acquire --account A --session S [--ttl 10s] [--wait 5s] [flags]

Acquires the session's lease once and prints its run id and fencing token.
The lease is not renewed: it expires after --ttl unless you run
"leasehold renew" with the printed run id. Exits 75 when another run holds
the session (and says which).

Flags:
${flagHelp.account}
${flagHelp.session}
${flagHelp.ttl}
${flagHelp.holder}
  --wait DURATION     wait up to this long for the session to become free
  --run-id UUID       run id to use (retrying with the same one is idempotent)

${commonHelp}

Example:
  leasehold acquire --account acme --session s1 --ttl 30s --holder desktop
`;

export const acquire = clientCommand(
  "acquire",
  acquireHelp,
  {
    ...keyOptions,
    ...ttlOption,
    ...holderOption,
    wait: { type: "string" },
    "run-id": { type: "string" },
  },
  async ({ values, flags, client }) => {
    const key = sessionKey(flags);
    const waitMs = durationFlag("wait", values.wait, 0);
    const response = await client.acquire({
      key,
      runId: values["run-id"] ?? randomUUID(),
      ttl: durationFromMs(flags.ttlMs),
      wait: waitMs > 0 ? durationFromMs(waitMs) : undefined,
      holder: flags.holder,
    });
    if (flags.json) printJson(AcquireResponseSchema, response);
    if (response.acquired && response.lease) {
      if (!flags.json) {
        process.stdout.write(`acquired ${keyText(key)}: ${leaseText(response.lease)}\n`);
      }
      return ExitCode.ok;
    }
    if (!flags.json) {
      const by = response.current ? leaseText(response.current) : "another run";
      process.stdout.write(`not acquired: ${keyText(key)} is held by ${by}\n`);
    }
    return ExitCode.held;
  },
);
