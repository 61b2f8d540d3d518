// Draws the page from its state. The page's elements are written once in
// index.html; rendering only sets their text, attributes and table rows, so
// focus and clicks are never lost to a re-created element.

import { Code } from "@connectrpc/connect";
import { EventType } from "../../src/gen/leasehold/v1/lease_pb.js";
import type { FeedStatus } from "./account-feed.js";
import type { AccountView, Transition } from "./account-view.js";
import type { Device } from "./device.js";
import { secondsLeft } from "./durations.js";

export interface PageState {
  view: AccountView;
  feed: FeedStatus;
  accountId: string;
  /** Whether the current feed's calls carry a bearer token. */
  tokenSent: boolean;
  /** Whether the server answered a call of the current feed. */
  answered: boolean;
  device: Device;
  /** The answer to the last button press, when it has something to say. */
  actionNote: string;
}

export interface DeviceFields {
  session: string;
  holder: string;
}

function byId(id: string): HTMLElement {
  const el = document.getElementById(id);
  if (!el) throw new Error(`#${id} is missing`);
  return el;
}

export function shortRunId(runId: string): string {
  return runId.slice(0, 8);
}

export function renderPage(state: PageState, fields: DeviceFields): void {
  const now = performance.now();
  renderFeed(state, now);
  renderDevice(state, fields, now);
  renderSessions(state, now);
  renderTransitions(state.view);
}

function renderFeed(state: PageState, now: number): void {
  const status = byId("feed-status");
  const notice = byId("auth-notice");
  const feed = state.feed;
  status.dataset.state = feed.kind;
  if (feed.kind === "connecting" || feed.kind === "listed") status.textContent = "Connecting…";
  else if (feed.kind === "live") status.textContent = "Live: changes appear as they happen.";
  else {
    const wait = secondsLeft(feed.retryAt, now);
    status.textContent = `Not live (${feed.message}); retrying${wait > 0 ? ` in ${wait} s` : ""}.`;
  }
  const refused = feed.kind === "retrying" ? feed.code : undefined;
  if (refused === Code.Unauthenticated) {
    notice.dataset.kind = "error";
    notice.textContent = state.tokenSent
      ? "The server refused this token. Paste a valid one."
      : "This server requires a bearer token: paste one above.";
  } else if (refused === Code.PermissionDenied) {
    notice.dataset.kind = "error";
    notice.textContent = `This token does not give access to account “${state.accountId}”.`;
  } else if (state.answered) {
    notice.dataset.kind = state.tokenSent ? "ok" : "dev";
    notice.textContent = state.tokenSent
      ? "Calls carry your bearer token."
      : "Development mode: the server accepts calls without a token (it listens on loopback only).";
  } else {
    notice.dataset.kind = "";
    notice.textContent = "";
  }
}

function renderDevice(state: PageState, fields: DeviceFields, now: number): void {
  const { device, view } = state;
  const s = device.state;
  const start = byId("start") as HTMLButtonElement;
  const stop = byId("stop") as HTMLButtonElement;
  const handoff = byId("handoff") as HTMLButtonElement;
  const ownRunId = s.kind === "idle" ? undefined : s.runId;
  const held = view.holder(fields.session, now);
  const elsewhere = held && held.lease.runId !== ownRunId ? held : undefined;

  if (s.kind === "running") {
    setButton(start, "Running here", true);
  } else if (s.kind === "starting") {
    setButton(start, "Starting…", true);
  } else if (s.kind === "stopping") {
    setButton(start, "Stopping…", true);
  } else if (elsewhere) {
    const left = secondsLeft(elsewhere.deadline, now);
    setButton(
      start,
      `Running on ${elsewhere.lease.holder || "another device"} — ${left} s left`,
      true,
    );
  } else {
    setButton(start, "Start run", fields.session === "" || fields.holder === "");
  }
  setButton(stop, "Stop", s.kind !== "running");
  setButton(
    handoff,
    elsewhere ? `Ask ${elsewhere.lease.holder || "the holder"} to hand off` : "Request handoff",
    elsewhere === undefined || s.kind !== "idle",
  );
  for (const id of ["device-name", "session", "ttl", "account"]) {
    (byId(id) as HTMLInputElement).disabled = s.kind !== "idle";
  }

  const status = byId("device-status");
  status.dataset.running = String(s.kind === "running");
  status.dataset.run = s.kind === "running" ? s.runId : "";
  if (s.kind === "running") {
    const left = secondsLeft(s.deadline, now);
    status.textContent =
      `Running here as ${s.lease.holder}: run ${shortRunId(s.runId)}, ` +
      `fencing token ${s.lease.fencingToken}, lease confirmed for ${left} s more.`;
  } else if (s.kind === "starting") {
    status.textContent = "Starting a run…";
  } else if (s.kind === "stopping") {
    status.textContent = "Stopping…";
  } else {
    status.textContent = "Not running.";
  }
  byId("device-note").textContent = [device.note, state.actionNote].filter(Boolean).join(" ");

  const request = s.kind === "running" ? view.handoffs.get(s.runId) : undefined;
  const box = byId("handoff-request");
  box.hidden = request === undefined;
  if (request) {
    byId("handoff-text").textContent =
      `${request.requesterHolder || "Another device"} asks this run to hand off` +
      (request.reason ? `: “${request.reason}”.` : ".");
  }
}

