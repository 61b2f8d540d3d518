// Latency recording for the load generators: an HDR histogram in
// microseconds (3 significant digits), summarized in milliseconds.

import { build, type Histogram } from "hdr-histogram-js";

export interface LatencySummary {
  count: number;
  p50Ms: number;
  p90Ms: number;
  p99Ms: number;
  p999Ms: number;
  maxMs: number;
  meanMs: number;
}

export class Latency {
  private readonly histogram: Histogram = build({
    lowestDiscernibleValue: 1,
    // An hour in µs: nothing the benchmark waits for takes longer.
    highestTrackableValue: 3_600_000_000,
    numberOfSignificantValueDigits: 3,
  });

  /** Records a duration given in milliseconds (performance.now() deltas). */
  record(ms: number): void {
    this.histogram.recordValue(Math.max(1, Math.round(ms * 1000)));
  }

  summary(): LatencySummary {
    const h = this.histogram;
    const ms = (us: number) => Math.round(us) / 1000;
    return {
      count: h.totalCount,
      p50Ms: ms(h.getValueAtPercentile(50)),
      p90Ms: ms(h.getValueAtPercentile(90)),
      p99Ms: ms(h.getValueAtPercentile(99)),
      p999Ms: ms(h.getValueAtPercentile(99.9)),
      maxMs: ms(h.maxValue),
      meanMs: ms(h.mean),
    };
  }
}
