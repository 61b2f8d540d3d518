// JSON logs (pino). Bearer tokens never reach a log line: the redaction list
// covers every place a request header could be logged from.

import { type DestinationStream, type Logger, pino } from "pino";

export type { Logger };

export function createLogger(
  options: { level?: string; name?: string; destination?: DestinationStream } = {},
): Logger {
  return pino(
    {
      name: options.name ?? "leasehold",
      level: options.level ?? process.env.LEASEHOLD_LOG_LEVEL ?? "info",
      redact: ["authorization", "headers.authorization", "req.headers.authorization"],
      base: { pid: process.pid },
    },
    options.destination,
  );
}
