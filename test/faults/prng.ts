// A seeded generator for the fault suite: xorshift32, so one printed number
// replays the same choices of operations, keys and faults.

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
