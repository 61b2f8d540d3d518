// `leasehold serve`: the lease server, until SIGINT or SIGTERM.

import { ConfigError, settingsHelp } from "../config/settings.js";
import { createLogger } from "../log/logger.js";
import { parseServerConfig, serverSettings } from "../server/config/server-config.js";
import { startServer } from "../server/server.js";
import { describeStartError, preflight } from "./server-start.js";
import { untilStopSignal } from "./signals.js";
import { unknownOption, unknownOptionHint } from "./suggest.js";

export const serveHelp = `Usage: leasehold serve [flags]

Serves LeaseService over gRPC, gRPC-Web and Connect on one port (HTTP/2
cleartext and HTTP/1.1). Without --database-url (DATABASE_URL) it starts an
embedded PostgreSQL with its data under --data-dir, and stops it on exit;
one server at a time uses a data folder (it holds the lock file
<data-dir>.lock). --database-url takes postgres:// or postgresql:// URLs.

Flags (each also read from the environment variable shown):
${settingsHelp(serverSettings)}
`;

export async function serve(argv: string[]): Promise<number> {
  if (argv.includes("--help") || argv.includes("-h")) {
    process.stdout.write(serveHelp);
    return 0;
  }
  let config: ReturnType<typeof parseServerConfig>;
  try {
    config = parseServerConfig(argv);
  } catch (error) {
    if (
      error instanceof ConfigError ||
      (error as { code?: string }).code?.startsWith("ERR_PARSE_ARGS")
    ) {
      const flag = unknownOption(error);
      const hint =
        flag === undefined ? undefined : unknownOptionHint(flag, Object.keys(serverSettings));
      const message =
        hint === undefined ? (error as Error).message : `Unknown option '${flag}': ${hint}`;
      process.stderr.write(`leasehold serve: ${message}\n`);
      return 2;
    }
    throw error;
  }
  const logger = createLogger();
  let server: Awaited<ReturnType<typeof startServer>>;
  try {
    await preflight(config);
    server = await startServer(config, logger);
  } catch (error) {
    const message = describeStartError(error, config);
    if (message === undefined) throw error;
    process.stderr.write(`leasehold serve: ${message}\n`);
    return 1;
  }
  process.stderr.write(`Leasehold serving on ${server.url} (database ${server.databaseUrl})\n`);
  const signal = await untilStopSignal((again) =>
    logger.info({ signal: again }, "already shutting down: the clean stop goes on"),
  );
  logger.info({ signal }, "shutting down");
  await server.close();
  return 0;
}
