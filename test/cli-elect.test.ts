// `leasehold elect` as a real process against a real server: CMD runs while
// the process leads, with the term as its fencing token; a waiting
// candidate's CMD starts when the leader's term ends; CMD is stopped when
// leadership is lost (L2); --observe prints every change.

import { randomUUID } from "node:crypto";
import { describe, expect, it } from "vitest";
import { campaign } from "../src/client/index.js";
import { runCli, startCli } from "./support/cli.js";
import { useTestServer } from "./support/fixture.js";
import { waitFor } from "./support/wait.js";

const { db, server, library: client } = useTestServer();

const election = (prefix: string) => ({ accountId: "acme", election: `${prefix}-${randomUUID()}` });

const electOn = (e: { accountId: string; election: string }) => [
  ...["elect", "--server", server.url],
  ...["--account", e.accountId, "--election", e.election],
];

async function grants(e: { accountId: string; election: string }) {
  return db.sql<{ type: string; fencingToken: bigint; holder: string }[]>`
    SELECT type, fencing_token, holder FROM lease_events
    WHERE account_id = ${e.accountId} AND session_id = ${e.election} ORDER BY id`;
}

describe("leasehold elect", () => {
  it("E1, S6: CMD runs as leader with the term as LEASEHOLD_FENCING_TOKEN; elect resigns when it ends and exits with its code", async () => {
    const e = election("cmd");
    const result = await runCli([
      ...electOn(e),
      ...["--value", "node-1", "--ttl", "5s", "--"],
      process.execPath,
      "-e",
      "console.log('term=' + process.env.LEASEHOLD_FENCING_TOKEN + ' election=' + process.env.LEASEHOLD_SESSION_ID); process.exit(3)",
    ]);
    expect(result.code).toBe(3);
    const events = await grants(e);
    expect(events.map((x) => [x.type, x.holder])).toEqual([
      ["acquired", "node-1"],
      ["released", "node-1"],
    ]);
    expect(result.stdout).toBe(`term=${events[0]?.fencingToken} election=${e.election}\n`);
  });

  it("E1, L2: a waiting candidate's CMD starts once the leader's term ends; a revoked leader's CMD is stopped", async () => {
    const e = election("two");
    const first = startCli([
      ...electOn(e),
      ...["--value", "first", "--ttl", "5s", "--grace", "2s", "--"],
      process.execPath,
      "-e",
      `process.on("SIGTERM", () => { console.log("first stopped"); process.exit(0); });
       console.log("first leads " + process.env.LEASEHOLD_FENCING_TOKEN);
       setInterval(() => {}, 1000);`,
    ]);
    const firstTerm = BigInt((await first.line(/^first leads \d+$/)).split(" ")[2] ?? "0");
    const second = startCli([
      ...electOn(e),
      ...["--value", "second", "--ttl", "5s", "--"],
      process.execPath,
      "-e",
      "console.log('second leads ' + process.env.LEASEHOLD_FENCING_TOKEN)",
    ]);
    await waitFor(() => server.streaming.waiters.stats.waiting >= 1, {
      what: "the second candidate waiting",
    });
    await client.revoke({
      key: { accountId: e.accountId, sessionId: e.election },
      reason: "operator",
    });
    const firstResult = await first.exited;
    expect(firstResult.stdout).toContain("first stopped");
    expect(firstResult.stderr).toMatch(/leadership of .* lost: .*revoked.*stopping/);
    const secondResult = await second.exited;
    expect(secondResult.code).toBe(0);
    const secondTerm = BigInt(secondResult.stdout.trim().split(" ")[2] ?? "0");
    expect(secondTerm).toBeGreaterThan(firstTerm);
  });

  it("E1: with --timeout it gives up, names the leader and exits 75 without running CMD", async () => {
    const e = election("timeout");
    const leading = await campaign(client, { ...e, value: "holder", ttlMs: 30_000 });
    const result = await runCli([
      ...electOn(e),
      ...["--timeout", "300ms", "--"],
      process.execPath,
      "-e",
      "console.log('should not run')",
    ]);
    expect(result.code).toBe(75);
    expect(result.stdout).toBe("");
    expect(result.stderr).toContain(`led by "holder" (term ${leading.term})`);
    await leading.resign();
  });

  it("E1: --observe --json prints the current leader, then every change, one per line", async () => {
    const e = election("observe");
    const watch = startCli([...electOn(e), "--observe", "--json"]);
    try {
      await watch.line(/"type":"current"/);
      const one = await campaign(client, { ...e, value: "one", ttlMs: 30_000 });
      await watch.line(/"type":"elected"/);
      await one.proclaim("one-b");
      await watch.line(/"type":"proclaimed"/);
      await one.resign();
      await watch.line(/"type":"ended"/);
      expect(watch.lines.map((l) => JSON.parse(l))).toEqual([
        { type: "current", leader: null },
        {
          type: "elected",
          leader: expect.objectContaining({ value: "one", term: one.term.toString() }),
        },
        {
          type: "proclaimed",
          leader: expect.objectContaining({ value: "one-b", term: one.term.toString() }),
        },
        { type: "ended", term: one.term.toString(), how: "resigned" },
      ]);
    } finally {
      watch.child.kill("SIGINT");
    }
    expect((await watch.exited).code).toBe(0);
  });

  it("E1, K1: with --lock-delay it campaigns on a keeper of its own: the term's lease is on the keeper (its lock-delay set), resigned and the keeper closed when CMD ends", async () => {
    const e = election("keeper");
    const result = await runCli([
      ...electOn(e),
      ...["--value", "kept", "--ttl", "3s", "--lock-delay", "5s", "--"],
      process.execPath,
      "-e",
      "console.log('term=' + process.env.LEASEHOLD_FENCING_TOKEN); process.exit(4)",
    ]);
    expect(result.code).toBe(4);
    const rows = await db.sql<
      {
        fencingToken: bigint;
        holder: string;
        ended: string | null;
        keeperEnded: string | null;
        lockDelayMs: number;
      }[]
    >`
      SELECT l.fencing_token, l.holder, l.ended, k.ended AS keeper_ended,
        (extract(epoch FROM k.lock_delay) * 1000)::int AS lock_delay_ms
      FROM leases l JOIN keepers k ON k.id = l.keeper_id
      WHERE l.account_id = ${e.accountId} AND l.session_id = ${e.election}`;
    expect(rows).toHaveLength(1);
    const [row] = rows;
    expect(result.stdout).toBe(`term=${row?.fencingToken}\n`);
    expect(row?.holder).toBe("kept");
    expect(row?.ended).toBe("released");
    expect(row?.keeperEnded).toBe("closed");
    expect(row?.lockDelayMs).toBe(5_000);
  });

  it("--observe with --keeper is refused, naming the flags", async () => {
    const e = election("observe-keeper");
    const result = await runCli([...electOn(e), "--observe", "--keeper"]);
    expect(result.code).toBe(2);
    expect(result.stderr).toContain("--observe campaigns on no keeper");
  });

  it("--help describes the command and --observe", async () => {
    const result = await runCli(["elect", "--help"]);
    expect(result.code).toBe(0);
    expect(result.stdout).toContain("leasehold elect --observe");
    expect(result.stdout).toContain("LEASEHOLD_FENCING_TOKEN (the term)");
    expect(result.stdout).toContain("--lock-delay DURATION");
  });
});
