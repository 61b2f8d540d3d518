// A lease its own run released is not a lost lease. `leasehold run -- true`
// ends at once: its first KeepAlive renewal, sent as the stream opens, was
// still on the way when the run released, was refused as "released", and
// the server counted leasehold_lease_losses_total{reason="released"}. The
// run now waits for its renewal's answer (or a stall) before its Release.
// Made deterministic with a TCP proxy that delays every answer to the
// client: the renewal's answer comes long after the work has ended.

import { describe, expect, it } from "vitest";
import { LeaseLostError } from "../src/client/index.js";
import { useTestServer } from "./support/fixture.js";
import { freshKey } from "./support/leases.js";
import { startTcpProxy } from "./support/tcp-proxy.js";

const { server, libraryClient, defer } = useTestServer();

async function scrape(): Promise<string> {
  const res = await fetch(`${server.url}/metrics`);
  expect(res.status).toBe(200);
  return res.text();
}

function value(text: string, series: string): number {
  const line = text.split("\n").find((l) => l.startsWith(`${series} `));
  return line === undefined ? 0 : Number(line.slice(series.length + 1));
}

describe("a run that releases its own lease", () => {
  it("L2: work that ends at once releases after its renewal is answered; no loss is counted or reported", async () => {
    const proxy = await startTcpProxy(server.url);
    defer(() => proxy.close());
    const client = libraryClient({ baseUrl: proxy.url });
    const before = await scrape();
    proxy.delay(300, ["toClient"]);
    const runs = 3;
    const reasons: unknown[] = [];
    for (let i = 0; i < runs; i++) {
      await client.runExclusive(
        freshKey("release-not-loss"),
        async (ctx) => {
          ctx.signal.addEventListener("abort", () => reasons.push(ctx.signal.reason));
        },
        { ttlMs: 10_000 },
      );
    }
    const after = await scrape();
    const delta = (series: string) => value(after, series) - value(before, series);
    expect(delta('leasehold_lease_losses_total{reason="released"}')).toBe(0);
    expect(delta("leasehold_lease_releases_total")).toBe(runs);
    // Each run's renewal reached the server while its lease was held.
    expect(delta("leasehold_lease_renewals_total")).toBe(runs);
    // The work's signal ends naming the run's own release (docs/client.md), never a loss cause.
    expect(reasons).toHaveLength(runs);
    for (const reason of reasons) {
      expect(reason).toBeInstanceOf(LeaseLostError);
      expect((reason as LeaseLostError).lossReason).toBe("released");
    }
  });
});
