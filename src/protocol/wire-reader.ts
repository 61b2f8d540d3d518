// Reading the messages of the hot streams (KeepAlive requests on the server,
// KeepAlive answers and Watch events in the client) without protobuf-es's
// reflection, which builds every message field by field through its
// descriptors and costs a few microseconds per message.
//
// Only the shape a Leasehold peer sends is read here: each field once, with
// its wire type, ASCII strings, non-negative numbers below 2^49, nothing
// unknown. Anything else answers undefined, and the caller reads the bytes
// with protobuf-es, which then also words the errors. What is read is the
// message protobuf-es would give; test/wire-reader.test.ts holds the two
// together with property tests.

import type { Duration, Timestamp } from "@bufbuild/protobuf/wkt";
import type {
  Event,
  KeepAliveRequest,
  KeepAliveResponse,
  Lease,
  SessionKey,
  WatchResponse,
} from "../gen/leasehold/v1/lease_pb.js";

const utf8 = new TextDecoder();

/** A cursor over one message's bytes, from `pos` to `end`. */
class Reader {
  private seen = 0;

  constructor(
    readonly bytes: Uint8Array,
    public pos: number,
    readonly end: number,
  ) {}

  /**
   * The next field's tag; -1 at a tag this module does not read (one of
   * more than a byte: a field above 15) or a field met before.
   */
  next(): number {
    const fieldTag = this.bytes[this.pos++] as number;
    const bit = 1 << (fieldTag >> 3);
    if (fieldTag >= 0x80 || this.seen & bit) return -1;
    this.seen |= bit;
    return fieldTag;
  }

  get more(): boolean {
    return this.pos < this.end;
  }

  /** A varint of at most 7 bytes (49 bits, exact as a number); -1 otherwise. */
  smallVarint(): number {
    let value = 0;
    let scale = 1;
    for (let i = 0; i < 7 && this.pos < this.end; i++) {
      const b = this.bytes[this.pos++] as number;
      value += (b & 127) * scale;
      if (b < 128) return value;
      scale *= 128;
    }
    return -1;
  }

  /** An int64 as protobuf-es gives it (a BigInt); undefined when negative or too large. */
  int64(): bigint | undefined {
    const value = this.smallVarint();
    return value < 0 ? undefined : BigInt(value);
  }

  /** An int32 or an enum; -1 when negative or too large. */
  int32(): number {
    const value = this.smallVarint();
    return value >= 2 ** 31 ? -1 : value;
  }

  /** The end of a length-delimited field that starts here; -1 when it overruns. */
  length(): number {
    const n = this.smallVarint();
    return n < 0 || this.pos + n > this.end ? -1 : this.pos + n;
  }

  /** A length-delimited string of ASCII bytes; undefined for anything else. */
  ascii(): string | undefined {
    const end = this.length();
    if (end < 0) return undefined;
    const bytes = this.bytes;
    for (let i = this.pos; i < end; i++) if ((bytes[i] as number) >= 0x80) return undefined;
    // ASCII reads the same as UTF-8. TextDecoder (Node's and a browser's) is
    // the fastest reader of a plain Uint8Array measured: for a 10–36 byte
    // string about 150 ns, String.fromCharCode.apply 185, a string built
    // char by char 280. Node's Buffer (latin1) took 110 but would keep this
    // module from the web page; three strings per KeepAlive request make
    // the difference about 0.1 µs, under 1% of a renewal's server CPU.
    const s = utf8.decode(bytes.subarray(this.pos, end));
    this.pos = end;
    return s;
  }

  /** A length-delimited submessage read by `read`; undefined when it is not one. */
  message<T>(
    read: (bytes: Uint8Array, start: number, end: number) => T | undefined,
  ): T | undefined {
    const end = this.length();
    if (end < 0) return undefined;
    const value = read(this.bytes, this.pos, end);
    this.pos = end;
    return value;
  }
}

/** Reads one field's value at the cursor; undefined when it is not of the readable shape. */
type ValueReader = (r: Reader) => unknown;

const ascii: ValueReader = (r) => r.ascii();
const int64: ValueReader = (r) => r.int64();
const int32: ValueReader = (r) => {
  const value = r.int32();
  return value < 0 ? undefined : value;
};
const message =
  (read: (bytes: Uint8Array, start: number, end: number) => unknown): ValueReader =>
  (r) =>
    r.message(read);
/** A message field of a oneof: the value as protobuf-es holds it, `{ case, value }`. */
const oneof =
  (name: string, read: (bytes: Uint8Array, start: number, end: number) => unknown): ValueReader =>
  (r) => {
    const value = r.message(read);
    return value === undefined ? undefined : { case: name, value };
  };

/** The fields of a message by tag (field number and wire type): the property and its reader. */
type Fields = Record<number, [string, ValueReader]>;
const int = (field: number) => (field << 3) | 0;
const bytesField = (field: number) => (field << 3) | 2;

