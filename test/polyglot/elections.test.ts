// The election examples, proven: examples/typescript/election.ts,
// examples/python/election.py and examples/go/election (the binary
// examples/go/build.sh makes) as their own OS processes, one replica of each
// language campaigning in the same election against `leasehold serve` on a
// real PostgreSQL. One behaviour across clients: whichever language leads,
// the others take over the same way. The test reads what each example
// documents it prints (the TypeScript and Go examples a line of text per
// event, the Python one a JSON object) and the election's rows in
// lease_events; every step waits on a line or a row, never on a
// guessed sleep.

import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import { once } from "node:events";
import path from "node:path";
import { createInterface } from "node:readline";
import { afterEach, describe, expect, it, onTestFailed } from "vitest";
import type { SessionKey } from "../../src/lease/types.js";
import { useTestDatabase } from "../support/fixture.js";
import { freshKey } from "../support/leases.js";
import type { ServerProcess } from "../support/server.js";
import { repoRoot } from "../support/server-process.js";
import { waitFor } from "../support/wait.js";

type Language = "typescript" | "python" | "go";

/** The examples' TTL: 5 s in election.ts and examples/go/election, --ttl-ms's default in election.py. */
const ttlMs = 5_000;
const lineWaitMs = 30_000;

/** One event an example printed, in the Python example's names and fields. */
interface ElectionEvent {
  event: "leading" | "stopped_leading" | "leader" | "tick";
  term: bigint;
  /** stopped_leading: the StopReason's kind. */
  reason?: string;
  /** leader: the leader's advertised value. */
  value?: string;
  /** The order in which this test received the line, over every replica. */
  seq: number;
}

let received = 0;

/**
 * The TypeScript and Go examples' lines, as their sources print them:
 * `<name>: leading, term <n>`, `<name>: stopped leading term <n> (<kind>)`,
 * `<name>: the leader is <value>, term <n>`, `<name>: tick as leader, term <n>`.
 */
function parseText(name: string, line: string): Omit<ElectionEvent, "seq"> | undefined {
  const prefix = `${name}: `;
  if (!line.startsWith(prefix)) return undefined;
  const rest = line.slice(prefix.length);
  let m = /^leading, term (\d+)$/.exec(rest);
  if (m) return { event: "leading", term: BigInt(m[1] as string) };
  m = /^stopped leading term (\d+) \((\w+)\)$/.exec(rest);
  if (m) return { event: "stopped_leading", term: BigInt(m[1] as string), reason: m[2] as string };
  m = /^the leader is (.*), term (\d+)$/.exec(rest);
  if (m) return { event: "leader", value: m[1] as string, term: BigInt(m[2] as string) };
  m = /^tick as leader, term (\d+)$/.exec(rest);
  if (m) return { event: "tick", term: BigInt(m[1] as string) };
  return undefined;
}

/** The Python example's JSON lines: {"event", "lang": "python", "term", "reason" | "value"}. */
function parseJson(line: string): Omit<ElectionEvent, "seq"> | undefined {
  let parsed: Record<string, unknown>;
  try {
    parsed = JSON.parse(line) as Record<string, unknown>;
  } catch {
    return undefined;
  }
  const { event, term, reason, value } = parsed;
  if (parsed.lang !== "python" || typeof term !== "number") return undefined;
  if (
    event !== "leading" &&
    event !== "stopped_leading" &&
    event !== "leader" &&
    event !== "tick"
  ) {
    return undefined;
  }
  return {
    event,
    term: BigInt(term),
    ...(typeof reason === "string" ? { reason } : {}),
    ...(typeof value === "string" ? { value } : {}),
  };
}

class Replica {
  readonly events: ElectionEvent[] = [];
  readonly exited: Promise<unknown>;
  private output = "";
  private readonly listeners = new Set<() => void>();

