// The problem statement's scene in a real browser: one account opens the same
// session on two devices. Two browser contexts (each its own storage and
// network) load the page from `leasehold serve`, running as its own process
// on a fresh database. Every wait is on something the page shows, with the
// default deadline; nothing sleeps for a guessed time. What the test asserts
// is the order in which the devices showed things (a log each page keeps),
// never how fast: two busy cores make any latency bound a coin toss.

import { randomBytes } from "node:crypto";
import { copyFile } from "node:fs/promises";
import path from "node:path";
import { SignJWT } from "jose";
import type { Browser, BrowserContext, Locator, Page } from "playwright-core";
import { beforeAll, describe, expect, it } from "vitest";
import { useTestDatabase } from "../support/fixture.js";
import { connectClient, repoRoot, type ServerProcess } from "../support/server.js";
import {
  launchChromium,
  type PageLogEntry,
  pageLog,
  pageLogScript,
  screenshot,
} from "./browser.js";

const ttlSeconds = 3;
const session = "s1";

const { spawnServer, defer } = useTestDatabase();
let server: ServerProcess;
let browser: Browser;
const pageErrors: string[] = [];

beforeAll(async () => {
  server = await spawnServer();
  browser = await launchChromium();
  defer(() => browser.close());
});

interface DeviceTab {
  context: BrowserContext;
  page: Page;
}

async function openDevice(accountId: string, device: string): Promise<DeviceTab> {
  const context = await browser.newContext({ viewport: { width: 1100, height: 860 } });
  await context.addInitScript(pageLogScript);
  const page = await context.newPage();
  page.on("pageerror", (error) => pageErrors.push(`${device}: ${error.message}`));
  const query = new URLSearchParams({
    account: accountId,
    session,
    device,
    ttl: String(ttlSeconds),
  });
  await page.goto(`${server.url}/?${query}`);
  await page.locator('#feed-status[data-state="live"]').waitFor();
  return { context, page };
}

/** The run id and fencing token a device shows for its own run. */
async function ownRun(page: Page): Promise<{ runId: string; short: string; token: bigint }> {
  const status = page.locator('#device-status[data-running="true"]');
  const text = (await status.textContent()) ?? "";
  const runId = (await status.getAttribute("data-run")) ?? "";
  const m = /run ([0-9a-f]{8}), fencing token (\d+)/.exec(text);
  if (!m?.[1] || !m[2]) throw new Error(`no run in ${JSON.stringify(text)}`);
  expect(runId.startsWith(m[1])).toBe(true);
  return { runId, short: m[1], token: BigInt(m[2]) };
}

/** The first entry of a page's log that matches, at or after `from` (a page time). */
function when(
  log: PageLogEntry[],
  what: PageLogEntry["what"],
  value: string | RegExp,
  from = Number.NEGATIVE_INFINITY,
): PageLogEntry {
  const found = log.find(
    (e) =>
      e.what === what &&
      e.at >= from &&
      (typeof value === "string" ? e.value === value : value.test(e.value)),
  );
  if (!found) {
    throw new Error(`the page never showed ${what} ${value}: ${JSON.stringify(log, null, 1)}`);
  }
  return found;
}

/** The database time a change carries, as its entry in the recent changes shows it (ms). */
async function databaseTime(item: Locator): Promise<number> {
  const at = Date.parse((await item.locator("time").getAttribute("datetime")) ?? "");
  if (Number.isNaN(at)) throw new Error("the change shows no time");
  return at;
}