function setButton(el: HTMLButtonElement, text: string, disabled: boolean): void {
  if (el.textContent !== text) el.textContent = text;
  el.disabled = disabled;
}

function renderSessions(state: PageState, now: number): void {
  const { view, device } = state;
  const ownRunId = device.state.kind === "running" ? device.state.runId : undefined;
  const rows = [...view.sessions.entries()].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  const body = document.createElement("tbody");
  for (const [sessionId, held] of rows) {
    const tr = document.createElement("tr");
    tr.dataset.session = sessionId;
    const left = secondsLeft(held.deadline, now);
    const mine = held.lease.runId === ownRunId;
    if (mine) tr.classList.add("mine");
    if (left === 0) tr.classList.add("ending");
    cells(tr, [
      sessionId,
      mine ? `${held.lease.holder} (this device)` : held.lease.holder,
      shortRunId(held.lease.runId),
      String(held.lease.fencingToken),
      left === 0 ? "ending…" : `${left} s`,
    ]);
    tr.children[2]?.setAttribute("title", held.lease.runId);
    body.append(tr);
  }
  byId("sessions").querySelector("tbody")?.replaceWith(body);
  byId("no-sessions").hidden = rows.length > 0;
}

function cells(tr: HTMLTableRowElement, texts: string[]): void {
  for (const text of texts) {
    const td = document.createElement("td");
    td.textContent = text;
    tr.append(td);
  }
}

let shownView: AccountView | undefined;
let shownVersion = -1;

function renderTransitions(view: AccountView): void {
  // Only redraw when the list changed: it changes rarely.
  if (view === shownView && view.transitionsVersion === shownVersion) return;
  shownView = view;
  shownVersion = view.transitionsVersion;
  const transitions = view.transitions;
  const list = byId("transitions");
  list.replaceChildren(
    ...transitions.map((t) => {
      const li = document.createElement("li");
      const type = EventType[t.type] ?? String(t.type);
      li.dataset.type = type;
      li.dataset.session = t.sessionId;
      li.dataset.run = t.runId;
      const time = document.createElement("time");
      time.textContent = t.at?.toLocaleTimeString() ?? "";
      if (t.at) time.dateTime = t.at.toISOString();
      const badge = document.createElement("span");
      badge.className = "badge";
      badge.textContent = type;
      li.append(time, " ", t.sessionId, " ", badge, " ", describe(t));
      if (view.ranOutUnrecorded(t)) {
        li.dataset.ranOut = "";
        const note = document.createElement("small");
        note.textContent =
          " — not held now: it ran out without a renewal (the audit trail records EXPIRED only when the session is next acquired)";
        li.append(note);
      }
      return li;
    }),
  );
  byId("no-transitions").hidden = transitions.length > 0;
}

function describe(t: Transition): string {
  const run = `run ${shortRunId(t.runId)}`;
  const token = `token ${t.fencingToken}`;
  switch (t.type) {
    case EventType.HANDOFF_REQUESTED:
      return `${t.requesterHolder || "someone"} asked ${t.holder || "the holder"} (${run}) to hand off${
        t.reason ? `: “${t.reason}”` : ""
      }`;
    case EventType.REVOKED:
      return `${t.holder} (${run}, ${token})${t.reason ? `: “${t.reason}”` : ""}`;
    default:
      return `${t.holder} (${run}, ${token})`;
  }
}