  constructor(
    readonly lang: Language,
    readonly name: string,
    private readonly child: ChildProcessWithoutNullStreams,
  ) {
    this.exited = once(child, "exit");
    child.stderr.on("data", (chunk: Buffer) => {
      this.output += `(stderr) ${chunk.toString()}`;
    });
    createInterface({ input: child.stdout }).on("line", (line) => {
      this.output += `${line}\n`;
      const parsed = lang === "python" ? parseJson(line) : parseText(name, line);
      if (parsed === undefined) {
        this.output += "(not an event this test knows)\n";
        return;
      }
      received += 1;
      this.events.push({ ...parsed, seq: received });
      for (const listener of this.listeners) listener();
    });
    child.on("exit", () => {
      for (const listener of this.listeners) listener();
    });
  }

  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  /** The first event, printed already or still to come, named `event` and matching `where`. */
  next(
    event: ElectionEvent["event"],
    where: (e: ElectionEvent) => boolean = () => true,
    timeoutMs = lineWaitMs,
  ): Promise<ElectionEvent> {
    return new Promise((resolve, reject) => {
      const check = () => {
        const found = this.events.find((e) => e.event === event && where(e));
        if (found) {
          done();
          resolve(found);
        } else if (!this.running) {
          done();
          reject(
            this.failure(
              `exited (${this.child.exitCode ?? this.child.signalCode}) before "${event}"`,
            ),
          );
        }
      };
      const timer = setTimeout(() => {
        done();
        reject(this.failure(`no "${event}" within ${timeoutMs} ms`));
      }, timeoutMs);
      const done = () => {
        clearTimeout(timer);
        this.listeners.delete(check);
      };
      this.listeners.add(check);
      check();
    });
  }

  all(event: ElectionEvent["event"]): ElectionEvent[] {
    return this.events.filter((e) => e.event === event);
  }

  signal(name: NodeJS.Signals): void {
    this.child.kill(name);
  }

  async kill(): Promise<void> {
    if (this.running) {
      this.child.kill("SIGCONT");
      this.child.kill("SIGKILL");
    }
    await this.exited;
  }

  failure(what: string): Error {
    return new Error(
      `${this.lang} replica ${this.name}: ${what}\noutput:\n${this.output || "(nothing)"}`,
    );
  }
}

const { db, spawnServer } = useTestDatabase();
let replicas: Replica[] = [];

afterEach(async () => {
  const all = replicas;
  replicas = [];
  await Promise.all(all.map((r) => r.kill()));
});

/** Starts the election example of `lang` as `name`, campaigning in `key`'s election. */
function startReplica(
  lang: Language,
  name: string,
  server: ServerProcess,
  key: SessionKey,
): Replica {
  const hostPort = new URL(server.url).host;
  const commands: Record<Language, [string, string[]]> = {
    typescript: [
      // tsx as node's loader, not its CLI: the CLI runs the script in a
      // child process, which a SIGSTOP sent to the CLI would not freeze.
      process.execPath,
      ["--import", "tsx", "examples/typescript/election.ts", "--server", server.url],
    ],
    python: [
      path.join(repoRoot, "clients/python/.venv/bin/python"),
      ["examples/python/election.py", "--server", hostPort],
    ],
    go: [path.join(repoRoot, "examples/go/gen/bin/election"), ["--server", hostPort]],
  };
  const [file, args] = commands[lang];
  const child = spawn(
    file,
    [...args, "--account", key.accountId, "--election", key.sessionId, "--name", name],
    // No bearer token: the server runs in development mode on loopback.
    {
      cwd: repoRoot,
      env: { ...process.env, LEASEHOLD_TOKEN: "" },
      stdio: ["pipe", "pipe", "pipe"],
    },
  );
  const replica = new Replica(lang, name, child);
  replicas.push(replica);
  return replica;
}

interface EventRow {
  type: string;
  token: string | null;
  holder: string | null;
  at: Date;
}

async function electionEvents(key: SessionKey): Promise<EventRow[]> {
  return db.sql<EventRow[]>`
    SELECT type, fencing_token::text AS token, holder, at
    FROM lease_events
    WHERE account_id = ${key.accountId} AND session_id = ${key.sessionId}
    ORDER BY id`;
}

/** The grant of `term` in lease_events, waited for (the replica may print before the row is read). */
async function grantOf(key: SessionKey, term: bigint): Promise<EventRow> {
  return waitFor(
    async () =>
      (await electionEvents(key)).find((e) => e.type === "acquired" && e.token === term.toString()),
    { what: `the grant of term ${term} in lease_events` },
  );
}

/** The one replica that prints `leading` for a term above `above`, waited for on every replica. */
async function nextLeader(
  among: Replica[],
  above: bigint,
): Promise<{ leader: Replica; leading: ElectionEvent }> {
  const found = await waitFor(
    () => {
      const leading = among.flatMap((r) =>
        r
          .all("leading")
          .filter((e) => e.term > above)
          .map((e) => ({ leader: r, leading: e })),
      );
      return leading.length > 0 ? leading : undefined;
    },
    { what: `a replica leading with a term above ${above}`, timeoutMs: lineWaitMs },
  );
  // E1: one new leader, not two.
  expect(
    found.map((f) => f.leader.name),
    "replicas leading with a term above the last one",
  ).toHaveLength(1);
  return found[0] as { leader: Replica; leading: ElectionEvent };
}