describe("two devices, one session", () => {
  it("L2, S1, S6: held elsewhere once granted, a handoff request, a cut keepalive, a takeover, each shown in order", async () => {
    // The database is fresh for this file, so a plain account name is free.
    const accountId = "acme";
    // Other sessions of the account, so the table shows more than the scene.
    const api = connectClient(server.url);
    for (const [sessionId, holder] of [
      ["notes", "phone"],
      ["report", "cli"],
    ] as const) {
      const other = await api.acquire({
        key: { accountId, sessionId },
        ttl: { seconds: 600n },
        holder,
      });
      expect(other.acquired).toBe(true);
    }

    const desktop = await openDevice(accountId, "desktop");
    const laptop = await openDevice(accountId, "browser");

    // Page 1 starts a run; page 2 shows it held elsewhere, its button disabled.
    await desktop.page.click("#start");
    await desktop.page.locator('#device-status[data-running="true"]').waitFor();
    const first = await ownRun(desktop.page);
    await laptop.page
      .locator("#start:disabled", { hasText: /^Running on desktop — \d+ s left$/ })
      .waitFor();
    const cells = await laptop.page
      .locator(`#sessions tr[data-session="${session}"] td`)
      .allTextContents();
    expect(cells.slice(0, 4)).toEqual([session, "desktop", first.short, String(first.token)]);
    // A countdown within the TTL; how much is left depends on the machine.
    expect(cells[4]).toMatch(/^[0-3] s$|^ending…$/);
    await screenshot(laptop.page, "1-browser-sees-desktop");
    {
      // Page 2 learned of the grant from the Watch stream, after the
      // database made it (the event carries the grant's database time),
      // and showed the session held from then on.
      const laptopLog = await pageLog(laptop.page);
      const acquiredItem = laptop.page.locator(
        `#transitions li[data-type="ACQUIRED"][data-run="${first.runId}"]`,
      );
      const granted = await databaseTime(acquiredItem);
      const acquired = when(laptopLog, "transition", `ACQUIRED ${first.runId}`);
      const heldElsewhere = when(laptopLog, "start", /^disabled: Running on desktop/);
      expect(acquired.at).toBeGreaterThanOrEqual(granted);
      expect(heldElsewhere.at).toBeGreaterThanOrEqual(granted);
    }

    // Page 2 asks for a handoff; page 1 shows the request addressed to its run.
    await laptop.page.click("#handoff");
    const request = desktop.page.locator("#handoff-request");
    await request.waitFor({ state: "visible" });
    await expect(request.textContent()).resolves.toContain(
      "browser asks this run to hand off: “continue on browser”",
    );
    await laptop.page
      .locator(`#transitions li[data-type="HANDOFF_REQUESTED"][data-session="${session}"]`)
      .waitFor();
    const shot = await screenshot(desktop.page, "2-desktop-asked-to-hand-off");
    if (process.env.LEASEHOLD_UPDATE_DOCS === "1") {
      await copyFile(shot, path.join(repoRoot, "docs", "page.png"));
    }

    // Page 1 loses its network: new requests fail, so its renewals (and its
    // release) do. Its Watch stream, opened before, may go on.
    await desktop.context.setOffline(true);

    // Page 2 sees the lease expire after its TTL, and takes the session.
    const expiredItem = laptop.page.locator(
      `#transitions li[data-type="EXPIRED"][data-run="${first.runId}"]`,
    );
    await expiredItem.waitFor();
    await laptop.page.locator("#start:enabled", { hasText: "Start run" }).waitFor();
    await laptop.page.click("#start");
    await laptop.page.locator('#device-status[data-running="true"]').waitFor();
    const second = await ownRun(laptop.page);
    expect(second.token).toBeGreaterThan(first.token);
    await expect(desktop.page.locator("#device-note").textContent()).resolves.toContain(
      "Lease lost: no renewal was confirmed before the local deadline.",
    );
    await screenshot(laptop.page, "3-browser-took-over");
    await screenshot(desktop.page, "3-desktop-offline-stopped");
    {
      const desktopLog = await pageLog(desktop.page);
      const laptopLog = await pageLog(laptop.page);
      const started = when(desktopLog, "running", "true");
      const stopped = when(desktopLog, "running", "false", started.at);
      const expired = when(laptopLog, "transition", `EXPIRED ${first.runId}`);
      const took = when(laptopLog, "transition", `ACQUIRED ${second.runId}`);
      const laptopRunning = when(laptopLog, "running", "true");
      // L2: page 1 stopped presenting itself as the holder before the
      // database's deadline of its lease, which the EXPIRED event carries.
      const deadline = Date.parse(
        (await expiredItem.locator("time").getAttribute("datetime")) ?? "",
      );
      expect(stopped.at).toBeLessThan(deadline);
      expect(stopped.at).toBeLessThan(expired.at);
      // S1 as the devices showed it: page 1 stopped before page 2 started.
      expect(stopped.at).toBeLessThan(laptopRunning.at);
      // S6: page 2 showed the old grant's end before the new grant.
      expect(laptopLog.indexOf(expired)).toBeLessThan(laptopLog.indexOf(took));
    }

    // Page 1, back online, shows page 2's run and not itself.
    await desktop.context.setOffline(false);
    await desktop.page
      .locator("#start:disabled", { hasText: /^Running on browser — \d+ s left$/ })
      .waitFor();
    await expect(desktop.page.locator("#device-status").getAttribute("data-running")).resolves.toBe(
      "false",
    );
    const desktopRow = desktop.page.locator(`#sessions tr[data-session="${session}"] td`);
    await expect(desktopRow.nth(3).textContent()).resolves.toBe(String(second.token));
    await screenshot(desktop.page, "4-desktop-back-sees-browser");

    // Page 2 stops; page 1 may start again, once it knows of the release.
    await laptop.page.click("#stop");
    await desktop.page
      .locator(`#transitions li[data-type="RELEASED"][data-run="${second.runId}"]`)
      .waitFor();
    await desktop.page.locator("#start:enabled", { hasText: "Start run" }).waitFor();
    {
      const desktopLog = await pageLog(desktop.page);
      const granted = await databaseTime(
        desktop.page.locator(`#transitions li[data-type="ACQUIRED"][data-run="${second.runId}"]`),
      );
      const releasedItem = desktop.page.locator(
        `#transitions li[data-type="RELEASED"][data-run="${second.runId}"]`,
      );
      const releasedAt = await databaseTime(releasedItem);
      const showsBrowser = when(desktopLog, "start", /^disabled: Running on browser/);
      const released = when(desktopLog, "transition", `RELEASED ${second.runId}`);
      const free = when(desktopLog, "start", "enabled: Start run", showsBrowser.at);
      // Page 1 showed page 2's run only once the database had granted it,
      // and the session free only after the database recorded its release.
      expect(showsBrowser.at).toBeGreaterThanOrEqual(granted);
      expect(released.at).toBeGreaterThanOrEqual(releasedAt);
      expect(free.at).toBeGreaterThanOrEqual(releasedAt);
      // Page 1 never showed itself running again.
      expect(desktopLog.filter((e) => e.what === "running" && e.value === "true")).toHaveLength(1);
    }

    expect(pageErrors).toEqual([]);
  });

  it("with authentication on: asks for a token, names a token of another account, works with the right one", async () => {
    const secret = randomBytes(32).toString("hex");
    const token = (account: string) =>
      new SignJWT({})
        .setProtectedHeader({ alg: "HS256" })
        .setSubject(account)
        .setExpirationTime("10m")
        .sign(new TextEncoder().encode(secret));
    const authed = await spawnServer([], { LEASEHOLD_JWT_SECRET: secret });
    const context = await browser.newContext({ viewport: { width: 1100, height: 860 } });
    try {
      const page = await context.newPage();
      page.on("pageerror", (error) => pageErrors.push(`auth: ${error.message}`));
      await page.goto(`${authed.url}/?account=acme&session=${session}&device=browser`);
      const notice = page.locator("#auth-notice");
      await page.locator('#auth-notice[data-kind="error"]').waitFor();
      await expect(notice.textContent()).resolves.toBe(
        "This server requires a bearer token: paste one above.",
      );

      await page.fill("#token", await token("someone-else"));
      await page.locator("#token").blur();
      await page
        .locator("#auth-notice", { hasText: "This token does not give access to account “acme”." })
        .waitFor();

      const good = await token("acme");
      const listed = page.waitForRequest(
        (r) =>
          r.url().endsWith("/leasehold.v1.LeaseService/List") &&
          r.headers().authorization === `Bearer ${good}`,
      );
      await page.fill("#token", good);
      await page.locator("#token").blur();
      await listed;
      await page.locator('#feed-status[data-state="live"]').waitFor();
      await page.locator('#auth-notice[data-kind="ok"]').waitFor();
      await expect(notice.textContent()).resolves.toBe("Calls carry your bearer token.");
      await page.click("#start");
      const running = page.locator('#device-status[data-running="true"]');
      await running.waitFor();
      const runId = await running.getAttribute("data-run");
      await page
        .locator(
          `#transitions li[data-type="ACQUIRED"][data-session="${session}"][data-run="${runId}"]`,
        )
        .waitFor();
      expect(page.url()).not.toContain(good);
      await screenshot(page, "5-authenticated");
      await page.click("#stop");
      await page.locator("#device-note", { hasText: "Stopped and released." }).waitFor();
      expect(pageErrors).toEqual([]);
    } finally {
      await context.close();
      await authed.stop();
    }
  });
});
