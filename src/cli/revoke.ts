// `leasehold revoke`: ends a session's valid lease whatever its run (admin).

import { RevokeResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientCommand,
  commonHelp,
  ExitCode,
  flagHelp,
  keyOptions,
  required,
  sessionKey,
} from "./common.js";
import { keyText, leaseText, printJson } from "./format.js";

export const revokeHelp = `Usage: leasehold revoke --account A --session S --reason TEXT [flags]

Ends the session's valid lease, whichever run holds it. Needs a token with
admin scope; the revocation and its reason are recorded in the history.
The run that held the lease learns it lost it at its next renewal.

Flags:
${flagHelp.account}
${flagHelp.session}
  --reason TEXT       why, for the audit trail (required)

${commonHelp}
`;

export const revoke = clientCommand(
  "revoke",
  revokeHelp,
  { ...keyOptions, reason: { type: "string" } },
  async ({ values, flags, client }) => {
    const key = sessionKey(flags);
    const reason = required("reason", values.reason);
    const response = await client.revoke({ key, reason });
    if (flags.json) printJson(RevokeResponseSchema, response);
    else if (response.revoked && response.lease) {
      process.stdout.write(`revoked ${keyText(key)}: was ${leaseText(response.lease)}\n`);
    } else process.stdout.write(`nothing to revoke: ${keyText(key)} is not held\n`);
    return ExitCode.ok;
  },
);
