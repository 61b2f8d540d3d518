// The payload codec of the notification channel (DESIGN §3): what one NOTIFY
// payload on `leasehold_changes` says, and how it is written and read. Pure:
// no connection, no timers; the publish batcher writes payloads with it and
// the notifier reads them.
//
// Wire format (version 1): compact JSON arrays, so that one payload carries
// dozens of changes. bigints travel as decimal strings.
//   {"v":1,"s":source,"c":[[type,account,session,run,token,holder,at,reason,requester,event,lease]]}
//   lease: [ttlMs, acquiredAt, expiresAt, remaining] or 0; a keeper's lease
//   adds its keeper id as a fifth element (a reader that knows four ignores it)
//   {"v":1,"s":source,"i":[[account,session],...],"f":forMs}
//   {"v":1,"s":source,"h":1}
//   {"v":1,"s":source,"p":nonce}

import type { ChangeType, LeaseChange } from "../../lease/lease-change.js";
import type { LeaseRecord, Scope } from "../../lease/types.js";

export const notificationChannel = "leasehold_changes";

// PostgreSQL refuses payloads of 8000 bytes or more; stay clear of it.
export const maxPayloadBytes = 7_900;

export type NotifierMessage =
  | { kind: "changes"; source: string; changes: LeaseChange[] }
  /** `source` wants RENEWED changes of these scopes for `forMs` from now. */
  | { kind: "interest"; source: string; scopes: Scope[]; forMs: number }
  /** `source` (re)started listening: others should announce their interest. */
  | { kind: "hello"; source: string }
  /** `source` checks that its own LISTEN connection still receives. */
  | { kind: "ping"; source: string; nonce: string };

export type ControlMessage = Extract<NotifierMessage, { kind: "interest" | "hello" }>;

type WireLease = [string, string, string, string] | [string, string, string, string, string];
type WireChange = [
  ChangeType,
  string,
  string,
  string,
  string,
  string,
  string,
  string,
  string,
  string,
  WireLease | 0,
];

function wireLease(l: LeaseRecord): WireLease {
  const times: [string, string, string, string] = [
    l.ttlMs.toString(),
    l.acquiredAtUs.toString(),
    l.expiresAtUs.toString(),
    l.remainingUs.toString(),
  ];
  return l.keeperId ? [...times, l.keeperId] : times;
}

function wireChange(c: LeaseChange): WireChange {
  return [
    c.type,
    c.accountId,
    c.sessionId,
    c.runId,
    c.fencingToken.toString(),
    c.holder,
    c.atUs.toString(),
    c.reason,
    c.requesterHolder,
    c.eventId.toString(),
    c.lease ? wireLease(c.lease) : 0,
  ];
}

/** Packs changes into as few payloads as fit under PostgreSQL's limit. */
export function encodeChanges(source: string, changes: readonly LeaseChange[]): string[] {
  const head = `{"v":1,"s":${JSON.stringify(source)},"c":[`;
  const headBytes = Buffer.byteLength(head) + 2;
  const out: string[] = [];
  let parts: string[] = [];
  let bytes = headBytes;
  for (const change of changes) {
    const part = JSON.stringify(wireChange(change));
    const size = Buffer.byteLength(part) + 1;
    if (parts.length > 0 && bytes + size > maxPayloadBytes) {
      out.push(`${head}${parts.join(",")}]}`);
      parts = [];
      bytes = headBytes;
    }
    parts.push(part);
    bytes += size;
  }
  if (parts.length > 0) out.push(`${head}${parts.join(",")}]}`);
  return out;
}

export function encodePing(source: string, nonce: string): string {
  return JSON.stringify({ v: 1, s: source, p: nonce });
}

/** A hello in one payload; an interest in as many as its scopes need. */
export function encodeControl(source: string, message: ControlMessage): string[] {
  if (message.kind === "hello") return [JSON.stringify({ v: 1, s: source, h: 1 })];
  const out: string[] = [];
  let scopes: [string, string][] = [];
  const emit = () => {
    out.push(JSON.stringify({ v: 1, s: source, i: scopes, f: message.forMs }));
    scopes = [];
  };
  let bytes = 100;
  for (const s of message.scopes) {
    const size = Buffer.byteLength(JSON.stringify([s.accountId, s.sessionId])) + 1;
    if (scopes.length > 0 && bytes + size > maxPayloadBytes) {
      emit();
      bytes = 100;
    }
    scopes.push([s.accountId, s.sessionId]);
    bytes += size;
  }
  if (scopes.length > 0) emit();
  return out;
}

/**
 * Every payload starts with its source, so an instance skips its own
 * changes, interests and hellos (delivered in process already) without
 * parsing them. Its own pings are not skipped: they check its LISTEN
 * connection.
 */
export function ownPayloadFilter(source: string): (payload: string) => boolean {
  const ownPrefix = `{"v":1,"s":${JSON.stringify(source)},`;
  const ownPing = `${ownPrefix}"p":`;
  return (payload) => payload.startsWith(ownPrefix) && !payload.startsWith(ownPing);
}

const changeTypes = new Set<string>([
  "acquired",
  "released",
  "expired",
  "revoked",
  "handoff_requested",
  "renewed",
]);

/** Reads a payload; undefined for anything this version does not understand. */
export function decodeMessage(payload: string): NotifierMessage | undefined {
  try {
    const m = JSON.parse(payload) as Record<string, unknown>;
    if (m.v !== 1 || typeof m.s !== "string") return undefined;
    if (m.h === 1) return { kind: "hello", source: m.s };
    if (typeof m.p === "string") return { kind: "ping", source: m.s, nonce: m.p };
    if (Array.isArray(m.i) && typeof m.f === "number") {
      const scopes = (m.i as unknown[]).map((x) => {
        const [accountId, sessionId] = x as [string, string];
        if (typeof accountId !== "string" || typeof sessionId !== "string") throw new Error();
        return { accountId, sessionId };
      });
      return { kind: "interest", source: m.s, scopes, forMs: m.f };
    }
    if (!Array.isArray(m.c)) return undefined;
    const changes = (m.c as WireChange[]).map((w): LeaseChange => {
      if (!changeTypes.has(w[0])) throw new Error(`unknown change ${w[0]}`);
      const lease = w[10];
      return {
        type: w[0],
        accountId: w[1],
        sessionId: w[2],
        runId: w[3],
        fencingToken: BigInt(w[4]),
        holder: w[5],
        atUs: BigInt(w[6]),
        reason: w[7],
        requesterHolder: w[8],
        eventId: BigInt(w[9]),
        lease: lease
          ? {
              accountId: w[1],
              sessionId: w[2],
              runId: w[3],
              fencingToken: BigInt(w[4]),
              holder: w[5],
              ttlMs: BigInt(lease[0]),
              acquiredAtUs: BigInt(lease[1]),
              expiresAtUs: BigInt(lease[2]),
              remainingUs: BigInt(lease[3]),
              ...(typeof lease[4] === "string" && lease[4] !== "" ? { keeperId: lease[4] } : {}),
            }
          : undefined,
      };
    });
    return { kind: "changes", source: m.s, changes };
  } catch {
    return undefined;
  }
}
