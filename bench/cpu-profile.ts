// Reads the V8 CPU profile of a server process (node --cpu-prof) and says
// where its busy time went during given windows: by package or module, and
// the functions with the most self time. This is what names the bound when
// a target is missed.

import { readFile } from "node:fs/promises";

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
}

interface Profile {
  nodes: ProfileNode[];
  startTime: number;
  samples: number[];
  timeDeltas: number[];
}

export interface ProfileSummary {
  /** Sampled time inside the windows, ms. */
  sampledMs: number;
  /** Share of the sampled time the thread was busy. */
  busyShare: number;
  /** Share of busy time per package / module, largest first. */
  byModule: { module: string; share: number }[];
  /** Share of busy time per function (self time), largest first. */
  topFunctions: { fn: string; share: number }[];
}

/** The monotonic clock V8 stamps profiles with, in µs. */
export function monotonicMicros(): number {
  return Number(process.hrtime.bigint() / 1000n);
}

export async function summarizeProfile(
  file: string,
  windows: [number, number][],
  top = 15,
): Promise<ProfileSummary> {
  const profile = JSON.parse(await readFile(file, "utf8")) as Profile;
  const nodes = new Map(profile.nodes.map((n) => [n.id, n]));
  const inWindow = (t: number) => windows.some(([a, b]) => t >= a && t <= b);
  const self = new Map<number, number>();
  let t = profile.startTime;
  profile.samples.forEach((id, i) => {
    t += profile.timeDeltas[i] ?? 0;
    if (inWindow(t)) self.set(id, (self.get(id) ?? 0) + (profile.timeDeltas[i + 1] ?? 0));
  });
  let sampled = 0;
  let busy = 0;
  const byModule = new Map<string, number>();
  const byFunction = new Map<string, number>();
  for (const [id, us] of self) {
    sampled += us;
    const frame = nodes.get(id)?.callFrame;
    if (!frame || frame.functionName === "(idle)") continue;
    busy += us;
    const module = moduleOf(frame.url, frame.functionName);
    byModule.set(module, (byModule.get(module) ?? 0) + us);
    const fn = `${frame.functionName || "(anonymous)"} ${shortUrl(frame.url)}${frame.url ? `:${frame.lineNumber + 1}` : ""}`;
    byFunction.set(fn, (byFunction.get(fn) ?? 0) + us);
  }
  const ranked = (m: Map<string, number>) => [...m].sort((a, b) => b[1] - a[1]).slice(0, top);
  const share = (us: number) => Math.round((us / Math.max(busy, 1)) * 1000) / 1000;
  return {
    sampledMs: Math.round(sampled / 1000),
    busyShare: Math.round((busy / Math.max(sampled, 1)) * 1000) / 1000,
    byModule: ranked(byModule).map(([module, us]) => ({ module, share: share(us) })),
    topFunctions: ranked(byFunction).map(([fn, us]) => ({ fn, share: share(us) })),
  };
}

function moduleOf(url: string, functionName: string): string {
  const pkg = /node_modules\/((?:@[^/]+\/)?[^/]+)/.exec(url)?.[1];
  if (pkg) return pkg;
  if (url.startsWith("node:")) return url.replace(/^node:internal\//, "node:");
  if (url) return shortUrl(url);
  // Native frames: (garbage collector), (program), writev, …
  return functionName || "(native)";
}

function shortUrl(url: string): string {
  return url
    .replace(/^file:\/\/.*?\/node_modules\//, "")
    .replace(/^file:\/\/.*?\/(src|bench|test)\//, "$1/");
}
