// The two messages of every renewal on the native gRPC path, thousands a
// second, read and written without protobuf-es's reflection.
//
// Answers: a renewed lease is encoded straight into the frames of one
// write, with no message objects in between. protobuf-es's reflective
// encoder built a message tree per answer (eight submessages, BigInt
// arithmetic per timestamp) and spent about a quarter of the server's CPU
// under saturating renewals. Every other answer (lost, handoff requests,
// undecided renewals: rare) goes through protobuf-es as before. The bytes
// are exactly protobuf-es's (`toBinary` of the message keepAliveAnswer
// builds): fields in number order, proto3 defaults (empty strings, zero
// numbers) omitted, submessages always written.
//
// Requests are read by src/protocol/wire-reader.ts (shared with the client).
//
// test/keepalive-wire.test.ts holds the bytes to protobuf-es's with property tests.

import { KeepAliveResponseSchema } from "../../gen/leasehold/v1/lease_pb.js";
import type { LeaseRecord } from "../../lease/types.js";
import { frameHeaderBytes, writeFrameHeader } from "../../protocol/grpc-frame.js";
import type { KeepAliveAnswer } from "../streams/keepalive.js";
import { encodeFrame } from "./grpc-wire.js";
import { keepAliveAnswer } from "./stream-service.js";

const lengthDelimited = 2;
const varintType = 0;
const tag = (field: number, wireType: number) => (field << 3) | wireType;

// Field tags of the messages written here (lease.proto, google/protobuf).
const keyAccount = tag(1, lengthDelimited);
const keySession = tag(2, lengthDelimited);
const answerKey = tag(1, lengthDelimited);
const answerRunId = tag(2, lengthDelimited);
const answerLease = tag(3, lengthDelimited);
const leaseKey = tag(1, lengthDelimited);
const leaseRunId = tag(2, lengthDelimited);
const leaseToken = tag(3, varintType);
const leaseHolder = tag(4, lengthDelimited);
const leaseTtl = tag(5, lengthDelimited);
const leaseAcquiredAt = tag(6, lengthDelimited);
const leaseExpiresAt = tag(7, lengthDelimited);
const leaseRemaining = tag(8, lengthDelimited);
const leaseKeeperId = tag(9, lengthDelimited);
const secondsTag = tag(1, varintType);
const nanosTag = tag(2, varintType);

/** Bytes of a varint; negative numbers are 64-bit two's complement: ten. */
function varintSize(n: number): number {
  if (n < 0) return 10;
  let size = 1;
  while (n >= 128) {
    n = Math.floor(n / 128);
    size++;
  }
  return size;
}

/** A string's length in UTF-8 bytes: its length when it is ASCII, as ids and holders mostly are. */
function utf8Length(s: string): number {
  for (let i = 0; i < s.length; i++) {
    if (s.charCodeAt(i) >= 0x80) return Buffer.byteLength(s, "utf8");
  }
  return s.length;
}

const maxSafe = BigInt(Number.MAX_SAFE_INTEGER);

// What splitMicros leaves: module state rather than an object per call, as
// four times per answer adds up.
let splitSeconds: number | bigint = 0;
let splitNanos = 0;

/** Seconds and nanoseconds of a Timestamp (floored) or a Duration (truncated) from µs. */
function splitMicros(us: bigint, floored: boolean): void {
  if (us >= -maxSafe && us <= maxSafe) {
    const n = Number(us);
    let rest = n % 1_000_000;
    let s = (n - rest) / 1_000_000;
    if (floored && rest < 0) {
      rest += 1_000_000;
      s -= 1;
    }
    splitSeconds = s;
    splitNanos = rest * 1000;
    return;
  }
  let s = us / 1_000_000n;
  let rest = us % 1_000_000n;
  if (floored && rest < 0n) {
    rest += 1_000_000n;
    s -= 1n;
  }
  splitSeconds = s;
  splitNanos = Number(rest) * 1000;
}

/** An int64 as a number when exact, else the BigInt. */
function int64(v: bigint): number | bigint {
  return v >= -maxSafe && v <= maxSafe ? Number(v) : v;
}

