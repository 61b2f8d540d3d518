// `leasehold elect`: runs a command while this process leads an election
// (E1), or (--observe) prints every change of an election's leader.

import type { ChildProcess } from "node:child_process";
import os from "node:os";
import {
  campaign,
  type ElectionChange,
  type Keeper,
  type Leader,
  type Leadership,
  NotAcquiredError,
  observe,
} from "../client/index.js";
import {
  accountOption,
  clientFor,
  commonFlags,
  commonHelp,
  durationFlag,
  ExitCode,
  flagHelp,
  parseCommandArgs,
  required,
  runCommand,
  ttlOption,
  UsageError,
} from "./common.js";
import { checkSignal, forwardedSignals, SpawnError, superviseCommand } from "./supervise.js";

export const electHelp = `Usage: leasehold elect --account A --election E [--value V] [--ttl 10s] [--keeper | --lock-delay 5s] [flags] -- CMD [ARGS...]
       leasehold elect --observe --account A --election E [--json] [flags]

An election is a session of the account: its leader is the run that holds
the session's lease, its term is that lease's fencing token (strictly
increasing), its value the lease's holder label.

Campaigns (waits, in arrival order, until this process leads), then runs
CMD while it leads, and resigns when CMD ends (the next candidate is granted
at once); exits with CMD's exit code (128+N when CMD was killed by signal N).
CMD gets LEASEHOLD_FENCING_TOKEN (the term), LEASEHOLD_RUN_ID,
LEASEHOLD_ACCOUNT_ID, LEASEHOLD_SESSION_ID (the election) and
LEASEHOLD_SERVER in its environment: present the term with every write to a
guarded resource.

When leadership is lost (revoked, expired, or no renewal confirmed before
the local deadline) CMD gets SIGTERM before the database deadline, then
SIGKILL if it has not exited after --grace; elect does not campaign again.
With --timeout, gives up campaigning after that long, says who leads and
exits 75 without running CMD. SIGINT, SIGTERM and SIGHUP end the campaign,
or are passed on to CMD.

With --keeper (or --lock-delay) the campaign runs on a keeper opened for
this process (docs/keepers.md): the waiting Acquire and the leader's lease
ride its stream and its heartbeat keeps the lease (TTL --ttl). The keeper
lost while waiting ends the campaign; lost while leading, it ends the term.
A lock-delay keeps the election from every other candidate for that long
after the keeper expires (this process died or was cut off), not after a
resignation.

With --observe, prints the current leader, then one line per change (a new
term, a proclaimed value, a term ended with no successor: resigned, expired,
revoked) until interrupted; with --json one JSON object per line. It
reconnects to the next --server when its stream is lost and reads the
audit trail, so no term is left out.

Flags:
${flagHelp.account}
  --election NAME     the election (a session id of the account; required)
  --value V           the value this candidate advertises as leader, at most
                      64 characters (default: this host's name)
${flagHelp.ttl}
  --timeout DURATION  give up campaigning after this long (default: never)
  --grace DURATION    time between SIGTERM and SIGKILL (default 10s)
  --on-handoff SIG    send CMD this signal (e.g. SIGUSR1) when someone asks the
                      leader to hand over; by default only a message is printed
  --keeper            campaign on a keeper of its own (TTL --ttl)
  --lock-delay DURATION
                      the keeper's lock-delay (0 to the server's maximum,
                      default 0); implies --keeper
  --observe           print every change of the leader instead of campaigning
  --verbose           report the term and stream reconnects on stderr

${commonHelp}

Examples:
  leasehold elect --account acme --election scheduler --value "$(hostname)" -- ./scheduler
  leasehold elect --observe --account acme --election scheduler
`;

function leaderText(leader: Leader): string {
  const value = leader.value === "" ? "(no value)" : JSON.stringify(leader.value);
  const until = leader.expiresAt ? `, until ${leader.expiresAt.toISOString()}` : "";
  return `${value} (term ${leader.term}, run ${leader.runId}${until})`;
}

/** One line of --observe. */
export function changeText(election: string, change: ElectionChange): string {
  const at = new Date().toISOString();
  switch (change.type) {
    case "current":
      return `${at}  CURRENT     ${election}: ${change.leader ? leaderText(change.leader) : "no leader"}`;
    case "elected":
      return `${at}  ELECTED     ${election}: ${leaderText(change.leader)}`;
    case "proclaimed":
      return `${at}  PROCLAIMED  ${election}: ${leaderText(change.leader)}`;
    case "ended":
      return `${at}  ENDED       ${election}: term ${change.term} ${change.how}, no leader`;
  }
}

/** One JSON object of --observe --json (terms as strings, as protobuf JSON writes int64). */
export function changeJson(change: ElectionChange): string {
  const leader = (l: Leader | undefined) =>
    l === undefined
      ? null
      : {
          value: l.value,
          term: l.term.toString(),
          runId: l.runId,
          expiresAt: l.expiresAt?.toISOString() ?? null,
        };
  if (change.type === "ended") {
    return JSON.stringify({ type: change.type, term: change.term.toString(), how: change.how });
  }
  return JSON.stringify({ type: change.type, leader: leader(change.leader) });
}

