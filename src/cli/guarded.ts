// `leasehold guarded serve`: the guarded store server, until SIGINT or SIGTERM.

import { ConfigError, settingsHelp } from "../config/settings.js";
import { guardedSettings, parseGuardedConfig } from "../guarded/config.js";
import { startGuardedServer } from "../guarded/server.js";
import { createLogger } from "../log/logger.js";
import { describeStartError, preflight } from "./server-start.js";
import { untilStopSignal } from "./signals.js";
import { unknownOption, unknownOptionHint } from "./suggest.js";

export const guardedHelp = `Usage: leasehold guarded serve [flags]

Serves leasehold.guarded.v1.GuardedStoreService: session documents (an
agent's transcript, its files) that accept a write only with a current
fencing token. Same port sharing and database handling as "leasehold serve":
without --database-url (DATABASE_URL) it starts an embedded PostgreSQL with
its data under --data-dir.

Callers authenticate as on the lease server (same key flags and variables;
without keys, development mode on loopback only), and reach only their own
account's documents. --lease-url is required: a write that would raise a
session's fence must present the newest token the lease server has granted
for it (checked with CheckFence, as this store's own --lease-token); while
the lease server is unreachable such writes are UNAVAILABLE and writes at
the highest token seen go on.

Fence modes:
  monotonic   a write passes when its token is >= the highest token this
              store has seen for the session (a late write of a replaced run
              is refused)
  live        every write asks the lease server (CheckFence) that the token
              is the valid lease's (a holder whose lease expired is refused
              even when nobody replaced it)

Flags (each also read from the environment variable shown):
${settingsHelp(guardedSettings)}
`;

export async function guarded(argv: string[]): Promise<number> {
  const [sub, ...rest] = argv;
  if (sub === undefined || sub === "--help" || sub === "-h" || sub === "help") {
    process.stdout.write(guardedHelp);
    return sub === undefined ? 2 : 0;
  }
  if (sub !== "serve") {
    process.stderr.write(
      `leasehold guarded: unknown command ${JSON.stringify(sub)}\n\n${guardedHelp}`,
    );
    return 2;
  }
  if (rest.includes("--help") || rest.includes("-h")) {
    process.stdout.write(guardedHelp);
    return 0;
  }
  let config: ReturnType<typeof parseGuardedConfig>;
  try {
    config = parseGuardedConfig(rest);
  } catch (error) {
    if (
      error instanceof ConfigError ||
      (error as { code?: string }).code?.startsWith("ERR_PARSE_ARGS")
    ) {
      const flag = unknownOption(error);
      const hint =
        flag === undefined ? undefined : unknownOptionHint(flag, Object.keys(guardedSettings));
      const message =
        hint === undefined ? (error as Error).message : `Unknown option '${flag}': ${hint}`;
      process.stderr.write(`leasehold guarded serve: ${message}\n`);
      return 2;
    }
    throw error;
  }
  const logger = createLogger({ name: "leasehold-guarded" });
  let server: Awaited<ReturnType<typeof startGuardedServer>>;
  try {
    await preflight(config);
    server = await startGuardedServer(config, logger);
  } catch (error) {
    const message = describeStartError(error, config);
    if (message === undefined) throw error;
    process.stderr.write(`leasehold guarded serve: ${message}\n`);
    return 1;
  }
  process.stderr.write(
    `Leasehold guarded store serving on ${server.url} (database ${server.databaseUrl}, fence mode ${config.fenceMode})\n`,
  );
  const signal = await untilStopSignal((again) =>
    logger.info({ signal: again }, "already shutting down: the clean stop goes on"),
  );
  logger.info({ signal }, "shutting down");
  await server.close();
  return 0;
}
