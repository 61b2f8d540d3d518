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
 * Records, in the page, every change of whether it shows itself as running,
 * with the wall clock of this machine (every page shares it), so a test can
 * order what two devices showed.
 */
export const runningLogScript = `
  window.__running = [];
  new MutationObserver(() => {
    const el = document.getElementById("device-status");
    if (!el) return;
    const running = el.dataset.running === "true";
    const log = window.__running;
    if (log.length === 0 ? running : log[log.length - 1].running !== running) {
      log.push({ running, at: Date.now() });
    }
  }).observe(document, { subtree: true, attributes: true, attributeFilter: ["data-running"] });
`;

export interface RunningChange {
  running: boolean;
  at: number;
}

export function runningLog(page: Page): Promise<RunningChange[]> {
  return page.evaluate(() => (globalThis as unknown as { __running: RunningChange[] }).__running);
}
