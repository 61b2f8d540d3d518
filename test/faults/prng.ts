// A seeded generator for the fault suite: xorshift32, so one printed number
// replays the same choices of operations, keys and faults; and the run's
// other settings from the environment (its seed, a soak's bounds).

export interface Prng {
  /** A float in [0, 1). */
  next(): number;
  /** An integer in [min, max]. */
  int(min: number, max: number): number;
  /** One element of a non-empty array. */
  pick<T>(items: readonly T[]): T;
  /** True with probability p. */
  chance(p: number): boolean;
}

export function createPrng(seed: number): Prng {
  // xorshift32 never leaves the all-zero state, so map a zero seed away from it.
  let state = seed >>> 0 || 0x9e3779b9;
  const next = () => {
    state ^= state << 13;
    state >>>= 0;
    state ^= state >>> 17;
    state ^= state << 5;
    state >>>= 0;
    return state / 0x1_0000_0000;
  };
  return {
    next,
    int: (min, max) => min + Math.floor(next() * (max - min + 1)),
    pick: (items) => items[Math.floor(next() * items.length)] as (typeof items)[number],
    chance: (p) => next() < p,
  };
}

/** The seed of this run: LEASEHOLD_FAULT_SEED replays one, else a fresh one. */
export function suiteSeed(): number {
  const given = process.env.LEASEHOLD_FAULT_SEED;
  if (given !== undefined && given !== "") {
    const seed = Number(given);
    if (!Number.isInteger(seed) || seed < 0 || seed > 0xffff_ffff) {
      throw new RangeError(`LEASEHOLD_FAULT_SEED must be an integer in [0, 2^32), got ${given}`);
    }
    return seed;
  }
  return Math.floor(Math.random() * 0xffff_ffff) >>> 0;
}

/** When a soak ends: at a number of client operations, after some minutes, or whichever comes first. */
export interface SoakBounds {
  /** Client operations (client-worker.ts defines them) the history must hold. */
  operations?: number;
  minutes?: number;
}

/**
 * A soak's bounds from LEASEHOLD_SOAK_OPS and LEASEHOLD_SOAK_MINUTES; with
 * neither set, 10 minutes. Both are refused, with the rule, when malformed
 * or set without LEASEHOLD_SOAK=1 (they would be ignored silently).
 */
export function soakBounds(env: NodeJS.ProcessEnv = process.env): SoakBounds {
  const given = (name: string) => {
    const value = env[name];
    if (value === undefined || value === "") return undefined;
    if (env.LEASEHOLD_SOAK !== "1") {
      throw new RangeError(
        `${name} bounds a soak: set LEASEHOLD_SOAK=1 too (npm run test:faults:soak), got ${name}=${value} alone`,
      );
    }
    return value;
  };
  const ops = given("LEASEHOLD_SOAK_OPS");
  const minutes = given("LEASEHOLD_SOAK_MINUTES");
  const bounds: SoakBounds = {};
  if (ops !== undefined) {
    const n = Number(ops);
    if (!/^[0-9]+$/.test(ops) || !Number.isSafeInteger(n) || n < 1) {
      throw new RangeError(
        `LEASEHOLD_SOAK_OPS must be a whole number of operations, at least 1 (e.g. 100000), got ${ops}`,
      );
    }
    bounds.operations = n;
  }
  if (minutes !== undefined) {
    const n = Number(minutes);
    if (!(Number.isFinite(n) && n > 0)) {
      throw new RangeError(
        `LEASEHOLD_SOAK_MINUTES must be a positive number of minutes (e.g. 10 or 0.5), got ${minutes}`,
      );
    }
    bounds.minutes = n;
  }
  if (bounds.operations === undefined && bounds.minutes === undefined) bounds.minutes = 10;
  return bounds;
}
