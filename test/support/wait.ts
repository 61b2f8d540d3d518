// Waiting in tests: on a condition the test can observe, always with a
// deadline and a message that says what never happened. A guessed sleep
// either wastes time or, on a loaded machine, is too short; a poll without a
// deadline turns a failure into a hung run that names nothing.

export interface WaitOptions {
  /** What the test waits for, as the failure message should name it. */
  what: string;
  /** Default 20 s: far beyond any wait a passing run needs on two busy cores. */
  timeoutMs?: number;
  /** Time between probes; default 10 ms. */
  intervalMs?: number;
}

/**
 * Resolves with the first truthy value `probe` returns. A probe that throws
 * counts as "not yet"; its last error is part of the failure message.
 */
export async function waitFor<T>(
  probe: () => T | Promise<T>,
  options: WaitOptions,
): Promise<NonNullable<T>> {
  const timeoutMs = options.timeoutMs ?? 20_000;
  const intervalMs = options.intervalMs ?? 10;
  const deadline = performance.now() + timeoutMs;
  let lastError: unknown;
  let lastValue: unknown;
  for (;;) {
    try {
      const value = await probe();
      if (value) return value as NonNullable<T>;
      lastValue = value;
      lastError = undefined;
    } catch (error) {
      lastError = error;
    }
    const left = deadline - performance.now();
    if (left <= 0) {
      const last =
        lastError === undefined
          ? `last value: ${String(lastValue)}`
          : `last error: ${lastError instanceof Error ? lastError.message : String(lastError)}`;
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${options.what} (${last})`, {
        cause: lastError,
      });
    }
    await new Promise((resolve) => setTimeout(resolve, Math.min(intervalMs, left)));
  }
}

/** Rejects with a message naming `what` when `promise` has not settled within `timeoutMs`. */
export async function within<T>(promise: Promise<T>, options: WaitOptions): Promise<T> {
  const timeoutMs = options.timeoutMs ?? 20_000;
  let timer: NodeJS.Timeout | undefined;
  const expired = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () => reject(new Error(`timed out after ${timeoutMs} ms waiting for ${options.what}`)),
      timeoutMs,
    );
  });
  try {
    return await Promise.race([promise, expired]);
  } finally {
    clearTimeout(timer);
  }
}
