// The fault suite's settings from the environment: a malformed value is
// refused with the variable and its rule, never ignored or half-read.

import { describe, expect, it } from "vitest";
import { createPrng, soakBounds } from "./prng.js";

describe("fault suite settings", () => {
  it("a soak without bounds runs 10 minutes", () => {
    expect(soakBounds({ LEASEHOLD_SOAK: "1" })).toEqual({ minutes: 10 });
  });

  it("a soak is bounded by operations, minutes, or both (whichever comes first)", () => {
    expect(soakBounds({ LEASEHOLD_SOAK: "1", LEASEHOLD_SOAK_OPS: "100000" })).toEqual({
      operations: 100_000,
    });
    expect(soakBounds({ LEASEHOLD_SOAK: "1", LEASEHOLD_SOAK_MINUTES: "0.5" })).toEqual({
      minutes: 0.5,
    });
    expect(
      soakBounds({ LEASEHOLD_SOAK: "1", LEASEHOLD_SOAK_OPS: "500", LEASEHOLD_SOAK_MINUTES: "45" }),
    ).toEqual({ operations: 500, minutes: 45 });
  });

  it.each(["0", "-5", "1.5", "1e5", "100k", " 12", "99999999999999999999"])(
    "refuses LEASEHOLD_SOAK_OPS=%s, naming the rule",
    (value) => {
      expect(() => soakBounds({ LEASEHOLD_SOAK: "1", LEASEHOLD_SOAK_OPS: value })).toThrow(
        `LEASEHOLD_SOAK_OPS must be a whole number of operations, at least 1 (e.g. 100000), got ${value}`,
      );
    },
  );

  it.each(["0", "-1", "abc", "Infinity", "NaN"])(
    "refuses LEASEHOLD_SOAK_MINUTES=%s, naming the rule",
    (value) => {
      expect(() => soakBounds({ LEASEHOLD_SOAK: "1", LEASEHOLD_SOAK_MINUTES: value })).toThrow(
        `LEASEHOLD_SOAK_MINUTES must be a positive number of minutes (e.g. 10 or 0.5), got ${value}`,
      );
    },
  );

  it("refuses a soak bound outside a soak rather than ignore it", () => {
    expect(() => soakBounds({ LEASEHOLD_SOAK_OPS: "1000" })).toThrow(
      "LEASEHOLD_SOAK_OPS bounds a soak: set LEASEHOLD_SOAK=1 too",
    );
    expect(soakBounds({})).toEqual({ minutes: 10 });
  });

  it("one seed replays the same draws", () => {
    const a = createPrng(1234);
    const b = createPrng(1234);
    const draws = (p: ReturnType<typeof createPrng>) =>
      Array.from({ length: 100 }, () => p.int(0, 1000));
    expect(draws(a)).toEqual(draws(b));
  });
});
