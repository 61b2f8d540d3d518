// The limit of a KeepAlive stream (DESIGN §7): distinct leases per stream.
// It answers RESOURCE_EXHAUSTED with the limit's name, so a client knows
// which flag an operator would raise. The per-account Watch quota is the call
// policy's (src/call/account-slots.ts).

import { ResourceExhaustedError } from "../../lease/errors.js";
import { LimitName } from "../../protocol/errors.js";

/** The leases one KeepAlive stream carries, bounded. Keys are opaque strings. */
export interface StreamLeases {
  /** Adds `key` (no-op when present), or throws when the stream is full. */
  add(key: string): void;
  delete(key: string): void;
  readonly size: number;
}

export function createStreamLeases(max: number): StreamLeases {
  const keys = new Set<string>();
  return {
    add: (key) => {
      if (keys.has(key)) return;
      if (keys.size >= max) {
        throw new ResourceExhaustedError(
          `this KeepAlive stream already carries ${keys.size} leases, the limit (--max-leases-per-stream) is ${max}: open another stream`,
          LimitName.leasesPerStream,
          max,
        );
      }
      keys.add(key);
    },
    delete: (key) => {
      keys.delete(key);
    },
    get size() {
      return keys.size;
    },
  };
}
