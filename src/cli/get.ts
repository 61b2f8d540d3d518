// `leasehold get`: who holds a session, and until when.

import { GetResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import { clientCommand, commonHelp, ExitCode, flagHelp, keyOptions, sessionKey } from "./common.js";
import { keyText, leaseText, printJson } from "./format.js";

export const getHelp = `Usage: leasehold get --account A --session S [flags]

Prints the authoritative state of one session: who holds it, with which
run and fencing token, and for how long; or that it is free.

Flags:
${flagHelp.account}
${flagHelp.session}

${commonHelp}
`;

export const get = clientCommand("get", getHelp, keyOptions, async ({ flags, client }) => {
  const key = sessionKey(flags);
  const response = await client.get({ key });
  if (flags.json) printJson(GetResponseSchema, response);
  else if (response.held && response.lease) {
    process.stdout.write(`${keyText(key)} is held by ${leaseText(response.lease)}\n`);
  } else process.stdout.write(`${keyText(key)} is free\n`);
  return ExitCode.ok;
});
