// The page: an account's sessions, live, and this browser as one device.
// Settings come from the query string (?account=&session=&device=&ttl=), so
// a link opens the same view on another device; the token stays in this
// tab's sessionStorage, never in the URL.

import "./style.css";
import { Code } from "@connectrpc/connect";
import { loadHistory, runAccountFeed } from "./account-feed.js";
import { AccountView } from "./account-view.js";
import { createLeaseClient, describeError } from "./api.js";
import { Device } from "./device.js";
import type { PageState } from "./render.js";
import { renderPage } from "./render.js";

const tokenKey = "leasehold.token";

function input(id: string): HTMLInputElement {
  const el = document.getElementById(id);
  if (!(el instanceof HTMLInputElement)) throw new Error(`#${id} is missing`);
  return el;
}

function button(id: string): HTMLButtonElement {
  const el = document.getElementById(id);
  if (!(el instanceof HTMLButtonElement)) throw new Error(`#${id} is missing`);
  return el;
}

const fields = {
  account: input("account"),
  token: input("token"),
  device: input("device-name"),
  session: input("session"),
  ttl: input("ttl"),
};

const params = new URLSearchParams(location.search);
fields.account.value = params.get("account") ?? "acme";
fields.session.value = params.get("session") ?? "s1";
fields.device.value = params.get("device") ?? "browser";
fields.ttl.value = params.get("ttl") ?? "15";
fields.token.value = sessionStorage.getItem(tokenKey) ?? "";

const client = createLeaseClient(location.origin, () => fields.token.value);

const state: PageState = {
  view: new AccountView(),
  feed: { kind: "connecting" },
  accountId: fields.account.value,
  tokenSent: fields.token.value.trim() !== "",
  answered: false,
  actionNote: "",
  device: new Device(client, {
    onLease: (lease, now) => state.view.upsert(lease, now),
    onReleased: (key, runId) => {
      if (key.accountId !== state.accountId) return;
      if (state.view.sessions.get(key.sessionId)?.lease.runId === runId) {
        state.view.sessions.delete(key.sessionId);
      }
    },
    onChange: () => render(),
  }),
};

function render(): void {
  renderPage(state, {
    session: fields.session.value.trim(),
    holder: fields.device.value.trim(),
  });
}

let feed: AbortController | undefined;

/** (Re)starts the live view of the account in the account field. */
function watchAccount(): void {
  feed?.abort();
  const controller = new AbortController();
  feed = controller;
  state.view = new AccountView();
  state.accountId = fields.account.value.trim();
  state.tokenSent = fields.token.value.trim() !== "";
  state.answered = false;
  state.feed = { kind: "connecting" };
  render();
  if (state.accountId === "") return;
  void runAccountFeed({
    client,
    accountId: state.accountId,
    view: state.view,
    signal: controller.signal,
    onChange: (status) => {
      if (feed !== controller) return;
      state.feed = status;
      if (status.kind === "listed" || status.kind === "live") state.answered = true;
      render();
    },
  });
  showHistory();
}

/** Adds the chosen session's recent audit trail to the changes shown. */
function showHistory(): void {
  const sessionId = fields.session.value.trim();
  const controller = feed;
  if (state.accountId === "" || sessionId === "" || !controller) return;
  const view = state.view;
  loadHistory(client, { accountId: state.accountId, sessionId }, view, controller.signal).then(
    () => {
      if (state.view === view) render();
    },
    // Not fatal: the live changes still arrive; the feed status shows trouble.
    () => {},
  );
}

function saveSettings(): void {
  const query = new URLSearchParams({
    account: fields.account.value.trim(),
    session: fields.session.value.trim(),
    device: fields.device.value.trim(),
    ttl: fields.ttl.value,
  });
  history.replaceState(null, "", `?${query}`);
}

fields.account.addEventListener("change", () => {
  saveSettings();
  watchAccount();
});
fields.token.addEventListener("change", () => {
  sessionStorage.setItem(tokenKey, fields.token.value.trim());
  watchAccount();
});
for (const field of [fields.device, fields.session, fields.ttl]) {
  field.addEventListener("change", () => {
    saveSettings();
    if (field === fields.session) showHistory();
    render();
  });
}
for (const form of document.querySelectorAll("form")) {
  form.addEventListener("submit", (e) => e.preventDefault());
}

button("start").addEventListener("click", () => {
  const ttlSeconds = Number(fields.ttl.value);
  state.actionNote = "";
  void state.device.start({
    key: { accountId: state.accountId, sessionId: fields.session.value.trim() },
    holder: fields.device.value.trim(),
    ttlMs: Math.round(ttlSeconds * 1000),
  });
});

const stop = () => {
  state.actionNote = "";
  void state.device.stop();
};
button("stop").addEventListener("click", stop);
button("hand-over").addEventListener("click", stop);

button("handoff").addEventListener("click", async () => {
  const holder = fields.device.value.trim();
  state.actionNote = "";
  try {
    const answer = await client.requestHandoff({
      key: { accountId: state.accountId, sessionId: fields.session.value.trim() },
      requesterHolder: holder,
      reason: `continue on ${holder}`,
    });
    state.actionNote = answer.delivered
      ? `Asked ${answer.current?.holder || "the holder"} to hand off.`
      : "Nobody holds the session any more: start a run here.";
  } catch (error) {
    state.actionNote =
      (error as { code?: Code }).code === Code.Unimplemented
        ? "This server does not support handoff requests."
        : `Handoff request failed: ${describeError(error)}`;
  }
  render();
});

watchAccount();
// The countdowns tick on their own; everything else renders on change.
setInterval(render, 250);
