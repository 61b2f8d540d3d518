// KeepAlive and Watch on the native gRPC path (grpc-native.ts), over the same
// hubs as the Connect path (stream-service.ts), with the same validation and
// conversion, and the same loop: each hub's `pipe` decides what is written
// when, how a stream ends, and waits while its client does not read. What
// this file adds is how messages move on and off an HTTP/2 stream:
//
// - KeepAlive: request frames are read and submitted as they arrive, with
//   no promise per message once the caller's session decisions are known;
//   the answers of one renewal batch arrive in one write and are encoded
//   straight into one buffer (keepalive-wire.ts).
// - Watch: an event is encoded once, and the same bytes are written to every
//   watcher's stream.
//
// An outlet's write returns false when the HTTP/2 stream's buffer is full,
// and its drain is the stream's: while a client does not read, its messages
// wait in the hub, whose bounds apply as on the Connect path (a KeepAlive
// stream ends with RESOURCE_EXHAUSTED, a watcher gets a fresh snapshot
// instead of the changes it missed).

import { Code, ConnectError } from "@connectrpc/connect";
import { policyText } from "../../call/error-texts.js";
import {
  type KeepAliveRequest,
  type KeepRequest,
  type KeepResponse,
  KeepResponseSchema,
  type WatchRequest,
  WatchResponseSchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import type { LeaseChange } from "../../lease/lease-change.js";
import type { Limits } from "../../lease/limits.js";
import { readKeepAliveRequest } from "../../protocol/wire-reader.js";
import type { KeepAliveAnswer, KeepAliveHub } from "../streams/keepalive.js";
import type { Outlet } from "../streams/outlet.js";
import type { WatchHub, WatchMessage } from "../streams/watch-hub.js";
import type { NativeCall, NativeStreamHandler } from "./grpc-native.js";
import { encodeFrame } from "./grpc-wire.js";
import { type KeepServiceDeps, KeepSession } from "./keep-service.js";
import { encodeKeepAliveAnswers } from "./keepalive-wire.js";
import { keepAliveRequest, watchMessage, watchScope } from "./stream-service.js";

export interface NativeStreamsOptions {
  keepAlive: KeepAliveHub;
  watch: WatchHub;
  limits: Limits;
  /** The Keep stream's dependencies (keep-service.ts). */
  keep: KeepServiceDeps;
}

export function nativeStreams(options: NativeStreamsOptions): {
  KeepAlive: NativeStreamHandler;
  Watch: NativeStreamHandler;
  Keep: NativeStreamHandler;
} {
  // Events are shared by every watcher of their scope: encoded once, kept as
  // long as some watcher still has the change queued.
  const eventFrames = new WeakMap<LeaseChange, Buffer>();
  const frameOf = (message: WatchMessage): Buffer => {
    if (message.kind !== "change") return encodeFrame(WatchResponseSchema, watchMessage(message));
    let frame = eventFrames.get(message.change);
    if (!frame) {
      frame = encodeFrame(WatchResponseSchema, watchMessage(message));
      eventFrames.set(message.change, frame);
    }
    return frame;
  };
  return {
    KeepAlive: (call) => serveKeepAlive(call, options),
    Watch: (call) => serveWatch(call, options, frameOf),
    Keep: (call) => serveKeep(call, options.keep),
  };
}

const encodeKeepResponses = (messages: readonly KeepResponse[]): Buffer =>
  messages.length === 1
    ? encodeFrame(KeepResponseSchema, messages[0] as KeepResponse)
    : Buffer.concat(messages.map((m) => encodeFrame(KeepResponseSchema, m)));

/**
 * Keep: each request is handed to the session as it arrives, which checks it
 * through the call's policy and answers a refused one in its own `error`
 * (keep-service.ts). A heartbeat every few seconds per keeper is far from
 * KeepAlive's load: the messages are decoded and encoded by the generated code.
 */
function serveKeep(call: NativeCall, deps: KeepServiceDeps): void {
  const session = new KeepSession(deps, (message) => call.check(message));
  const reader = call.reader<KeepRequest>();
  session.pipe(callOutlet<KeepResponse>(call, encodeKeepResponses));
  call.onData((chunk) => {
    if (call.ended) return;
    let messages: KeepRequest[];
    try {
      messages = reader.push(chunk);
    } catch (error) {
      session.fail(error);
      return;
    }
    for (const message of messages) session.submit(message);
  });
  call.onEnd(() => {
    if (reader.incomplete) {
      session.fail(new ConnectError(policyText.endedInsideMessage, Code.InvalidArgument));
    } else {
      session.endRequests();
    }
  });
  // The keeper is not closed: its client re-attaches, or it runs to its deadline.
  call.onCancel(() => session.close());
}

/** The outlet of a native call: frames written to its stream, its end the call's. */
function callOutlet<T>(call: NativeCall, encode: (messages: readonly T[]) => Buffer): Outlet<T> {
  return {
    write: (messages) => call.write(encode(messages)),
    onDrain: (listener) => call.onDrain(listener),
    end: (error) => call.end(error),
  };
}

function serveKeepAlive(call: NativeCall, options: NativeStreamsOptions): void {
  const session = options.keepAlive.open();
  const reader = call.reader<KeepAliveRequest>(readKeepAliveRequest);
  const fail = (error: unknown) => session.fail(error);

  // Requests are handled in order. While one waits on an asynchronous check
  // (the session authorizer for a session not yet decided; the caller was
  // authenticated before the stream was read, grpc-native.ts), the ones
  // behind it wait here, and the stream is not read: flow control holds the
  // client back (what is queued is at most one window).
  let waiting: KeepAliveRequest[] | undefined;
  let ending = false;
  const submit = (message: KeepAliveRequest) => {
    try {
      session.submit(keepAliveRequest(message, options.limits));
    } catch (error) {
      fail(error);
    }
  };
  const release = () => {
    const queued = waiting ?? [];
    waiting = undefined;
    for (const message of queued) handle(message);
    if (waiting === undefined) {
      call.resumeReading();
      if (ending) end();
    }
  };
  const handle = (message: KeepAliveRequest) => {
    if (waiting) {
      waiting.push(message);
      return;
    }
    if (call.ended) return;
    let checked: void | Promise<void>;
    try {
      checked = call.check(message);
    } catch (error) {
      fail(error);
      return;
    }
    if (!(checked instanceof Promise)) {
      submit(message);
      return;
    }
    waiting = [];
    call.pauseReading();
    checked.then(() => {
      if (call.ended) return;
      submit(message);
      release();
    }, fail);
  };
  const end = () => {
    if (reader.incomplete) {
      fail(new ConnectError(policyText.endedInsideMessage, Code.InvalidArgument));
    } else {
      session.endRequests();
    }
  };

  session.pipe(callOutlet<KeepAliveAnswer>(call, encodeKeepAliveAnswers));
  call.onData((chunk) => {
    if (call.ended) return;
    let messages: KeepAliveRequest[];
    try {
      messages = reader.push(chunk);
    } catch (error) {
      fail(error);
      return;
    }
    for (const message of messages) handle(message);
  });
  call.onEnd(() => {
    ending = true;
    if (waiting === undefined) end();
  });
  // Releases nothing: the stream's leases run to their deadlines.
  call.onCancel(() => session.close());
}

function serveWatch(
  call: NativeCall,
  options: NativeStreamsOptions,
  frameOf: (message: WatchMessage) => Buffer,
): void {
  const reader = call.reader<WatchRequest>();
  let request: WatchRequest | undefined;
  let extra = false;
  call.onData((chunk) => {
    try {
      const messages = reader.push(chunk) as WatchRequest[];
      if (request === undefined) request = messages.shift();
      if (messages.length > 0) extra = true;
    } catch (error) {
      call.end(error);
    }
  });
  call.onEnd(() => {
    void (async () => {
      if (request === undefined || extra || reader.incomplete) {
        throw new ConnectError(
          request === undefined ? policyText.oneMessageGotNone : policyText.oneMessageGotMore,
          Code.InvalidArgument,
        );
      }
      // The policy takes the account's Watch slot here, and gives it back when the call ends.
      await call.check(request);
      // Ended while the checks were awaited (a deadline, a reset, a shutdown):
      // nothing is registered for it.
      if (call.ended) return;
      const scope = watchScope(request, options.limits);
      const watcher = options.watch.open(scope, { includeRenewals: request.includeRenewals });
      const close = () => watcher.close();
      // A shutdown or a deadline ends the call through its cancel hooks.
      call.onCancel(close);
      call.policy.onEnd(close);
      call.stream.once("close", close);
      watcher.pipe(
        callOutlet<WatchMessage>(call, (messages) =>
          messages.length === 1
            ? frameOf(messages[0] as WatchMessage)
            : Buffer.concat(messages.map(frameOf)),
        ),
      );
    })().catch((error: unknown) => call.end(error));
  });
}