function int64Size(v: number | bigint): number {
  if (typeof v === "number") return varintSize(v);
  return v < 0n ? 10 : bigVarintSize(v);
}

function bigVarintSize(v: bigint): number {
  let size = 1;
  while (v >= 128n) {
    v >>= 7n;
    size++;
  }
  return size;
}

function secondsNanosSize(seconds: number | bigint, nanos: number): number {
  return (
    (seconds === 0 || seconds === 0n ? 0 : 1 + int64Size(seconds)) +
    (nanos === 0 ? 0 : 1 + varintSize(nanos))
  );
}

const stringFieldSize = (bytes: number) => (bytes === 0 ? 0 : 1 + varintSize(bytes) + bytes);
const messageFieldSize = (bytes: number) => 1 + varintSize(bytes) + bytes;

/** What the size pass works out for one renewed lease, for the write pass. */
class LeaseLayout {
  readonly account: number;
  readonly session: number;
  readonly runId: number;
  readonly holder: number;
  readonly keeperId: number;
  readonly key: number;
  readonly token: number | bigint;
  readonly ttlSeconds: number | bigint;
  readonly ttlNanos: number;
  readonly ttlSize: number;
  readonly acquiredAtSeconds: number | bigint;
  readonly acquiredAtNanos: number;
  readonly acquiredAtSize: number;
  readonly expiresAtSeconds: number | bigint;
  readonly expiresAtNanos: number;
  readonly expiresAtSize: number;
  readonly remainingSeconds: number | bigint;
  readonly remainingNanos: number;
  readonly remainingSize: number;
  readonly leaseSize: number;
  readonly answerSize: number;

  constructor(readonly lease: LeaseRecord) {
    this.account = utf8Length(lease.accountId);
    this.session = utf8Length(lease.sessionId);
    this.runId = utf8Length(lease.runId);
    this.holder = utf8Length(lease.holder);
    // Null as well as undefined: a row spread as it is carries keeper_id NULL.
    this.keeperId = lease.keeperId == null ? 0 : utf8Length(lease.keeperId);
    this.key = stringFieldSize(this.account) + stringFieldSize(this.session);
    this.token = int64(lease.fencingToken);
    splitMicros(lease.ttlMs * 1000n, false);
    this.ttlSeconds = splitSeconds;
    this.ttlNanos = splitNanos;
    this.ttlSize = secondsNanosSize(splitSeconds, splitNanos);
    splitMicros(lease.acquiredAtUs, true);
    this.acquiredAtSeconds = splitSeconds;
    this.acquiredAtNanos = splitNanos;
    this.acquiredAtSize = secondsNanosSize(splitSeconds, splitNanos);
    splitMicros(lease.expiresAtUs, true);
    this.expiresAtSeconds = splitSeconds;
    this.expiresAtNanos = splitNanos;
    this.expiresAtSize = secondsNanosSize(splitSeconds, splitNanos);
    splitMicros(lease.remainingUs, false);
    this.remainingSeconds = splitSeconds;
    this.remainingNanos = splitNanos;
    this.remainingSize = secondsNanosSize(splitSeconds, splitNanos);
    this.leaseSize =
      messageFieldSize(this.key) +
      stringFieldSize(this.runId) +
      (this.token === 0 ? 0 : 1 + int64Size(this.token)) +
      stringFieldSize(this.holder) +
      messageFieldSize(this.ttlSize) +
      messageFieldSize(this.acquiredAtSize) +
      messageFieldSize(this.expiresAtSize) +
      messageFieldSize(this.remainingSize) +
      stringFieldSize(this.keeperId);
    this.answerSize =
      messageFieldSize(this.key) + stringFieldSize(this.runId) + messageFieldSize(this.leaseSize);
  }
}

class Writer {
  pos = 0;
  constructor(readonly buf: Buffer) {}

  varint(n: number) {
    if (n < 0) {
      this.bigVarint(BigInt.asUintN(64, BigInt(n)));
      return;
    }
    const buf = this.buf;
    while (n >= 128) {
      buf[this.pos++] = (n % 128) | 128;
      n = Math.floor(n / 128);
    }
    buf[this.pos++] = n;
  }

