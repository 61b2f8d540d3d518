// One KeepAlive stream per client, shared by every lease the client keeps
// alive (DESIGN §6). The stream opens when the first lease registers and
// closes when the last one leaves. When it fails — an error, an end, or a
// renewal left unanswered (a stalled connection) — it reconnects over a fresh
// connection to the next configured instance, after a backoff with full
// jitter, and re-sends a renewal for every lease (same run_id: renewals are
// idempotent).
//
// The channel never decides that a lease is still held: it reports each
// answer with the monotonic time its request was pushed, and the lease's
// owner (runExclusive) sets its local deadline from that.

import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code, createClient } from "@connectrpc/connect";
import {
  type HandoffRequested,
  type KeepAliveRequestSchema,
  type KeepAliveResponse,
  type Lease,
  LeaseService,
} from "../gen/leasehold/v1/lease_pb.js";
import { lossCauseFromReason } from "../protocol/loss-reason.js";
import {
  type LeaseholdError,
  type LossCause,
  toLeaseholdError,
  UnavailableError,
} from "./errors.js";
import { RequestQueue } from "./request-queue.js";
import { createEndpoint, type Endpoint, type TransportOptions } from "./transport.js";

/** Something that happened to the client's shared KeepAlive stream (for logs and tests). */
export type KeepAliveEvent =
  | { type: "keepalive-open"; baseUrl: string }
  | {
      type: "keepalive-failed";
      baseUrl: string;
      error: LeaseholdError;
      /** Delay before the next attempt; undefined when the failure is final. */
      retryInMs: number | undefined;
    }
  | { type: "keepalive-closed"; baseUrl: string };

/** A lease kept alive on the shared stream, and where its answers go. */
export interface KeepAliveTarget {
  readonly key: { readonly accountId: string; readonly sessionId: string };
  readonly runId: string;
  /** A renewal unanswered for this long means the stream is stalled. */
  readonly responseTimeoutMs: number;
  /** A renewal succeeded. `sentAt` is the monotonic time its request was pushed (undefined for an unsolicited answer). */
  onRenewed(lease: Lease, sentAt: number | undefined): void;
  /** The server will never renew this run again. */
  onLost(cause: LossCause | undefined): void;
  /** Someone asked this run to finish and release. */
  onHandoffRequested(request: HandoffRequested): void;
  /** The stream failed in a way retrying cannot fix (e.g. PERMISSION_DENIED). */
  onFailed(error: LeaseholdError): void;
}

/** The handle of a registered lease. */
export interface KeepAliveRegistration {
  /** Sends a renewal now (queued until the stream is back if it is reconnecting). */
  renew(): void;
  /** Stops keeping the lease alive. */
  remove(): void;
}

/** Where and how the channel connects, and how it backs off. */
export interface KeepAliveChannelOptions {
  /** Instances to connect to, in turn: each reconnect moves to the next one. */
  baseUrls: readonly string[];
  /** Protocol, token and interceptors, as for the client's other calls. */
  transport: TransportOptions;
  /** First reconnect delay bound, in ms; default 100. */
  backoffInitialMs?: number;
  /** Largest reconnect delay bound, in ms; default 2 000. */
  backoffMaxMs?: number;
  /** The monotonic clock; default performance.now. */
  now?: () => number;
  /** Told when the stream opens, fails or closes. */
  onEvent?: (event: KeepAliveEvent) => void;
}

interface Entry {
  target: KeepAliveTarget;
  /** Push times of renewals not yet answered on the current stream, oldest first. */
  outstanding: number[];
}

interface OpenStream {
  generation: number;
  endpoint: Endpoint;
  queue: RequestQueue<MessageInitShape<typeof KeepAliveRequestSchema>>;
  abort: AbortController;
}

// Codes after which sending the same renewals again cannot succeed.
const definitiveCodes = new Set<Code>([
  Code.InvalidArgument,
  Code.Unauthenticated,
  Code.PermissionDenied,
  Code.Unimplemented,
  Code.FailedPrecondition,
]);

function entryId(key: { accountId: string; sessionId: string }, runId: string): string {
  return JSON.stringify([key.accountId, key.sessionId, runId]);
}

/** The shared, self-reconnecting KeepAlive stream of one client. */
export class KeepAliveChannel {
  private readonly entries = new Map<string, Entry>();
  private readonly now: () => number;
  private stream: OpenStream | undefined;
  private generation = 0;
  private urlIndex = 0;
  private failures = 0;
  private reconnectTimer: NodeJS.Timeout | undefined;
  private closed = false;

  constructor(private readonly options: KeepAliveChannelOptions) {
    if (options.baseUrls.length === 0) throw new RangeError("at least one base URL is required");
    this.now = options.now ?? (() => performance.now());
  }

  /** Starts keeping a lease alive; the first renewal is sent when the stream (re)opens or on `renew()`. */
  register(target: KeepAliveTarget): KeepAliveRegistration {
    if (this.closed) throw new Error("the client is closed");
    const id = entryId(target.key, target.runId);
    const entry: Entry = { target, outstanding: [] };
    this.entries.set(id, entry);
    if (!this.stream && !this.reconnectTimer) this.open();
    return {
      renew: () => {
        if (this.entries.get(id) === entry) this.send(entry);
      },
      remove: () => {
        if (this.entries.get(id) !== entry) return;
        this.entries.delete(id);
        if (this.entries.size === 0) this.shutdown();
      },
    };
  }

