// Readable text for leases and events, and the --json form (protobuf JSON,
// int64 as strings, one message per line).

import { type DescMessage, type MessageShape, toJsonString } from "@bufbuild/protobuf";
import { dateFromTimestamp, msFromDuration } from "../client/index.js";
import { type Event, EventType, type Lease } from "../gen/leasehold/v1/lease_pb.js";

/** "acct/session" */
export function keyText(key: { accountId: string; sessionId: string } | undefined): string {
  return key ? `${key.accountId}/${key.sessionId}` : "?";
}

/** Seconds with one decimal: "9.8s". */
export function secondsText(ms: number): string {
  return `${(ms / 1000).toFixed(1)}s`;
}

function holderText(holder: string): string {
  return holder === "" ? "(no holder label)" : JSON.stringify(holder);
}

/** `"desktop" (run …, token 42), 9.8s left` */
export function leaseText(lease: Lease): string {
  return `${holderText(lease.holder)} (run ${lease.runId}, token ${lease.fencingToken}), ${secondsText(msFromDuration(lease.remaining))} left`;
}

/** A timestamp as ISO-8601 UTC, or "-" when unset. */
export function timeText(t: Parameters<typeof dateFromTimestamp>[0]): string {
  return dateFromTimestamp(t)?.toISOString() ?? "-";
}

const eventNames: Record<EventType, string> = {
  [EventType.UNSPECIFIED]: "UNSPECIFIED",
  [EventType.ACQUIRED]: "ACQUIRED",
  [EventType.RELEASED]: "RELEASED",
  [EventType.EXPIRED]: "EXPIRED",
  [EventType.REVOKED]: "REVOKED",
  [EventType.HANDOFF_REQUESTED]: "HANDOFF_REQUESTED",
  [EventType.RENEWED]: "RENEWED",
};

/** One line for an event: time, type, session, run, token and the rest that is set. */
export function eventText(event: Event): string {
  const parts = [
    timeText(event.at),
    (eventNames[event.type] ?? String(event.type)).padEnd(17),
    keyText(event.key),
  ];
  if (event.runId !== "") parts.push(`run ${event.runId}`);
  if (event.fencingToken !== 0n) parts.push(`token ${event.fencingToken}`);
  if (event.holder !== "") parts.push(`holder ${JSON.stringify(event.holder)}`);
  if (event.requesterHolder !== "") parts.push(`by ${JSON.stringify(event.requesterHolder)}`);
  if (event.reason !== "") parts.push(`reason ${JSON.stringify(event.reason)}`);
  if (event.lease?.remaining)
    parts.push(`${secondsText(msFromDuration(event.lease.remaining))} left`);
  return parts.join("  ");
}

/** Rows of a table, columns padded to their widest cell. */
export function table(header: string[], rows: string[][]): string {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)));
  const line = (cells: string[]) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i] ?? 0)))
      .join("  ")
      .trimEnd();
  return `${[line(header), ...rows.map(line)].join("\n")}\n`;
}

/** Writes one message as a line of protobuf JSON. */
export function printJson<D extends DescMessage>(schema: D, message: MessageShape<D>): void {
  process.stdout.write(`${toJsonString(schema, message)}\n`);
}
