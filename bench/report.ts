// The one table the benchmark prints (and bench/README.md shows), and the
// shape of bench/results/latest.json.

export interface Row {
  scenario: string;
  load: string;
  metric: string;
  leasehold: string;
  sql?: string;
  etcd?: string;
  /** Leasehold ÷ raw SQL, oriented so that above 1 means Leasehold is better. */
  vsSql?: string;
  vsEtcd?: string;
}

export interface Comparison {
  scenario: string;
  load: string;
  metric: string;
  leasehold: number;
  baseline: "raw SQL" | "Leasehold store SQL" | "etcd";
  baselineValue: number;
  /**
   * leasehold ÷ baseline for rates (higher is better); baseline ÷ leasehold
   * for latencies, so that for every comparison above 1 favours Leasehold.
   */
  ratio: number;
  higherIsBetter: boolean;
}

export interface Target {
  scenario: string;
  target: string;
  measured: string;
  met: boolean | null;
  note?: string;
}

export function compare(
  scenario: string,
  load: string,
  metric: string,
  leasehold: number,
  baseline: Comparison["baseline"],
  baselineValue: number,
  higherIsBetter: boolean,
): Comparison {
  const raw = higherIsBetter ? leasehold / baselineValue : baselineValue / leasehold;
  return {
    scenario,
    load,
    metric,
    leasehold,
    baseline,
    baselineValue,
    ratio: Math.round(raw * 100) / 100,
    higherIsBetter,
  };
}

const headers: [keyof Row, string][] = [
  ["scenario", "scenario"],
  ["load", "load"],
  ["metric", "metric"],
  ["leasehold", "Leasehold"],
  ["sql", "raw SQL"],
  ["vsSql", "×SQL"],
  ["etcd", "etcd"],
  ["vsEtcd", "×etcd"],
];

/** Plain text for the terminal: aligned columns, scenario named once. */
export function renderText(rows: Row[]): string {
  const cells = rows.map((r, i) =>
    headers.map(([k]) =>
      k === "scenario" && i > 0 && rows[i - 1]?.scenario === r.scenario ? "" : (r[k] ?? ""),
    ),
  );
  const all = [headers.map(([, h]) => h), ...cells];
  const widths = headers.map((_, c) => Math.max(...all.map((row) => (row[c] ?? "").length)));
  const line = (row: string[]) =>
    row
      .map((cell, c) => (c < 3 ? cell.padEnd(widths[c] ?? 0) : cell.padStart(widths[c] ?? 0)))
      .join("  ")
      .trimEnd();
  return [line(all[0] ?? []), line(widths.map((w) => "-".repeat(w))), ...cells.map(line)].join(
    "\n",
  );
}

/**
 * The same table as Markdown, for bench/README.md, with padded columns as
 * the project's formatter (Biome) writes them, so a fresh run passes lint.
 */
export function renderMarkdown(rows: Row[]): string {
  const body = rows.map((r, i) =>
    headers.map(([k]) =>
      k === "scenario" && i > 0 && rows[i - 1]?.scenario === r.scenario ? "" : (r[k] ?? ""),
    ),
  );
  const titles = headers.map(([, h]) => h);
  const widths = titles.map((t, c) =>
    Math.max(3, t.length, ...body.map((row) => (row[c] ?? "").length)),
  );
  const numeric = (c: number) => c >= 3;
  const line = (row: string[]) =>
    `| ${row
      .map((cell, c) => (numeric(c) ? cell.padStart(widths[c] ?? 0) : cell.padEnd(widths[c] ?? 0)))
      .join(" | ")} |`;
  const rule = `| ${widths
    .map((w, c) => (numeric(c) ? `${"-".repeat(w - 1)}:` : "-".repeat(w)))
    .join(" | ")} |`;
  return [line(titles), rule, ...body.map(line)].join("\n");
}

/** Figures for the table: rates as integers, latencies with 2–3 significant digits. */
export function fmtRate(x: number): string {
  return Number.isFinite(x) ? Math.round(x).toLocaleString("en-US") : "–";
}

export function fmtMs(x: number): string {
  if (!Number.isFinite(x)) return "–";
  if (x >= 100) return x.toFixed(0);
  if (x >= 10) return x.toFixed(1);
  return x.toFixed(2);
}

export function fmtRatio(x: number | undefined): string | undefined {
  return x === undefined || !Number.isFinite(x) ? undefined : `${x.toFixed(2)}×`;
}