export function elect(argv: string[]): Promise<number> {
  return runCommand("elect", electHelp, argv, async () => {
    const separator = argv.indexOf("--");
    const command = separator === -1 ? [] : argv.slice(separator + 1);
    const { values } = parseCommandArgs(separator === -1 ? argv : argv.slice(0, separator), {
      ...accountOption,
      ...ttlOption,
      election: { type: "string" },
      value: { type: "string" },
      timeout: { type: "string" },
      grace: { type: "string" },
      "on-handoff": { type: "string" },
      keeper: { type: "boolean" },
      "lock-delay": { type: "string" },
      observe: { type: "boolean" },
      verbose: { type: "boolean" },
    });
    const flags = commonFlags(values);
    const accountId = required("account", flags.account);
    const electionName = required("election", values.election);
    const key = { accountId, election: electionName };
    const name = `${accountId}/${electionName}`;
    const say = (line: string) => process.stderr.write(`leasehold elect: ${line}\n`);

    if (values.observe === true) {
      if (command.length > 0) throw new UsageError("--observe runs no command");
      if (values.keeper === true || values["lock-delay"] !== undefined) {
        throw new UsageError(
          "--observe campaigns on no keeper: leave out --keeper and --lock-delay",
        );
      }
      const client = clientFor(flags);
      const stop = new AbortController();
      const onSignal = () => stop.abort();
      process.once("SIGINT", onSignal);
      process.once("SIGTERM", onSignal);
      try {
        for await (const change of observe(client, key, { signal: stop.signal })) {
          process.stdout.write(`${flags.json ? changeJson(change) : changeText(name, change)}\n`);
        }
        return ExitCode.ok;
      } finally {
        process.off("SIGINT", onSignal);
        process.off("SIGTERM", onSignal);
        client.close();
      }
    }

    const [file, ...args] = command;
    if (file === undefined) throw new UsageError('the command to run goes after "--"');
    const timeoutMs =
      values.timeout === undefined ? undefined : durationFlag("timeout", values.timeout, 0);
    const graceMs = durationFlag("grace", values.grace, 10_000);
    const handoffSignal = checkSignal("on-handoff", values["on-handoff"]);
    const verbose = values.verbose === true;
    const value = values.value ?? [...os.hostname()].slice(0, 64).join("");
    const lockDelayMs = durationFlag("lock-delay", values["lock-delay"], 0);
    const onKeeper = values.keeper === true || values["lock-delay"] !== undefined;

    const client = clientFor(flags, (event) => {
      if (!verbose) return;
      if (event.type === "keepalive-failed") {
        say(`keep-alive stream to ${event.baseUrl} failed (${event.error.message}); reconnecting`);
      } else if (event.type === "keeper-failed" && event.retryInMs !== undefined) {
        say(`keeper stream to ${event.baseUrl} failed (${event.error.message}); re-attaching`);
      } else if (event.type === "release-failed") {
        say(`release failed (${event.error.message}); the term ends at its deadline`);
      }
    });
    const cancel = new AbortController();
    let child: ChildProcess | undefined;
    const onSignal = (signal: NodeJS.Signals) => {
      if (child) child.kill(signal);
      else cancel.abort(new Error(`interrupted by ${signal}`));
    };
    for (const s of forwardedSignals) process.on(s, onSignal);
    let leadership: Leadership | undefined;
    let keeper: Keeper | undefined;
    try {
      if (onKeeper) {
        keeper = await client.openKeeper({
          accountId,
          ttlMs: flags.ttlMs,
          lockDelayMs,
          holder: value,
          signal: cancel.signal,
        });
        if (verbose) say(`keeper ${keeper.id} open (lock-delay ${lockDelayMs}ms)`);
      }
      if (verbose) say(`campaigning in ${name} with value ${JSON.stringify(value)}`);
      leadership = await campaign(
        client,
        keeper
          ? { ...key, value, timeoutMs, keeper }
          : { ...key, value, ttlMs: flags.ttlMs, timeoutMs },
        { signal: cancel.signal },
      );
      if (verbose) say(`leading ${name}, term ${leadership.term}`);
      const held = leadership;
      return await superviseCommand(held, {
        file,
        args,
        env: {
          LEASEHOLD_FENCING_TOKEN: held.term.toString(),
          LEASEHOLD_RUN_ID: held.runId,
          LEASEHOLD_ACCOUNT_ID: accountId,
          LEASEHOLD_SESSION_ID: electionName,
          LEASEHOLD_SERVER: flags.servers.join(","),
        },
        graceMs,
        handoffSignal,
        what: `leadership of ${name} (term ${held.term})`,
        say,
        onSpawn: (spawned) => {
          child = spawned;
        },
      });
    } catch (error) {
      if (error instanceof NotAcquiredError) {
        const current = error.current;
        say(
          current
            ? `${name} not won within ${values.timeout}: led by ${JSON.stringify(current.holder)} (term ${current.fencingToken})`
            : error.lockDelayUntil
              ? `${name} is in its lock-delay until ${error.lockDelayUntil.toISOString()}`
              : `${name} not won: ${error.message}`,
        );
        return ExitCode.held;
      }
      if (error instanceof SpawnError) {
        say(error.message);
        return 127;
      }
      if (cancel.signal.aborted && child === undefined) {
        say(`${String((cancel.signal.reason as Error).message)} while campaigning`);
        return ExitCode.failure;
      }
      throw error;
    } finally {
      for (const s of forwardedSignals) process.off(s, onSignal);
      // Resigns (Release) unless leadership was lost: nothing is sent then.
      await leadership?.resign();
      await keeper?.close();
      client.close();
    }
  });
}
