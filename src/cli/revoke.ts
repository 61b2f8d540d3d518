// `leasehold revoke`: ends a session's valid lease whatever its run (admin).

import { RevokeResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
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

export const revokeHelp = `Usage: leasehold revoke --account A --session S --reason TEXT [flags]

Ends the session's valid lease, whichever run holds it. Needs a token with
admin scope; the revocation and its reason are recorded in the history.
The run that held the lease learns it lost it at its next renewal.

Flags:
  --reason TEXT       why, for the audit trail (required)
${commonHelp}
`;

export function revoke(argv: string[]): Promise<number> {
  return runCommand("revoke", revokeHelp, argv, async () => {
    const { values } = parseCommandArgs(argv, { reason: { type: "string" } });
    const flags = commonFlags(values);
    const key = sessionKey(flags);
    const reason = required("reason", values.reason);
    const client = clientFor(flags);
    try {
      const response = await client.revoke({ key, reason });
      if (flags.json) printJson(RevokeResponseSchema, response);
      else if (response.revoked && response.lease) {
        process.stdout.write(`revoked ${keyText(key)}: was ${leaseText(response.lease)}\n`);
      } else process.stdout.write(`nothing to revoke: ${keyText(key)} is not held\n`);
      return ExitCode.ok;
    } finally {
      client.close();
    }
  });
}
