// Small helpers for calls made with the Connect clients.

import { create } from "@bufbuild/protobuf";
import { type Duration, DurationSchema } from "@bufbuild/protobuf/wkt";
import { ConnectError } from "@connectrpc/connect";

/** A protobuf Duration of whole seconds. */
export const seconds = (s: number): Duration => create(DurationSchema, { seconds: BigInt(s) });

/** The error a call that must fail failed with; throws when it succeeded. */
export async function failure(call: Promise<unknown>): Promise<ConnectError> {
  try {
    await call;
  } catch (error) {
    return ConnectError.from(error);
  }
  throw new Error("the call succeeded");
}
