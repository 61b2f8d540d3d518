// `leasehold history`: the audit trail of a session, newest first.

import { HistoryResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientCommand,
  commonHelp,
  ExitCode,
  flagHelp,
  keyOptions,
  sessionKey,
  UsageError,
} from "./common.js";
import { eventText, keyText, printJson } from "./format.js";

export const historyHelp = `Usage: leasehold history --account A --session S [--limit N] [flags]

Prints the audit trail of one session, newest first: grants, releases,
expiries, revocations and handoff requests, with run, token, holder and
the database time of each.

Flags:
${flagHelp.account}
${flagHelp.session}
  --limit N           print at most N events (default 50; 0 for all)

${commonHelp}
`;

export const history = clientCommand(
  "history",
  historyHelp,
  { ...keyOptions, limit: { type: "string" } },
  async ({ values, flags, client }) => {
    const key = sessionKey(flags);
    const limitText = values.limit ?? "50";
    const limit = Number(limitText);
    if (!Number.isInteger(limit) || limit < 0) {
      throw new UsageError(`--limit must be an integer >= 0, got ${JSON.stringify(limitText)}`);
    }
    let printed = 0;
    let pageToken = "";
    do {
      const pageSize = limit === 0 ? 0 : Math.min(limit - printed, 1000);
      const page = await client.history({ key, pageSize, pageToken });
      const events = limit === 0 ? page.events : page.events.slice(0, limit - printed);
      if (flags.json) printJson(HistoryResponseSchema, { ...page, events });
      else for (const event of events) process.stdout.write(`${eventText(event)}\n`);
      printed += events.length;
      pageToken = page.nextPageToken;
    } while (pageToken !== "" && (limit === 0 || printed < limit));
    if (!flags.json && printed === 0) process.stdout.write(`no history for ${keyText(key)}\n`);
    return ExitCode.ok;
  },
);
