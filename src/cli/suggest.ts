// "Did you mean" for a mistyped command or flag, and where a port is set
// for those who reach for --port.

/** Levenshtein distance: the fewest single-letter edits from `a` to `b`. */
function distance(a: string, b: string): number {
  let previous = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const row = [i];
    for (let j = 1; j <= b.length; j++) {
      const substitution = (previous[j - 1] ?? 0) + (a[i - 1] === b[j - 1] ? 0 : 1);
      row.push(Math.min((previous[j] ?? 0) + 1, (row[j - 1] ?? 0) + 1, substitution));
    }
    previous = row;
  }
  return previous[b.length] ?? 0;
}

/** The candidate nearest to `word`, when it is near enough to be what was meant. */
export function closest(word: string, candidates: readonly string[]): string | undefined {
  let best: string | undefined;
  let bestDistance = Number.POSITIVE_INFINITY;
  for (const candidate of candidates) {
    const d = distance(word, candidate);
    if (d < bestDistance) {
      best = candidate;
      bestDistance = d;
    }
  }
  // One edit in three letters: "aquire" finds acquire, "get" does not find "set".
  return bestDistance <= Math.max(1, Math.floor(word.length / 3)) ? best : undefined;
}

/** The flag of a node:util parseArgs "Unknown option" error, if `error` is one. */
export function unknownOption(error: unknown): string | undefined {
  if ((error as { code?: unknown }).code !== "ERR_PARSE_ARGS_UNKNOWN_OPTION") return undefined;
  return /Unknown option '([^']+)'/.exec((error as Error).message)?.[1];
}

const addressFlags = new Set(["port", "p", "host", "address", "bind", "addr"]);

/**
 * What to say after "Unknown option": the flag meant among `known` (names
 * without dashes), or, for --port and its kin, the flag that sets the
 * address: --listen on a server, --server on a client command.
 */
export function unknownOptionHint(flag: string, known: readonly string[]): string | undefined {
  const name = flag.replace(/^-+/, "").split("=")[0] ?? "";
  if (addressFlags.has(name)) {
    if (known.includes("listen")) {
      return "a server's address and port are set with --listen HOST:PORT (LEASEHOLD_LISTEN), such as --listen 127.0.0.1:7071";
    }
    if (known.includes("server")) {
      return "the server to talk to is set with --server URL (LEASEHOLD_SERVER), such as --server http://127.0.0.1:7071";
    }
  }
  const near = closest(name, known);
  return near === undefined ? undefined : `did you mean --${near}?`;
}
