// The gRPC transport's connection management: one HTTP/2 session per
// transport, opened by the first call, replaced after it closes or receives
// GOAWAY, unreferenced while idle and closed after the idle timeout (as
// connect-node's http2-session-manager.ts, without its pings). The calls
// themselves are grpc-call.ts's.

import http2 from "node:http2";
import { Code, ConnectError } from "@connectrpc/connect";
import { connectErrorFromNodeReason } from "./node-error.js";

const { NGHTTP2_CANCEL } = http2.constants;

/** What waits for a session: a call's attempt (grpc-call.ts). */
export interface SessionUser {
  /** The session is up (`retried`: the second try after a session refused the stream). */
  connected(conn: Conn, retried: boolean): void;
  /** The session failed before it connected. */
  fail(error: ConnectError): void;
}

/** One HTTP/2 session and the streams open on it. */
export class Conn {
  connected = false;
  /** Calls waiting for the session to connect. */
  waiting: { attempt: SessionUser; retried: boolean }[] = [];
  active = 0;
  idleSince = 0;
  idleTimer: NodeJS.Timeout | undefined;

  constructor(
    readonly session: http2.ClientHttp2Session,
    private readonly idleMs: number,
  ) {}

  failWaiting(error: ConnectError): void {
    const waiting = this.waiting;
    this.waiting = [];
    for (const w of waiting) w.attempt.fail(error);
  }

  acquired(): void {
    // A session with calls keeps the process alive; an idle one does not.
    if (this.active++ === 0) this.session.ref();
  }

  released(): void {
    if (--this.active === 0) this.idle();
  }

  /** No stream is open: let the process exit, and close after idleMs without one. */
  idle(): void {
    if (!this.session.destroyed) this.session.unref();
    this.idleSince = performance.now();
    // One timer per idle period, not per call: it re-arms itself for what is
    // left if calls came and went meanwhile.
    if (this.idleTimer === undefined) this.armIdle(this.idleMs);
  }

  private armIdle(ms: number): void {
    this.idleTimer = setTimeout(() => {
      this.idleTimer = undefined;
      if (this.active > 0) return;
      const left = this.idleMs - (performance.now() - this.idleSince);
      if (left > 0) this.armIdle(left);
      else this.session.close();
    }, ms);
    this.idleTimer.unref();
  }
}

/** The transport's connection: one current session, plus any still draining after GOAWAY. */
export class Connection {
  private current: Conn | undefined;
  private readonly all = new Set<Conn>();

  constructor(
    private readonly authority: string,
    private readonly nodeOptions:
      | http2.ClientSessionOptions
      | http2.SecureClientSessionOptions
      | undefined,
    private readonly idleMs: number,
  ) {}

  /**
   * Hands `attempt` a connected session: at once when the current one is up,
   * once it connects, or a new one when the current one is gone or going.
   */
  whenReady(attempt: SessionUser, retried = false): void {
    let conn = this.current;
    if (conn === undefined || conn.session.closed || conn.session.destroyed) conn = this.open();
    if (conn.connected) attempt.connected(conn, retried);
    else conn.waiting.push({ attempt, retried });
  }

  close(reason: ConnectError): void {
    this.current = undefined;
    for (const conn of this.all) {
      if (!conn.session.destroyed) conn.session.destroy(reason, NGHTTP2_CANCEL);
    }
    this.all.clear();
  }

  private open(): Conn {
    const session = http2.connect(this.authority, this.nodeOptions);
    const conn = new Conn(session, this.idleMs);
    session.once("connect", () => {
      conn.connected = true;
      const waiting = conn.waiting;
      conn.waiting = [];
      for (const w of waiting) w.attempt.connected(conn, w.retried);
      // Every waiting call gave up meanwhile: an idle connection.
      if (conn.active === 0) conn.idle();
    });
    // Before it connects, the session's error is every waiting call's (as
    // connect-node: ECONNREFUSED is UNAVAILABLE); after, the calls see it
    // through their streams.
    session.on("error", (error: Error) => {
      if (!conn.connected) conn.failWaiting(connectErrorFromNodeReason(error));
    });
    session.on("goaway", () => {
      if (this.current === conn) this.current = undefined;
    });
    session.on("close", () => {
      if (this.current === conn) this.current = undefined;
      conn.failWaiting(
        new ConnectError("the connection closed before it was established", Code.Unavailable),
      );
      this.all.delete(conn);
      if (conn.idleTimer !== undefined) clearTimeout(conn.idleTimer);
    });
    // Referenced while it connects (calls wait on it), as connect-node's.
    this.current = conn;
    this.all.add(conn);
    return conn;
  }
}
