// Streams for tests: a request stream the test pushes into, and a reader
// that collects a response stream so a test can wait for the message it
// expects (an event, not a guessed sleep).

import type { ChildProcess } from "node:child_process";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { create } from "@bufbuild/protobuf";
import { DurationSchema } from "@bufbuild/protobuf/wkt";
import { ConnectError } from "@connectrpc/connect";
import type {
  KeepAliveRequestSchema,
  KeepAliveResponse,
  KeepRequestSchema,
  KeepResponse,
  WatchResponse,
} from "../../src/gen/leasehold/v1/lease_pb.js";
import type { LeaseClient } from "./server.js";

export const ms = (n: number) =>
  create(DurationSchema, { seconds: BigInt(Math.floor(n / 1000)), nanos: (n % 1000) * 1e6 });

/** An async iterable the test pushes values into, then ends. */
export class Pushable<T> implements AsyncIterable<T> {
  private queue: T[] = [];
  private ended = false;
  private wake: (() => void) | undefined;

  push(value: T) {
    this.queue.push(value);
    this.wake?.();
  }

  end() {
    this.ended = true;
    this.wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<T> {
    for (;;) {
      const next = this.queue.shift();
      if (next !== undefined) {
        yield next;
        continue;
      }
      if (this.ended) return;
      await new Promise<void>((resolve) => {
        this.wake = resolve;
      });
      this.wake = undefined;
    }
  }
}

/** Reads a response stream in the background into a queue. */
export class StreamReader<T> {
  readonly received: T[] = [];
  private cursor = 0;
  private waiters: (() => void)[] = [];
  /** Set when the stream ended; `error` when it ended with one. */
  done = false;
  error: ConnectError | undefined;
  readonly finished: Promise<void>;

  constructor(stream: AsyncIterable<T>) {
    this.finished = (async () => {
      try {
        for await (const message of stream) {
          this.received.push(message);
          this.notify();
        }
      } catch (error) {
        this.error = ConnectError.from(error);
      } finally {
        this.done = true;
        this.notify();
      }
    })();
  }

  private notify() {
    const waiters = this.waiters;
    this.waiters = [];
    for (const w of waiters) w();
  }

  /**
   * The next message after those already taken that satisfies `match`
   * (messages skipped on the way are consumed). Rejects when the stream
   * ends first or `timeoutMs` passes.
   */
  next(match: (m: T) => boolean = () => true, timeoutMs = 20_000): Promise<T> {
    return this.until(() => {
      while (this.cursor < this.received.length) {
        const m = this.received[this.cursor++] as T;
        if (match(m)) return { m };
      }
      return undefined;
    }, timeoutMs);
  }

  /**
   * The first message not yet taken that satisfies `match`, leaving the
   * others in place (for multiplexed answers that arrive in any order).
   */
  take(match: (m: T) => boolean, timeoutMs = 20_000): Promise<T> {
    return this.until(() => {
      for (let i = this.cursor; i < this.received.length; i++) {
        const m = this.received[i] as T;
        if (match(m)) {
          this.received.splice(i, 1);
          return { m };
        }
      }
      return undefined;
    }, timeoutMs);
  }

  /** Runs `find` now and whenever a message arrives, until it finds one, the stream ends or time runs out. */
  private async until(find: () => { m: T } | undefined, timeoutMs: number): Promise<T> {
    const deadline = performance.now() + timeoutMs;
    for (;;) {
      const found = find();
      if (found) return found.m;
      if (this.done) {
        throw new Error(`stream ended before the expected message: ${this.error?.message ?? "ok"}`);
      }
      const left = deadline - performance.now();
      if (left <= 0) {
        throw new Error(
          `timed out after ${timeoutMs} ms waiting for a stream message; ${this.received.length} received (${this.received.map(kindOf).join(", ")})`,
        );
      }
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        this.waiters.push(() => {
          clearTimeout(timer);
          resolve();
        });
      });
    }
  }

  /** Messages received and not yet taken by `next`. */
  pending(): T[] {
    return this.received.slice(this.cursor);
  }
}

export type KeepAliveInit = MessageInitShape<typeof KeepAliveRequestSchema>;

export interface KeepAliveStream {
  send(request: KeepAliveInit): void;
  reader: StreamReader<KeepAliveResponse>;
  /** Ends the request side (half-close). */
  end(): void;
  /** Cancels the call. */
  abort(): void;
}

export function openKeepAlive(client: LeaseClient): KeepAliveStream {
  const requests = new Pushable<KeepAliveInit>();
  const controller = new AbortController();
  const responses = client.keepAlive(requests, { signal: controller.signal });
  return {
    send: (r) => requests.push(r),
    reader: new StreamReader(responses),
    end: () => requests.end(),
    abort: () => controller.abort(),
  };
}

export function openWatch(
  client: LeaseClient,
  key: { accountId: string; sessionId: string },
  includeRenewals = false,
): { reader: StreamReader<WatchResponse>; abort(): void } {
  const controller = new AbortController();
  const responses = client.watch({ key, includeRenewals }, { signal: controller.signal });
  return { reader: new StreamReader(responses), abort: () => controller.abort() };
}

/** The next KeepAlive answer for one run (answers for other runs stay queued). */
export function answerFor(stream: KeepAliveStream, runId: string, timeoutMs?: number) {
  return stream.reader.take((m) => m.runId === runId, timeoutMs);
}

/** Resolves when a server process writes a log line (pino: stdout) matching `pattern`. */
export function logLine(child: ChildProcess, pattern: RegExp, timeoutMs = 20_000): Promise<string> {
  return new Promise((resolve, reject) => {
    let buffer = "";
    const timer = setTimeout(() => {
      child.stdout?.off("data", onData);
      reject(new Error(`no log line matching ${pattern}`));
    }, timeoutMs);
    const onData = (chunk: Buffer) => {
      buffer += chunk.toString();
      const lines = buffer.split("\n");
      buffer = lines.pop() ?? "";
      const line = lines.find((l) => pattern.test(l));
      if (line !== undefined) {
        clearTimeout(timer);
        child.stdout?.off("data", onData);
        resolve(line);
      }
    };
    child.stdout?.on("data", onData);
  });
}

/** A message's oneof case (`snapshot`, `event`, …) for error messages. */
function kindOf(message: unknown): string {
  const kind = (message as { kind?: { case?: unknown } } | undefined)?.kind?.case;
  return typeof kind === "string" ? kind : typeof message;
}

export type KeepInit = MessageInitShape<typeof KeepRequestSchema>;

export interface KeepStream {
  send(request: KeepInit): void;
  reader: StreamReader<KeepResponse>;
  /** The answer to request `id` (answers to others stay queued). */
  answer(id: bigint, timeoutMs?: number): Promise<KeepResponse>;
  /** Ends the request side (half-close). */
  end(): void;
  /** Cancels the call. */
  abort(): void;
}

/** A Keep stream (docs/keepers.md): requests pushed by the test, answers read in the background. */
export function openKeep(client: LeaseClient): KeepStream {
  const requests = new Pushable<KeepInit>();
  const controller = new AbortController();
  const reader = new StreamReader(client.keep(requests, { signal: controller.signal }));
  return {
    send: (r) => requests.push(r),
    reader,
    answer: (id, timeoutMs) => reader.take((m) => m.id === id, timeoutMs),
    end: () => requests.end(),
    abort: () => controller.abort(),
  };
}
