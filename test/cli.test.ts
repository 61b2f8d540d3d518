// The `leasehold` client commands as separate processes against a real
// server: readable output, --json, exit codes, --help, and one clear line
// when the server cannot be reached.

import { describe, expect, it } from "vitest";
import { runCli } from "./support/cli.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";

const { server } = useTestServer();

const commands = [
  "acquire",
  "renew",
  "release",
  "get",
  "list",
  "watch",
  "history",
  "revoke",
  "run",
];

describe("leasehold client commands", () => {
  it("S3, S5: acquire, a blocked acquire (exit 75, naming the holder), get, list, renew, release", async () => {
    const key = freshKey("cli");
    const flags = ["--server", server.url, "--account", key.accountId, "--session", key.sessionId];

    const acquired = await runCli([
      "acquire",
      ...flags,
      "--ttl",
      "30s",
      "--holder",
      "desktop",
      "--json",
    ]);
    expect(acquired.code).toBe(0);
    const grant = JSON.parse(acquired.stdout) as {
      acquired: boolean;
      lease: { runId: string; fencingToken: string };
    };
    expect(grant.acquired).toBe(true);
    const runId = grant.lease.runId;

    const blocked = await runCli(["acquire", ...flags, "--holder", "browser"]);
    expect(blocked.code).toBe(75);
    expect(blocked.stdout).toMatch(
      new RegExp(`held by "desktop" \\(run ${runId}, token ${grant.lease.fencingToken}\\)`),
    );

    const got = await runCli(["get", ...flags]);
    expect(got.code).toBe(0);
    expect(got.stdout).toContain(`is held by "desktop" (run ${runId}`);

    const listed = await runCli(["list", "--server", server.url, "--account", key.accountId]);
    expect(listed.stdout).toMatch(/^SESSION\s+HOLDER\s+TOKEN\s+LEFT\s+RUN/);
    expect(listed.stdout).toContain(key.sessionId);

    const renewed = await runCli(["renew", ...flags, "--run-id", runId, "--ttl", "1m"]);
    expect(renewed.code).toBe(0);
    expect(renewed.stdout).toMatch(/^renewed .* (59|60)\.\ds left/);

    const released = await runCli(["release", ...flags, "--run-id", runId]);
    expect(released.stdout).toContain("released");
    const again = await runCli(["release", ...flags, "--run-id", runId]);
    expect(again.code).toBe(0);
    expect(again.stdout).toContain("nothing to release");

    const notHeld = await runCli(["renew", ...flags, "--run-id", runId]);
    expect(notHeld.code).toBe(1);
    expect(notHeld.stderr).toBe("leasehold renew: lease not held: released\n");

    const free = await runCli(["get", ...flags, "--protocol", "grpc"]);
    expect(free.stdout).toBe(`${key.accountId}/${key.sessionId} is free\n`);
  });

  it("an unreachable server gets one line naming it, exit 69, no stack trace", async () => {
    const result = await runCli([
      "get",
      "--server",
      "http://127.0.0.1:9",
      "--account",
      "a",
      "--session",
      "s",
    ]);
    expect(result.code).toBe(69);
    expect(result.stderr).toBe(
      "leasehold get: cannot reach the server at http://127.0.0.1:9 (connection refused): is it running there? " +
        "A server started on another address (--listen, LEASEHOLD_LISTEN) is reached with --server URL (LEASEHOLD_SERVER)\n",
    );
    expect(result.stdout).toBe("");
  });

  it("bad input: a bad flag value names the flag and exits 2", async () => {
    const result = await runCli(["acquire", "--account", "a", "--session", "s", "--ttl", "soon"]);
    expect(result.code).toBe(2);
    expect(result.stderr).toMatch(/^leasehold acquire: --ttl must be a duration .* got "soon"\n/);
    const missing = await runCli(["get", "--account", "a"]);
    expect(missing.code).toBe(2);
    expect(missing.stderr).toMatch(/--session is required/);
  });

  it("a duration without a unit is refused, not read as seconds", async () => {
    const result = await runCli(["acquire", "--account", "a", "--session", "s", "--ttl", "5"]);
    expect(result.code).toBe(2);
    expect(result.stderr).toBe(
      'leasehold acquire: --ttl needs a unit: 5s for seconds, 5ms for milliseconds (also m, h), got "5"\n' +
        'Run "leasehold acquire --help" for usage.\n',
    );
  });

  it("a mistyped command or flag gets a 'did you mean', --port points to --listen or --server", async () => {
    const command = await runCli(["aquire"]);
    expect(command.code).toBe(2);
    expect(command.stderr).toMatch(
      /^leasehold: unknown command "aquire" \(did you mean "leasehold acquire"\?\)\n/,
    );
    const flag = await runCli(["get", "--acount", "a", "--session", "s"]);
    expect(flag.code).toBe(2);
    expect(flag.stderr).toMatch(
      /^leasehold get: Unknown option '--acount': did you mean --account\?\n/,
    );
    const clientPort = await runCli(["get", "--port", "7071"]);
    expect(clientPort.stderr).toMatch(
      /^leasehold get: Unknown option '--port': the server to talk to is set with --server URL \(LEASEHOLD_SERVER\)/,
    );
    const serverPort = await runCli(["serve", "--port", "7071"]);
    expect(serverPort.code).toBe(2);
    expect(serverPort.stderr).toBe(
      "leasehold serve: Unknown option '--port': a server's address and port are set with --listen HOST:PORT (LEASEHOLD_LISTEN), such as --listen 127.0.0.1:7071\n",
    );
    const guardedFlag = await runCli(["guarded", "serve", "--shutdown-grase", "1s"]);
    expect(guardedFlag.stderr).toBe(
      "leasehold guarded serve: Unknown option '--shutdown-grase': did you mean --shutdown-grace?\n",
    );
  });

  it("every command has --help", async () => {
    const results = await Promise.all(commands.map((c) => runCli([c, "--help"])));
    for (const [i, r] of results.entries()) {
      expect(r.code, commands[i]).toBe(0);
      expect(r.stdout, commands[i]).toMatch(new RegExp(`^Usage: leasehold ${commands[i]} `));
    }
    const top = await runCli(["--help"]);
    for (const c of commands) expect(top.stdout).toContain(`  ${c} `);
  });

  // Which of the flags that only some commands take each one has.
  const ownFlags: Record<string, string[]> = {
    acquire: ["--account", "--session", "--ttl", "--holder"],
    renew: ["--account", "--session", "--ttl"],
    release: ["--account", "--session"],
    get: ["--account", "--session"],
    list: ["--account"],
    watch: ["--account", "--session"],
    history: ["--account", "--session"],
    revoke: ["--account", "--session"],
    run: ["--account", "--session", "--ttl", "--holder"],
  };

  it("each command's help lists only the flags it takes, and refuses the others", async () => {
    for (const c of commands) {
      const help = (await runCli([c, "--help"])).stdout;
      for (const flag of ["--account", "--session", "--ttl", "--holder"]) {
        const has = ownFlags[c]?.includes(flag) ?? false;
        expect(new RegExp(`^  ${flag} `, "m").test(help), `${c} ${flag}`).toBe(has);
      }
    }
    const ignored = await runCli(["release", "--account", "a", "--session", "s", "--ttl", "5s"]);
    expect(ignored.code).toBe(2);
    expect(ignored.stderr).toMatch(/^leasehold release: Unknown option '--ttl'/);
  });

  it("every duration the help texts and errors offer as an example is one the server accepts", async () => {
    const texts = await Promise.all(
      commands.map(async (c) => (await runCli([c, "--help"])).stdout),
    );
    const bad = await runCli(["acquire", "--account", "a", "--session", "s", "--ttl", "soon"]);
    texts.push(bad.stderr);
    const examples = new Set<string>();
    for (const text of texts) {
      for (const m of text.matchAll(/--ttl (\S+)|such as ((?:\d+(?:ms|s|m|h)(?:, | or )?)+)/g)) {
        for (const d of (m[1] ?? m[2] ?? "").split(/, | or /)) {
          if (/^\d+(ms|s|m|h)$/.test(d)) examples.add(d);
        }
      }
    }
    expect(examples.size).toBeGreaterThan(3);
    for (const ttl of examples) {
      const key = freshKey("help-ttl");
      const result = await runCli([
        "acquire",
        "--server",
        server.url,
        "--account",
        key.accountId,
        "--session",
        key.sessionId,
        "--ttl",
        ttl,
      ]);
      expect(result.stderr, `--ttl ${ttl}`).toBe("");
      expect(result.code, `--ttl ${ttl}`).toBe(0);
    }
  });

  it("the examples in the help texts run as shown", async () => {
    for (const c of ["acquire", "run"]) {
      const help = (await runCli([c, "--help"])).stdout;
      const example = /^Example:\n {2}leasehold (.*)$/m.exec(help)?.[1];
      expect(example, c).toBeDefined();
      const key = freshKey("help-example");
      // The example's words, split as a shell would (one quoted argument at most).
      const words = (example ?? "")
        .match(/'[^']*'|\S+/g)
        ?.map((w) => (w.startsWith("'") ? w.slice(1, -1) : w))
        .map((w) => (w === "acme" ? key.accountId : w))
        .map((w) => (w === "s1" || w === "s2" ? key.sessionId : w));
      const result = await runCli(words ?? [], { LEASEHOLD_SERVER: server.url });
      expect(result.stderr, c).toBe("");
      expect(result.code, c).toBe(0);
    }
  });
});