  /** Ends the stream and forgets every lease (their owners stop on their own deadlines). */
  close(): void {
    this.closed = true;
    this.entries.clear();
    this.shutdown();
  }

  private send(entry: Entry): void {
    const stream = this.stream;
    if (!stream) return; // reconnecting: the reopened stream renews every lease
    const sentAt = this.now();
    entry.outstanding.push(sentAt);
    stream.queue.push({ key: entry.target.key, runId: entry.target.runId });
    const generation = stream.generation;
    const timer = setTimeout(() => {
      // Still unanswered on the same stream: the connection is stalled (a
      // half-open TCP connection, a frozen proxy). Reconnect elsewhere.
      if (this.stream?.generation === generation && entry.outstanding.includes(sentAt)) {
        this.fail(
          generation,
          new UnavailableError(
            `no answer to a renewal within ${entry.target.responseTimeoutMs}ms`,
            Code.Unavailable,
          ),
        );
      }
    }, entry.target.responseTimeoutMs);
    timer.unref();
  }

  private open(): void {
    this.reconnectTimer = undefined;
    const baseUrl = this.options.baseUrls[this.urlIndex % this.options.baseUrls.length] as string;
    // A fresh connection each time: a stalled HTTP/2 session would stall
    // every new stream opened on it too.
    const endpoint = createEndpoint(baseUrl, this.options.transport);
    const stream: OpenStream = {
      generation: ++this.generation,
      endpoint,
      queue: new RequestQueue(),
      abort: new AbortController(),
    };
    this.stream = stream;
    this.options.onEvent?.({ type: "keepalive-open", baseUrl });
    for (const entry of this.entries.values()) {
      entry.outstanding = [];
      this.send(entry);
    }
    const client = createClient(LeaseService, endpoint.transport);
    void (async () => {
      try {
        for await (const response of client.keepAlive(stream.queue, {
          signal: stream.abort.signal,
          timeoutMs: 0,
        })) {
          if (this.stream !== stream) return;
          this.dispatch(response);
        }
        if (this.stream === stream) {
          this.fail(
            stream.generation,
            new UnavailableError("the server ended the KeepAlive stream", Code.Unavailable),
          );
        }
      } catch (error) {
        if (this.stream === stream) this.fail(stream.generation, toLeaseholdError(error));
      } finally {
        endpoint.close();
      }
    })();
  }

  private dispatch(response: KeepAliveResponse): void {
    if (!response.key) return;
    const id = entryId(response.key, response.runId);
    const entry = this.entries.get(id);
    if (!entry) return;
    const result = response.result;
    switch (result.case) {
      case "lease": {
        // The answer to the oldest unanswered request; taking the oldest push
        // time can only make the owner's deadline earlier, never later.
        const sentAt = entry.outstanding.shift();
        this.failures = 0;
        entry.target.onRenewed(result.value, sentAt);
        break;
      }
      case "lost":
        this.entries.delete(id);
        entry.target.onLost(lossCauseFromReason(result.value.reason));
        if (this.entries.size === 0) this.shutdown();
        break;
      case "handoffRequested":
        entry.target.onHandoffRequested(result.value);
        break;
      default:
        break;
    }
  }

  private fail(generation: number, error: LeaseholdError): void {
    const stream = this.stream;
    if (!stream || stream.generation !== generation) return;
    this.stream = undefined;
    stream.abort.abort(error);
    stream.queue.end();
    stream.endpoint.close();
    if (definitiveCodes.has(error.code)) {
      const failed = [...this.entries.values()];
      this.entries.clear();
      for (const entry of failed) entry.target.onFailed(error);
      this.options.onEvent?.({
        type: "keepalive-failed",
        baseUrl: stream.endpoint.baseUrl,
        error,
        retryInMs: undefined,
      });
      return;
    }
    // Full jitter: many clients cut off by one instance's death do not all
    // land on the next instance at the same instant.
    const initial = this.options.backoffInitialMs ?? 100;
    const max = this.options.backoffMaxMs ?? 2_000;
    const bound = Math.min(max, initial * 2 ** Math.min(this.failures, 20));
    const delay = Math.random() * bound;
    this.failures += 1;
    this.urlIndex += 1;
    this.options.onEvent?.({
      type: "keepalive-failed",
      baseUrl: stream.endpoint.baseUrl,
      error,
      retryInMs: delay,
    });
    if (this.entries.size === 0 || this.closed) return;
    this.reconnectTimer = setTimeout(() => this.open(), delay);
  }

  private shutdown(): void {
    if (this.reconnectTimer) {
      clearTimeout(this.reconnectTimer);
      this.reconnectTimer = undefined;
    }
    const stream = this.stream;
    if (!stream) return;
    this.stream = undefined;
    // Half-close so the server ends the stream cleanly; cut it if it does not.
    stream.queue.end();
    const cut = setTimeout(() => {
      stream.abort.abort();
      stream.endpoint.close();
    }, 1_000);
    cut.unref();
    this.options.onEvent?.({ type: "keepalive-closed", baseUrl: stream.endpoint.baseUrl });
  }
}
