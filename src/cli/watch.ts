// `leasehold watch`: prints a session's (or an account's) state, then every
// change, until interrupted.

import { WatchResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientFor,
  commonFlags,
  commonHelp,
  ExitCode,
  parseCommandArgs,
  required,
  runCommand,
} from "./common.js";
import { eventText, keyText, leaseText, printJson, timeText } from "./format.js";

export const watchHelp = `Usage: leasehold watch --account A [--session S] [--renewals] [flags]

Prints the valid leases in scope (a snapshot), then one line per change:
ACQUIRED, RELEASED, EXPIRED, REVOKED, HANDOFF_REQUESTED (and RENEWED with
--renewals). Without --session it watches every session of the account.
A new snapshot is printed whenever the server cannot vouch that no change
was missed. Runs until interrupted (Ctrl-C); with --json prints one
WatchResponse per line.

Flags:
  --renewals          also print every renewal
${commonHelp}
`;

export function watch(argv: string[]): Promise<number> {
  return runCommand("watch", watchHelp, argv, async () => {
    const { values } = parseCommandArgs(argv, { renewals: { type: "boolean" } });
    const flags = commonFlags(values);
    const accountId = required("account", flags.account);
    const key = { accountId, sessionId: flags.session ?? "" };
    const client = clientFor(flags);
    const stop = new AbortController();
    const onSignal = () => stop.abort();
    process.once("SIGINT", onSignal);
    process.once("SIGTERM", onSignal);
    try {
      for await (const message of client.watch(
        { key, includeRenewals: values.renewals === true },
        { signal: stop.signal },
      )) {
        if (flags.json) {
          printJson(WatchResponseSchema, message);
          continue;
        }
        const kind = message.kind;
        if (kind.case === "snapshot") {
          const leases = kind.value.leases;
          const scope = key.sessionId === "" ? `account ${accountId}` : keyText(key);
          process.stdout.write(
            `${timeText(kind.value.at)}  SNAPSHOT           ${scope}: ${leases.length} valid lease${leases.length === 1 ? "" : "s"}\n`,
          );
          for (const lease of leases) {
            process.stdout.write(`  ${keyText(lease.key)} held by ${leaseText(lease)}\n`);
          }
        } else if (kind.case === "event") {
          process.stdout.write(`${eventText(kind.value)}\n`);
        }
      }
      if (stop.signal.aborted) return ExitCode.ok;
      process.stderr.write("leasehold watch: the server ended the stream\n");
      return ExitCode.unavailable;
    } catch (error) {
      if (stop.signal.aborted) return ExitCode.ok;
      throw error;
    } finally {
      process.off("SIGINT", onSignal);
      process.off("SIGTERM", onSignal);
      client.close();
    }
  });
}
