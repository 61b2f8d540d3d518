// The arithmetic of the memory soak: a least-squares line through memory
// samples, and the summary of one series (start, end, extremes, slopes)
// that the verdict is drawn from.

export interface Point {
  /** Seconds since the soak started. */
  t: number;
  /** MiB. */
  v: number;
}

export interface LinearFit {
  /** MiB per second. */
  slope: number;
  intercept: number;
  /** Share of the variance the line explains (0..1); NaN with fewer than 3 points. */
  r2: number;
}

/** Ordinary least squares through the points. */
export function linearFit(points: readonly Point[]): LinearFit {
  const n = points.length;
  if (n < 2) return { slope: Number.NaN, intercept: Number.NaN, r2: Number.NaN };
  let st = 0;
  let sv = 0;
  for (const p of points) {
    st += p.t;
    sv += p.v;
  }
  const mt = st / n;
  const mv = sv / n;
  let stt = 0;
  let stv = 0;
  let svv = 0;
  for (const p of points) {
    stt += (p.t - mt) ** 2;
    stv += (p.t - mt) * (p.v - mv);
    svv += (p.v - mv) ** 2;
  }
  const slope = stt === 0 ? Number.NaN : stv / stt;
  const r2 = n < 3 || svv === 0 ? Number.NaN : (stv * stv) / (stt * svv);
  return { slope, intercept: mv - slope * mt, r2 };
}

/**
 * The lowest point of each window of `windowSeconds` (the first window
 * starting at `fromSeconds`), stamped with the window's middle. Heap in use
 * saws up and down between collections; its lows follow what the
 * collector could not free, which is where a leak shows.
 */
export function floors(
  points: readonly Point[],
  fromSeconds: number,
  windowSeconds: number,
): Point[] {
  const lows = new Map<number, number>();
  for (const p of points) {
    if (p.t < fromSeconds) continue;
    const w = Math.floor((p.t - fromSeconds) / windowSeconds);
    lows.set(w, Math.min(lows.get(w) ?? Number.POSITIVE_INFINITY, p.v));
  }
  return [...lows].map(([w, v]) => ({ t: fromSeconds + (w + 0.5) * windowSeconds, v }));
}

export interface SeriesSummary {
  /** First and last sample after the warm-up, MiB. */
  start: number;
  end: number;
  min: number;
  max: number;
  /** Linear fit over the whole measured phase (after warm-up), MiB per 10 minutes. */
  measuredSlopePer10Min: number;
  /** Linear fit over the second half of the run, MiB per 10 minutes: what the verdict reads. */
  secondHalfSlopePer10Min: number;
  secondHalfR2: number;
}

const round2 = (x: number) => Math.round(x * 100) / 100;

/**
 * Summarizes the samples taken at or after `warmupSeconds`; the second
 * half is every sample at or after `secondHalfFromSeconds`.
 */
export function summarizeSeries(
  points: readonly Point[],
  warmupSeconds: number,
  secondHalfFromSeconds: number,
): SeriesSummary {
  const measured = points.filter((p) => p.t >= warmupSeconds);
  const secondHalf = points.filter((p) => p.t >= secondHalfFromSeconds);
  const values = measured.map((p) => p.v);
  const whole = linearFit(measured);
  const late = linearFit(secondHalf);
  return {
    start: round2(measured[0]?.v ?? Number.NaN),
    end: round2(measured.at(-1)?.v ?? Number.NaN),
    min: round2(values.length > 0 ? Math.min(...values) : Number.NaN),
    max: round2(values.length > 0 ? Math.max(...values) : Number.NaN),
    measuredSlopePer10Min: round2(whole.slope * 600),
    secondHalfSlopePer10Min: round2(late.slope * 600),
    secondHalfR2: round2(late.r2),
  };
}