/** The replicas' events of the term: ticks only between its `leading` and its `stopped_leading`. */
function expectTicksInsideTerm(replica: Replica, term: bigint) {
  const leading = replica.all("leading").find((e) => e.term === term);
  const stopped = replica.all("stopped_leading").find((e) => e.term === term);
  expect(leading, `${replica.name} led term ${term}`).toBeDefined();
  for (const tick of replica.all("tick").filter((e) => e.term === term)) {
    expect(tick.seq).toBeGreaterThan(leading?.seq ?? 0);
    if (stopped) expect(tick.seq).toBeLessThan(stopped.seq);
  }
}

describe("the election examples, one replica of each language in one election", () => {
  it("E1, S6, L2: one leads at a time, terms strictly increasing; a stopped leader says why and the next leads at once; a frozen leader has stopped on the database clock before its successor's grant, and campaigns again when it resumes", async () => {
    const server = await spawnServer();
    const key = freshKey("election-examples");
    const replicasOfThisTest = replicas;
    onTestFailed(async () => {
      // What every replica said and what the database recorded, to see why.
      const said = replicasOfThisTest.map((r) => r.failure("").message).join("\n");
      const rows = (await electionEvents(key))
        .map((e) => `  ${e.type} ${e.token} ${e.holder} ${e.at.toISOString()}`)
        .join("\n");
      console.error(`${said}\nlease_events:\n${rows}`);
    });
    const name = (lang: Language, n: number) => `${lang}-replica-${n}`;
    const started = new Map<Language, number>([
      ["typescript", 1],
      ["python", 1],
      ["go", 1],
    ]);
    let running = (["typescript", "python", "go"] as const).map((lang) =>
      startReplica(lang, name(lang, 1), server, key),
    );
    const terms: { term: bigint; leader: Replica }[] = [];

    // E1: exactly one of the three leads; each of the others is told so.
    let { leader, leading } = await nextLeader(running, 0n);
    terms.push({ term: leading.term, leader });

    /**
     * Waits until the leader acts: a tick of its term. A term may end
     * before its first tick, reported lost (L2: its local deadline passed;
     * the lease is left to expire on the server); then the next leader is
     * waited for, whose grant must come at or after that term's database
     * deadline.
     */
    const actingLeader = async () => {
      for (;;) {
        const term = leading.term;
        const first = await waitFor(
          () =>
            leader.events.find(
              (e) => e.term === term && (e.event === "tick" || e.event === "stopped_leading"),
            ),
          { what: `a tick or the end of ${leader.name}'s term ${term}`, timeoutMs: lineWaitMs },
        );
        if (first.event === "tick") return;
        expect(first.reason, `${leader.name}'s term ${term} ended before its first tick`).toBe(
          "lost",
        );
        const ended = leader;
        ({ leader, leading } = await nextLeader(running, term));
        terms.push({ term: leading.term, leader });
        const grant = await grantOf(key, leading.term);
        const expired = (await electionEvents(key)).find(
          (e) => e.type === "expired" && e.token === term.toString(),
        );
        expect(expired, `the 'expired' row of term ${term}`).toMatchObject({ holder: ended.name });
        expect(grant.at.getTime()).toBeGreaterThanOrEqual(expired?.at.getTime() ?? Infinity);
      }
    };
    await actingLeader();
    for (const other of running.filter((r) => r !== leader)) {
      await other.next("leader", (e) => e.value === leader.name && e.term === leading.term);
    }

    /**
     * Stops the leader with the signal a terminal or a supervisor sends: it
     * says its term was cancelled, exits, and its release lets the next one
     * lead at once — a higher term, granted right after the release, long
     * before the stopped term's TTL would have run out. A new replica of
     * the stopped one's language joins, so three campaign again.
     */
    const stopLeader = async (signal: NodeJS.Signals) => {
      const stopping = leader;
      const term = leading.term;
      stopping.signal(signal);
      const stopped = await stopping.next("stopped_leading", (e) => e.term === term);
      expect(stopped.reason, `${stopping.name} stopped by ${signal}`).toBe("cancelled");
      ({ leader, leading } = await nextLeader(
        running.filter((r) => r !== stopping),
        term,
      ));
      terms.push({ term: leading.term, leader });
      // E1, L2: the old leader said it stopped before the new one said it leads.
      expect(stopped.seq).toBeLessThan(leading.seq);
      const [code] = (await stopping.exited) as [number | null];
      expect(code, `${stopping.name}'s exit status after ${signal}`).toBe(0);
      const grant = await grantOf(key, leading.term);
      const released = (await electionEvents(key)).find(
        (e) => e.type === "released" && e.token === term.toString(),
      );
      expect(released, `the release of term ${term}`).toMatchObject({ holder: stopping.name });
      expect(grant.holder).toBe(leader.name);
      expect(grant.at.getTime()).toBeGreaterThanOrEqual(released?.at.getTime() ?? Infinity);
      expect(grant.at.getTime() - (released?.at.getTime() ?? 0)).toBeLessThan(ttlMs);
      const n = (started.get(stopping.lang) ?? 0) + 1;
      started.set(stopping.lang, n);
      running = [
        ...running.filter((r) => r !== stopping),
        startReplica(stopping.lang, name(stopping.lang, n), server, key),
      ];
      await actingLeader();
      return stopping;
    };

    /**
     * Freezes the leader with SIGSTOP: its renewals stop and nothing it
     * runs can act, and its successor is granted only once the frozen
     * term's database deadline has passed. Resumed with SIGCONT, it reports
     * that its term ended (lost: its deadline passed without a renewal),
     * does no leader's work with the old term, and campaigns again: it
     * leads once the ones before it in the queue have stopped.
     */
    const freezeLeader = async () => {
      const frozen = leader;
      const frozenTerm = leading.term;
      frozen.signal("SIGSTOP");
      ({ leader, leading } = await nextLeader(
        running.filter((r) => r !== frozen),
        frozenTerm,
      ));
      terms.push({ term: leading.term, leader });
      // L2 on the database clock. The takeover records the frozen term's
      // 'expired' row at that term's database deadline. The frozen
      // replica's local deadline was counted from when its last renewal
      // left, before the database renewed it, and ends a margin short of
      // the TTL: it is before the database deadline, which is at or before
      // the successor's grant.
      const successorGrant = await grantOf(key, leading.term);
      expect(successorGrant.holder).toBe(leader.name);
      const expired = (await electionEvents(key)).find(
        (e) => e.type === "expired" && e.token === frozenTerm.toString(),
      );
      expect(expired, `the 'expired' row of the frozen term ${frozenTerm}`).toMatchObject({
        holder: frozen.name,
      });
      expect(successorGrant.at.getTime()).toBeGreaterThanOrEqual(expired?.at.getTime() ?? Infinity);

      const resumedAt = received;
      frozen.signal("SIGCONT");
      const lost = await frozen.next("stopped_leading", (e) => e.term === frozenTerm);
      expect(lost.reason, `${frozen.name} resumed after its term expired`).toBe("lost");
      expect(
        frozen.all("tick").filter((e) => e.term === frozenTerm && e.seq > resumedAt),
        "ticks of the frozen term after it resumed",
      ).toEqual([]);
      expectTicksInsideTerm(frozen, frozenTerm);
      while (leader !== frozen) {
        if (!frozen.running)
          throw frozen.failure("exited after it resumed, instead of campaigning");
        await stopLeader("SIGTERM");
      }
      expect(leading.term).toBeGreaterThan(frozenTerm);
      await actingLeader();
      return frozen;
    };

    // Each language's leader is stopped once (SIGTERM and SIGINT in turn),
    // then each language's leader frozen once; a leader of a language done
    // already is stopped to move the election on.
    const stoppedLanguages = new Set<Language>();
    while (stoppedLanguages.size < 3) {
      const stopped = await stopLeader(stoppedLanguages.size % 2 === 0 ? "SIGTERM" : "SIGINT");
      stoppedLanguages.add(stopped.lang);
    }
    const frozenLanguages = new Set<Language>();
    while (frozenLanguages.size < 3) {
      if (frozenLanguages.has(leader.lang)) await stopLeader("SIGTERM");
      else frozenLanguages.add((await freezeLeader()).lang);
    }

    // S6, E1 over the whole run: terms strictly increasing in the order the
    // replicas said they lead, each one's grant in lease_events with its
    // leader's name, and every tick inside its own term.
    const ordered = terms.map((t) => t.term);
    for (let i = 1; i < ordered.length; i += 1) {
      expect(ordered[i]).toBeGreaterThan(ordered[i - 1] as bigint);
    }
    const grants = (await electionEvents(key)).filter((e) => e.type === "acquired");
    expect(grants.map((g) => ({ token: g.token, holder: g.holder }))).toEqual(
      terms.map((t) => ({ token: t.term.toString(), holder: t.leader.name })),
    );
    for (const { term, leader: who } of terms) expectTicksInsideTerm(who, term);
  });
});