/** Reads the fields of one message into `target`, which holds the defaults. */
function readInto<T extends object>(
  target: T,
  fields: Fields,
  bytes: Uint8Array,
  start: number,
  end: number,
): T | undefined {
  const r = new Reader(bytes, start, end);
  while (r.more) {
    const field = fields[r.next()];
    if (field === undefined) return undefined;
    const value = field[1](r);
    if (value === undefined) return undefined;
    (target as Record<string, unknown>)[field[0]] = value;
  }
  return target;
}

const sessionKeyFields: Fields = {
  [bytesField(1)]: ["accountId", ascii],
  [bytesField(2)]: ["sessionId", ascii],
};

export function readSessionKey(
  bytes: Uint8Array,
  start: number,
  end: number,
): SessionKey | undefined {
  const key: SessionKey = { $typeName: "leasehold.v1.SessionKey", accountId: "", sessionId: "" };
  return readInto(key, sessionKeyFields, bytes, start, end);
}

const secondsNanosFields: Fields = {
  [int(1)]: ["seconds", int64],
  [int(2)]: ["nanos", int32],
};

export function readDuration(bytes: Uint8Array, start: number, end: number): Duration | undefined {
  const duration: Duration = { $typeName: "google.protobuf.Duration", seconds: 0n, nanos: 0 };
  return readInto(duration, secondsNanosFields, bytes, start, end);
}

export function readTimestamp(
  bytes: Uint8Array,
  start: number,
  end: number,
): Timestamp | undefined {
  const timestamp: Timestamp = { $typeName: "google.protobuf.Timestamp", seconds: 0n, nanos: 0 };
  return readInto(timestamp, secondsNanosFields, bytes, start, end);
}

const leaseFields: Fields = {
  [bytesField(1)]: ["key", message(readSessionKey)],
  [bytesField(2)]: ["runId", ascii],
  [int(3)]: ["fencingToken", int64],
  [bytesField(4)]: ["holder", ascii],
  [bytesField(5)]: ["ttl", message(readDuration)],
  [bytesField(6)]: ["acquiredAt", message(readTimestamp)],
  [bytesField(7)]: ["expiresAt", message(readTimestamp)],
  [bytesField(8)]: ["remaining", message(readDuration)],
  [bytesField(9)]: ["keeperId", ascii],
};

export function readLease(bytes: Uint8Array, start: number, end: number): Lease | undefined {
  const lease: Lease = {
    $typeName: "leasehold.v1.Lease",
    runId: "",
    fencingToken: 0n,
    holder: "",
    keeperId: "",
  };
  return readInto(lease, leaseFields, bytes, start, end);
}

const keepAliveRequestFields: Fields = {
  [bytesField(1)]: ["key", message(readSessionKey)],
  [bytesField(2)]: ["runId", ascii],
  [bytesField(3)]: ["ttl", message(readDuration)],
};

/** A KeepAlive request (what the server reads). */
export function readKeepAliveRequest(bytes: Uint8Array): KeepAliveRequest | undefined {
  const request: KeepAliveRequest = { $typeName: "leasehold.v1.KeepAliveRequest", runId: "" };
  return readInto(request, keepAliveRequestFields, bytes, 0, bytes.length);
}

const keepAliveResponseFields: Fields = {
  [bytesField(1)]: ["key", message(readSessionKey)],
  [bytesField(2)]: ["runId", ascii],
  [bytesField(3)]: ["result", oneof("lease", readLease)],
};

/** A KeepAlive answer with a renewed lease (what the client reads; `lost` and handoff requests are left to protobuf-es). */
export function readKeepAliveResponse(bytes: Uint8Array): KeepAliveResponse | undefined {
  const response: KeepAliveResponse = {
    $typeName: "leasehold.v1.KeepAliveResponse",
    runId: "",
    result: { case: undefined },
  };
  return readInto(response, keepAliveResponseFields, bytes, 0, bytes.length);
}

const eventFields: Fields = {
  [int(1)]: ["type", int32],
  [bytesField(2)]: ["key", message(readSessionKey)],
  [bytesField(3)]: ["runId", ascii],
  [int(4)]: ["fencingToken", int64],
  [bytesField(5)]: ["holder", ascii],
  [bytesField(6)]: ["reason", ascii],
  [bytesField(7)]: ["at", message(readTimestamp)],
  [bytesField(8)]: ["lease", message(readLease)],
  [bytesField(9)]: ["requesterHolder", ascii],
  [int(10)]: ["id", int64],
};

function readEvent(bytes: Uint8Array, start: number, end: number): Event | undefined {
  const event: Event = {
    $typeName: "leasehold.v1.Event",
    type: 0,
    runId: "",
    fencingToken: 0n,
    holder: "",
    reason: "",
    requesterHolder: "",
    id: 0n,
  };
  return readInto(event, eventFields, bytes, start, end);
}

const watchResponseFields: Fields = {
  [bytesField(2)]: ["kind", oneof("event", readEvent)],
};

/** A Watch message carrying an event (what the client reads; snapshots are left to protobuf-es). */
export function readWatchResponse(bytes: Uint8Array): WatchResponse | undefined {
  const response: WatchResponse = {
    $typeName: "leasehold.v1.WatchResponse",
    kind: { case: undefined },
  };
  return readInto(response, watchResponseFields, bytes, 0, bytes.length);
}
