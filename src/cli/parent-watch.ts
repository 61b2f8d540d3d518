// Stopping with npx. `npx leasehold …` runs this command under `npm exec`
// and a shell; a SIGTERM to npx ends npx and the shell but is not passed on,
// so the command was left running (a server with its PostgreSQL, a watch)
// with init as its new parent. Started by `npm exec`, the command watches
// its parent and, once the parent is gone, sends itself SIGTERM: each
// command stops as it does on a signal (a server drains and stops its
// database, `run` stops its CMD and releases).
//
// Only under `npm exec`: a command started otherwise (nohup, a supervisor,
// a shell that exits) is meant to outlive its parent.

/** How often the parent is looked at: a stop within half a second is soon enough. */
const intervalMs = 500;

export function stopWithNpxParent(env: NodeJS.ProcessEnv = process.env): void {
  if (env.npm_command !== "exec") return;
  const parent = process.ppid;
  const timer = setInterval(() => {
    if (process.ppid === parent) return;
    clearInterval(timer);
    process.kill(process.pid, "SIGTERM");
  }, intervalMs);
  // Never the reason the process stays up.
  timer.unref();
}