  bigVarint(v: bigint) {
    const buf = this.buf;
    while (v >= 128n) {
      buf[this.pos++] = Number(v & 127n) | 128;
      v >>= 7n;
    }
    buf[this.pos++] = Number(v);
  }

  int64(v: number | bigint) {
    if (typeof v === "number") this.varint(v);
    else this.bigVarint(BigInt.asUintN(64, v));
  }

  string(fieldTag: number, s: string, bytes: number) {
    if (bytes === 0) return;
    this.buf[this.pos++] = fieldTag;
    this.varint(bytes);
    if (bytes === s.length) {
      const buf = this.buf;
      for (let i = 0; i < bytes; i++) buf[this.pos + i] = s.charCodeAt(i);
    } else {
      this.buf.write(s, this.pos, bytes, "utf8");
    }
    this.pos += bytes;
  }

  secondsNanos(fieldTag: number, seconds: number | bigint, nanos: number, size: number) {
    this.buf[this.pos++] = fieldTag;
    this.varint(size);
    if (seconds !== 0 && seconds !== 0n) {
      this.buf[this.pos++] = secondsTag;
      this.int64(seconds);
    }
    if (nanos !== 0) {
      this.buf[this.pos++] = nanosTag;
      this.varint(nanos);
    }
  }

  key(fieldTag: number, l: LeaseLayout) {
    this.buf[this.pos++] = fieldTag;
    this.varint(l.key);
    this.string(keyAccount, l.lease.accountId, l.account);
    this.string(keySession, l.lease.sessionId, l.session);
  }

  /** One KeepAliveResponse { key, run_id, lease } as a gRPC message frame. */
  renewed(l: LeaseLayout) {
    const buf = this.buf;
    writeFrameHeader(buf, this.pos, l.answerSize);
    this.pos += frameHeaderBytes;
    this.key(answerKey, l);
    this.string(answerRunId, l.lease.runId, l.runId);
    buf[this.pos++] = answerLease;
    this.varint(l.leaseSize);
    this.key(leaseKey, l);
    this.string(leaseRunId, l.lease.runId, l.runId);
    if (l.token !== 0) {
      buf[this.pos++] = leaseToken;
      this.int64(l.token);
    }
    this.string(leaseHolder, l.lease.holder, l.holder);
    this.secondsNanos(leaseTtl, l.ttlSeconds, l.ttlNanos, l.ttlSize);
    this.secondsNanos(leaseAcquiredAt, l.acquiredAtSeconds, l.acquiredAtNanos, l.acquiredAtSize);
    this.secondsNanos(leaseExpiresAt, l.expiresAtSeconds, l.expiresAtNanos, l.expiresAtSize);
    this.secondsNanos(leaseRemaining, l.remainingSeconds, l.remainingNanos, l.remainingSize);
    if (l.keeperId !== 0) this.string(leaseKeeperId, l.lease.keeperId as string, l.keeperId);
  }
}

/** The gRPC frames of `answers`, in order, as one buffer. */
export function encodeKeepAliveAnswers(answers: readonly KeepAliveAnswer[]): Buffer {
  const parts: (LeaseLayout | Buffer)[] = new Array(answers.length);
  let total = 0;
  for (let i = 0; i < answers.length; i++) {
    const answer = answers[i] as KeepAliveAnswer;
    if (answer.kind === "lease") {
      const l = new LeaseLayout(answer.lease);
      parts[i] = l;
      total += frameHeaderBytes + l.answerSize;
    } else {
      const frame = encodeFrame(KeepAliveResponseSchema, keepAliveAnswer(answer));
      parts[i] = frame;
      total += frame.length;
    }
  }
  const writer = new Writer(Buffer.allocUnsafe(total));
  for (const part of parts) {
    if (Buffer.isBuffer(part)) {
      part.copy(writer.buf, writer.pos);
      writer.pos += part.length;
    } else {
      writer.renewed(part);
    }
  }
  return writer.buf;
}
