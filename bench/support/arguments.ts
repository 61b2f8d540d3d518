// Command-line arguments of the standalone benchmarks: a bad flag or value
// is answered with what was wrong and the usage (exit status 2), never a
// stack trace or a run that measures nothing.

import { type ParseArgsConfig, parseArgs } from "node:util";

/** Ends the process with `message` and the usage on stderr, exit status 2. */
export function usageError(message: string, usage: string): never {
  process.stderr.write(`${message}\n\n${usage}`);
  process.exit(2);
}

/** `parseArgs` with `--help` (prints the usage and exits 0) and usage errors instead of throws. */
export function benchArgs<const T extends NonNullable<ParseArgsConfig["options"]>>(
  options: T,
  usage: string,
  allowPositionals = false,
) {
  try {
    const parsed = parseArgs({
      options: { ...options, help: { type: "boolean" } },
      allowPositionals,
    });
    if ((parsed.values as Record<string, unknown>).help) {
      process.stdout.write(usage);
      process.exit(0);
    }
    return parsed as unknown as ReturnType<
      typeof parseArgs<{ options: T; allowPositionals: true }>
    >;
  } catch (error) {
    usageError(error instanceof Error ? error.message : String(error), usage);
  }
}

/** The optional positional "seconds per case" of fence.ts and ops.ts: a positive number. */
export function secondsPerCase(usage: string, fallback: number): number {
  const { positionals } = benchArgs({}, usage, true);
  if (positionals.length > 1)
    usageError(`expected at most one argument, got ${positionals.length}`, usage);
  const text = positionals[0];
  if (text === undefined) return fallback;
  const seconds = Number(text);
  if (!(seconds > 0 && Number.isFinite(seconds))) {
    usageError(`seconds per case must be a positive number, got ${JSON.stringify(text)}`, usage);
  }
  return seconds;
}

/** The value of `--flag` as a positive integer, or a usage error naming the flag. */
export function positiveInteger(flag: string, text: string | undefined, usage: string): number {
  const n = Number(text);
  if (!(Number.isInteger(n) && n > 0)) {
    usageError(`--${flag} must be a positive integer, got ${JSON.stringify(text)}`, usage);
  }
  return n;
}
