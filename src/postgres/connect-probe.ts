// The first connection to a DATABASE_URL, bounded whatever answers there.
//
// postgres.js's connect_timeout covers a silent port, but a server of another
// protocol (an HTTP/2 server sends its SETTINGS frame first) can keep the
// driver waiting far longer. The start-up connection races a timer instead,
// and the driver's sockets are destroyed when it fires.

import postgres from "postgres";

/** No PostgreSQL answer within the start-up bound. */
export class DatabaseConnectTimeoutError extends Error {
  override readonly name = "DatabaseConnectTimeoutError";
  readonly code = "LEASEHOLD_CONNECT_TIMEOUT";
  constructor(readonly timeoutMs: number) {
    super(`no PostgreSQL answer within ${timeoutMs}ms`);
  }
}

/** Connects to `url` and runs SELECT 1, or fails within `timeoutMs`. */
export async function probeDatabase(url: string, timeoutMs: number): Promise<void> {
  const sql = postgres(url, {
    max: 1,
    connect_timeout: Math.max(1, Math.ceil(timeoutMs / 1000)),
    onnotice: () => {},
    connection: { application_name: "leasehold-start" },
  });
  let timer: NodeJS.Timeout | undefined;
  const timedOut = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new DatabaseConnectTimeoutError(timeoutMs)), timeoutMs);
  });
  try {
    await Promise.race([sql`SELECT 1`, timedOut]);
  } catch (error) {
    if ((error as { code?: unknown }).code === "CONNECT_TIMEOUT") {
      throw new DatabaseConnectTimeoutError(timeoutMs);
    }
    throw error;
  } finally {
    clearTimeout(timer);
    await sql.end({ timeout: 0 });
  }
}
