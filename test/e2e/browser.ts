// Debian's Chromium, driven by playwright-core (which downloads no browser of
// its own). A browser that cannot start fails the test run: it never skips.

import { access, constants, mkdir } from "node:fs/promises";
import path from "node:path";
import { type Browser, chromium, type Page } from "playwright-core";
import { repoRoot } from "../support/server.js";

export const chromiumPath = process.env.LEASEHOLD_CHROMIUM ?? "/usr/bin/chromium";

/** Where screenshots go: test-results/ is git-ignored and kept by CI as artifacts. */
export const artifactsDir = path.join(repoRoot, "test-results", "e2e");

/**
 * Starts headless Chromium. Every launch gets a fresh profile folder
 * (playwright passes its own new --user-data-dir), and every context made
 * from it is a separate device: its own storage and its own network state.
 */
export async function launchChromium(): Promise<Browser> {
  try {
    await access(chromiumPath, constants.X_OK);
  } catch {
    throw new Error(
      `Chromium is not installed at ${chromiumPath}: apt-get install -y chromium (or set LEASEHOLD_CHROMIUM)`,
    );
  }
  await mkdir(artifactsDir, { recursive: true });
  return chromium.launch({
    executablePath: chromiumPath,
    headless: true,
    timeout: 60_000,
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
}

/** Saves a full-page screenshot under test-results/e2e/ and returns its path. */
export async function screenshot(page: Page, name: string): Promise<string> {
  const file = path.join(artifactsDir, `${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  return file;
}

/**
 * Records, in the page, what it shows as it changes: whether this device
 * runs (`running`: "true" or "false"), the start button (`start`: "enabled:
 * Start run", "disabled: Running on desktop — 2 s left", …) and each entry
 * of the recent changes as it first appears (`transition`: "EXPIRED <run
 * id>"). Every entry carries this machine's wall clock, which every page
 * shares, so a test can put what two devices showed in order.
 */
export const pageLogScript = `
  window.__log = [];
  const last = new Map();
  const note = (what, value) => {
    if (last.get(what) === value) return;
    last.set(what, value);
    window.__log.push({ what, value, at: Date.now() });
  };
  const seen = new Set();
  new MutationObserver(() => {
    const status = document.getElementById("device-status");
    if (status?.dataset.running) note("running", status.dataset.running);
    const start = document.getElementById("start");
    if (start) note("start", (start.disabled ? "disabled: " : "enabled: ") + start.textContent);
    for (const li of document.querySelectorAll("#transitions li")) {
      const id = li.dataset.type + " " + li.dataset.run;
      if (seen.has(id)) continue;
      seen.add(id);
      window.__log.push({ what: "transition", value: id, at: Date.now() });
    }
  }).observe(document, { subtree: true, childList: true, attributes: true, characterData: true });
`;

export interface PageLogEntry {
  what: "running" | "start" | "transition";
  value: string;
  /** Date.now() in the page. */
  at: number;
}

export function pageLog(page: Page): Promise<PageLogEntry[]> {
  return page.evaluate(() => (globalThis as unknown as { __log: PageLogEntry[] }).__log);
}
