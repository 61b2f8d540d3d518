// `leasehold run -- CMD`: holds a session's lease while CMD runs, and stops
// CMD when the lease is lost (L2): SIGTERM, then SIGKILL after a grace.

import type { ChildProcess } from "node:child_process";
import { type Keeper, type LeaseContext, NotAcquiredError } from "../client/index.js";
import {
  clientFor,
  commonFlags,
  commonHelp,
  durationFlag,
  ExitCode,
  flagHelp,
  holderOption,
  keyOptions,
  parseCommandArgs,
  runCommand,
  sessionKey,
  ttlOption,
  UsageError,
} from "./common.js";
import { keyText, leaseText } from "./format.js";
import { checkSignal, forwardedSignals, SpawnError, superviseCommand } from "./supervise.js";

export const runHelp = `Usage: leasehold run --account A --session S [--ttl 10s] [--keeper | --lock-delay 5s] [flags] -- CMD [ARGS...]

Acquires the session's lease, runs CMD while keeping the lease alive, and
releases it when CMD ends; exits with CMD's exit code (128+N when CMD was
killed by signal N). CMD gets LEASEHOLD_FENCING_TOKEN, LEASEHOLD_RUN_ID,
LEASEHOLD_ACCOUNT_ID, LEASEHOLD_SESSION_ID and LEASEHOLD_SERVER in its
environment: present the token with every write to a guarded resource.

When the lease is lost (taken over, revoked, expired, or no renewal
confirmed before the local deadline) CMD gets SIGTERM, then SIGKILL if it
has not exited after --grace. When the session is held by another run, it
says by whom and exits 75 without running CMD. SIGINT, SIGTERM and SIGHUP
are passed on to CMD.

With --keeper (or --lock-delay) the lease is held on a keeper opened for
this run (docs/keepers.md): its heartbeat keeps the lease, its stream
carries the acquire and the release, and it is closed when CMD ends. A
keeper's lock-delay keeps the session from every other run for that long
after the keeper expires (this process died or was cut off), not after a
clean end; a run refused by it says until when.

Flags:
${flagHelp.account}
${flagHelp.session}
${flagHelp.ttl}
${flagHelp.holder}
  --wait DURATION     wait up to this long for the session to become free
  --grace DURATION    time between SIGTERM and SIGKILL (default 10s)
  --keeper            hold the lease on a keeper of its own (TTL --ttl)
  --lock-delay DURATION
                      the keeper's lock-delay (0 to the server's maximum,
                      default 0); implies --keeper
  --on-handoff SIG    send CMD this signal (e.g. SIGUSR1) when another holder
                      asks for the session; by default only a message is printed
  --verbose           report the lease and stream reconnects on stderr

${commonHelp}

Example:
  leasehold run --account acme --session s2 --ttl 5s -- sh -c 'echo token=$LEASEHOLD_FENCING_TOKEN'
`;

export function run(argv: string[]): Promise<number> {
  return runCommand("run", runHelp, argv, async () => {
    const separator = argv.indexOf("--");
    const command = separator === -1 ? [] : argv.slice(separator + 1);
    const { values } = parseCommandArgs(separator === -1 ? argv : argv.slice(0, separator), {
      ...keyOptions,
      ...ttlOption,
      ...holderOption,
      wait: { type: "string" },
      grace: { type: "string" },
      "on-handoff": { type: "string" },
      keeper: { type: "boolean" },
      "lock-delay": { type: "string" },
      verbose: { type: "boolean" },
    });
    const [file, ...args] = command;
    if (file === undefined) throw new UsageError('the command to run goes after "--"');
    const flags = commonFlags(values);
    const key = sessionKey(flags);
    const waitMs = durationFlag("wait", values.wait, 0);
    const graceMs = durationFlag("grace", values.grace, 10_000);
    const handoffSignal = checkSignal("on-handoff", values["on-handoff"]);
    const verbose = values.verbose === true;
    const lockDelayMs = durationFlag("lock-delay", values["lock-delay"], 0);
    const onKeeper = values.keeper === true || values["lock-delay"] !== undefined;
    const say = (line: string) => process.stderr.write(`leasehold run: ${line}\n`);

    const client = clientFor(flags, (event) => {
      if (!verbose) return;
      if (event.type === "keepalive-failed") {
        say(`keep-alive stream to ${event.baseUrl} failed (${event.error.message}); reconnecting`);
      } else if (event.type === "keeper-failed" && event.retryInMs !== undefined) {
        say(`keeper stream to ${event.baseUrl} failed (${event.error.message}); re-attaching`);
      } else if (event.type === "release-failed") {
        say(`release failed (${event.error.message}); the lease ends at its deadline`);
      }
    });
    const acquiring = new AbortController();
    let child: ChildProcess | undefined;
    const onSignal = (signal: NodeJS.Signals) => {
      if (child) child.kill(signal);
      else acquiring.abort(new Error(`interrupted by ${signal}`));
    };
    for (const s of forwardedSignals) process.on(s, onSignal);
    let keeper: Keeper | undefined;
    try {
      const work = (ctx: LeaseContext) => {
        if (verbose) say(`holding ${keyText(key)}: ${leaseText(ctx.lease)}`);
        return superviseCommand(ctx, {
          file,
          args,
          env: {
            LEASEHOLD_FENCING_TOKEN: ctx.fencingToken.toString(),
            LEASEHOLD_RUN_ID: ctx.runId,
            LEASEHOLD_ACCOUNT_ID: key.accountId,
            LEASEHOLD_SESSION_ID: key.sessionId,
            LEASEHOLD_SERVER: flags.servers.join(","),
          },
          graceMs,
          handoffSignal,
          what: `lease on ${keyText(key)}`,
          say,
          onSpawn: (spawned) => {
            child = spawned;
          },
        });
      };
      if (!onKeeper) {
        return await client.runExclusive(key, work, {
          ttlMs: flags.ttlMs,
          waitMs,
          holder: flags.holder,
          signal: acquiring.signal,
        });
      }
      keeper = await client.openKeeper({
        accountId: key.accountId,
        ttlMs: flags.ttlMs,
        lockDelayMs,
        holder: flags.holder,
        signal: acquiring.signal,
      });
      if (verbose) say(`keeper ${keeper.id} open (lock-delay ${lockDelayMs}ms)`);
      return await keeper.runExclusive(key, work, {
        waitMs,
        holder: flags.holder,
        signal: acquiring.signal,
      });
    } catch (error) {
      if (error instanceof NotAcquiredError) {
        say(
          error.current
            ? `${keyText(key)} is held by ${leaseText(error.current)}`
            : error.lockDelayUntil
              ? `${keyText(key)} is in its lock-delay until ${error.lockDelayUntil.toISOString()}`
              : `${keyText(key)} was not acquired: ${error.message}`,
        );
        return ExitCode.held;
      }
      if (error instanceof SpawnError) {
        say(error.message);
        return 127;
      }
      if (acquiring.signal.aborted && child === undefined) {
        say(`${String((acquiring.signal.reason as Error).message)} while acquiring`);
        return ExitCode.failure;
      }
      throw error;
    } finally {
      for (const s of forwardedSignals) process.off(s, onSignal);
      await keeper?.close();
      client.close();
    }
  });
}
