// `leasehold release`: ends a run's lease. Releasing nothing is not an error.

import { ReleaseResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientCommand,
  commonHelp,
  ExitCode,
  flagHelp,
  keyOptions,
  required,
  sessionKey,
} from "./common.js";
import { keyText, printJson } from "./format.js";

export const releaseHelp = `Usage: leasehold release --account A --session S --run-id UUID [flags]

Ends the run's valid lease. It can never end another run's lease; when the
run holds nothing (already released, expired, taken over) it says so and
still exits 0.

Flags:
${flagHelp.account}
${flagHelp.session}
  --run-id UUID       the run whose lease to release (required)

${commonHelp}
`;

export const release = clientCommand(
  "release",
  releaseHelp,
  { ...keyOptions, "run-id": { type: "string" } },
  async ({ values, flags, client }) => {
    const key = sessionKey(flags);
    const runId = required("run-id", values["run-id"]);
    const response = await client.release({ key, runId });
    if (flags.json) printJson(ReleaseResponseSchema, response);
    else if (response.released) process.stdout.write(`released ${keyText(key)} (run ${runId})\n`);
    else process.stdout.write(`nothing to release: run ${runId} does not hold ${keyText(key)}\n`);
    return ExitCode.ok;
  },
);
