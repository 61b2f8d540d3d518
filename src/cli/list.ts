// `leasehold list`: the valid leases of an account.

import { msFromDuration } from "../client/index.js";
import { ListResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  accountOption,
  clientCommand,
  commonHelp,
  ExitCode,
  required,
  UsageError,
} from "./common.js";
import { printJson, secondsText, table } from "./format.js";

export const listHelp = `Usage: leasehold list --account A [--page-size N] [flags]

Lists the valid leases of an account, by session id, following every page.
With --json, prints each page as one ListResponse per line.

Flags:
  --account ID        the account (required)
  --page-size N       leases per request (default: the server's)

${commonHelp}
`;

export const list = clientCommand(
  "list",
  listHelp,
  { ...accountOption, "page-size": { type: "string" } },
  async ({ values, flags, client }) => {
    const accountId = required("account", flags.account);
    const pageSizeText = values["page-size"];
    const pageSize = pageSizeText === undefined ? 0 : Number(pageSizeText);
    if (!Number.isInteger(pageSize) || pageSize < 0) {
      throw new UsageError(
        `--page-size must be a positive integer, got ${JSON.stringify(pageSizeText)}`,
      );
    }
    const rows: string[][] = [];
    let pageToken = "";
    do {
      const page = await client.list({ accountId, pageSize, pageToken });
      if (flags.json) printJson(ListResponseSchema, page);
      for (const lease of page.leases) {
        rows.push([
          lease.key?.sessionId ?? "",
          lease.holder,
          lease.fencingToken.toString(),
          secondsText(msFromDuration(lease.remaining)),
          lease.runId,
        ]);
      }
      pageToken = page.nextPageToken;
    } while (pageToken !== "");
    if (!flags.json) {
      if (rows.length === 0) process.stdout.write(`no valid leases in account ${accountId}\n`);
      else process.stdout.write(table(["SESSION", "HOLDER", "TOKEN", "LEFT", "RUN"], rows));
    }
    return ExitCode.ok;
  },
);
