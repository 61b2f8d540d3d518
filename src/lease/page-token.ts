// Page tokens are opaque to clients: base64url of a versioned cursor, so the
// cursor's form can change without clients noticing. List pages by session
// id, History by event id; a token that is not one of ours is a named
// INVALID_ARGUMENT, never a database error.

import { InvalidArgumentError } from "./errors.js";

export interface PageTokenCodec<T> {
  encode(cursor: T): string;
  /** Undefined for the empty token (the first page). */
  decode(token: string): T | undefined;
}

function pageTokenCodec<T>(
  version: string,
  format: (cursor: T) => string,
  parse: (text: string) => T | undefined,
): PageTokenCodec<T> {
  const prefix = `${version}:`;
  return {
    encode: (cursor) => Buffer.from(`${prefix}${format(cursor)}`, "utf8").toString("base64url"),
    decode: (token) => {
      if (token === "") return undefined;
      const text = /^[A-Za-z0-9_-]{1,1024}$/.test(token)
        ? Buffer.from(token, "base64url").toString("utf8")
        : "";
      const cursor = text.startsWith(prefix) ? parse(text.slice(prefix.length)) : undefined;
      if (cursor === undefined) {
        throw new InvalidArgumentError("page_token", "is not a token returned by this service");
      }
      return cursor;
    },
  };
}

/** List: the last session_id of the page. */
export const sessionPageToken = pageTokenCodec<string>(
  "v1",
  (after) => after,
  (text) => text,
);

/** History: the id of the oldest event of the page (an int64). */
export const eventPageToken = pageTokenCodec<bigint>(
  "e1",
  (before) => before.toString(),
  (text) => {
    if (!/^\d{1,19}$/.test(text)) return undefined;
    const id = BigInt(text);
    return id > 9_223_372_036_854_775_807n ? undefined : id;
  },
);
