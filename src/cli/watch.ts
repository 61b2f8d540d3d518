// `leasehold watch`: prints a session's (or an account's) state, then every
// change, until interrupted.

import { setTimeout as sleep } from "node:timers/promises";
import { CanceledError, DeadlineExceededError, UnavailableError } from "../client/errors.js";
import { type WatchResponse, WatchResponseSchema } from "../gen/leasehold/v1/lease_pb.js";
import {
  clientFor,
  commonFlags,
  commonHelp,
  ExitCode,
  keyOptions,
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

When an established stream is lost (the server restarts or shuts down, the
connection drops), watch says so on stderr and connects again, to the next
--server in turn, with backoff (up to 5s); the first message after that is a
fresh snapshot. A refusal (bad token, no permission, bad flags) ends it.

Flags:
  --account ID        the account (required)
  --session ID        only this session (default every session of the account)
  --renewals          also print every renewal

${commonHelp}
`;

const reconnectInitialMs = 100;
const reconnectMaxMs = 5_000;

/** Errors after which watching again can succeed: the stream or its server went away. */
function retryable(error: unknown): boolean {
  return (
    error instanceof UnavailableError ||
    error instanceof CanceledError ||
    error instanceof DeadlineExceededError
  );
}

export function watch(argv: string[]): Promise<number> {
  return runCommand("watch", watchHelp, argv, async () => {
    const { values } = parseCommandArgs(argv, { ...keyOptions, renewals: { type: "boolean" } });
    const flags = commonFlags(values);
    const accountId = required("account", flags.account);
    const key = { accountId, sessionId: flags.session ?? "" };
    const stop = new AbortController();
    const onSignal = () => stop.abort();
    process.once("SIGINT", onSignal);
    process.once("SIGTERM", onSignal);

    const print = (message: WatchResponse) => {
      if (flags.json) {
        printJson(WatchResponseSchema, message);
        return;
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
    };

    // One stream at a time; each attempt starts at the next server.
    let established = false;
    let failures = 0;
    try {
      for (let attempt = 0; !stop.signal.aborted; attempt++) {
        const servers = flags.servers.map(
          (_, i) => flags.servers[(attempt + i) % flags.servers.length] as string,
        );
        const client = clientFor({ ...flags, servers });
        let lost: string;
        try {
          for await (const message of client.watch(
            { key, includeRenewals: values.renewals === true },
            { signal: stop.signal },
          )) {
            established = true;
            failures = 0;
            print(message);
          }
          lost = "the server ended the stream";
        } catch (error) {
          if (stop.signal.aborted) return ExitCode.ok;
          // Before any stream was established, a failure is the answer
          // (an unreachable server: exit 69, as every command does).
          if (!established || !retryable(error)) throw error;
          lost = (error as Error).message;
        } finally {
          client.close();
        }
        if (stop.signal.aborted) return ExitCode.ok;
        if (!established) {
          process.stderr.write("leasehold watch: the server ended the stream\n");
          return ExitCode.unavailable;
        }
        failures += 1;
        const capMs = Math.min(reconnectMaxMs, reconnectInitialMs * 2 ** Math.min(failures, 10));
        const delayMs = Math.round(capMs / 2 + (Math.random() * capMs) / 2);
        process.stderr.write(
          `leasehold watch: stream lost (${lost}); watching again in ${(delayMs / 1000).toFixed(1)}s\n`,
        );
        await sleep(delayMs, undefined, { signal: stop.signal }).catch(() => undefined);
      }
      return ExitCode.ok;
    } finally {
      process.off("SIGINT", onSignal);
      process.off("SIGTERM", onSignal);
    }
  });
}
