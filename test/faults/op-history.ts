// The invoke/complete history of the fault and HA suites, in the shape
// Jepsen histories use: every operation is an `invoke` event and then one
// completion, `ok` (it happened), `fail` (it certainly did not) or `info`
// (its outcome is unknown). docs/testing.md describes each field.
//
// A process does one operation at a time. An `info` completion retires its
// process (the operation may still take effect at any later time, so the
// process is never known to be idle again) and the next operation gets a
// new process id. Process ids are `client + stride × n`, unique across the
// clients of a run, so `process mod stride` names the client.

/** How an operation ended: it happened, it certainly did not, or nobody knows. */
export type Completion = "ok" | "fail" | "info";

/** The request and the answer, by operation kind (the fields each kind uses are in docs/testing.md). */
export interface OpValue {
  ttlMs?: number;
  waitMs?: number;
  holder?: string;
  reason?: string;
  acquiredAtUs?: number;
  expiresAtUs?: number;
  ttlUs?: number;
  /** Acquire refused: the valid lease that blocked it, as the answer named it. */
  current?: { runId: string; token: number; holder: string; expiresAtUs: number };
  held?: boolean;
  released?: boolean;
  revoked?: boolean;
  /** CheckFence: the token is the valid lease's. */
  fenceCurrent?: boolean;
  highestToken?: number;
  /** Keeper operations: the keeper's id, and its lock-delay as opened. */
  keeperId?: string;
  lockDelayMs?: number;
  /** A refused Acquire (keeper stream or unary) kept out by a lock-delay until then. */
  lockDelayUntilUs?: number;
  /**
   * Attempts of the call that ended without an answer (the client library
   * failed over to the next instance, or gave up): each may still take
   * effect later. Absent when there were none.
   */
  unanswered?: number;
}

/** One event of a client operation. */
export interface OpEvent {
  type: "invoke" | Completion;
  /**
   * acquire, renew, keepalive, release, revoke, get, check-fence, write;
   * keepers: keeper-open, keeper-run, keeper-close, keeper-revoke (the
   * workload's calls) and keeper-attach, keeper-heartbeat, keeper-acquire,
   * keeper-release (the Keep stream's requests, recorded on the wire);
   * elections: campaign, resign.
   */
  f: string;
  process: number;
  /** Nanoseconds on the host's monotonic clock since the suite's origin (comparable across clients). */
  time: number;
  /** The client's wall clock, microseconds since the epoch. */
  wallUs: number;
  client: number;
  key: string;
  runId?: string;
  token?: number;
  value?: OpValue;
  /** Why a `fail` or `info` completion did not succeed: the error code and, for LEASE_NOT_HELD, its cause. */
  error?: { code: string; cause?: string };
}

/** A fault the suite injected: a client's event loop did not run between these instants. */
export interface PauseNote {
  type: "info";
  process: "nemesis";
  f: "pause";
  client: number;
  fromUs: number;
  toUs: number;
}

/** A run's signal aborted while its work was running (the lease library declared the lease lost). */
export interface LostNote {
  type: "info";
  process: "signal";
  f: "lost";
  client: number;
  key: string;
  runId: string;
  time: number;
  wallUs: number;
  /** LeaseLostError.lossReason. */
  reason: string;
  /** The last deadline (expires_at) the client saw confirmed for the run. */
  deadlineUs: number;
  /** The database clock read by a query sent right after the abort, and that query's round trip. */
  dbUs?: number;
  dbRttUs?: number;
  /** The run's safety margin: its local deadline falls this long before `deadlineUs`, or earlier. */
  marginUs?: number;
}

export type HistoryEvent = OpEvent | PauseNote | LostNote;

/** What an operation is about: its key, and its run and token when it has them. */
export interface OpFields {
  key: string;
  runId?: string;
  token?: number;
  value?: OpValue;
}

/** What a completion adds to its invocation. */
export interface Outcome extends Partial<OpFields> {
  type: Completion;
  error?: OpEvent["error"];
}

/** An invoked operation, to be completed exactly once. */
export interface PendingOp {
  readonly process: number;
  complete(outcome: Outcome): void;
}

export interface Recorder {
  /** Records the invocation now, on a process with no operation under way. */
  invoke(f: string, fields: OpFields): PendingOp;
  /**
   * Invokes `f`, runs `call`, and completes the operation with what
   * `answer` (its result) or `failure` (its error) says; returns or throws
   * what `call` did.
   */
  run<T>(
    f: string,
    fields: OpFields,
    call: () => Promise<T>,
    answer: (result: T) => Outcome,
    failure: (error: unknown) => Outcome,
  ): Promise<T>;
  /** The host's monotonic clock in ns since the origin, and the wall clock in µs. */
  now(): { time: number; wallUs: number };
}

export interface RecorderOptions {
  client: number;
  /** The number of clients of the run: process ids step by it. */
  stride: number;
  /** process.hrtime.bigint() of the suite's origin, on the same host. */
  originNs: bigint;
  emit: (event: OpEvent) => void;
}

export function createRecorder(options: RecorderOptions): Recorder {
  const { client, stride, originNs, emit } = options;
  let generation = 0;
  // Processes with no operation under way, lowest first, so a history of a
  // mostly sequential client uses few of them.
  const idle: number[] = [];
  const take = () => idle.shift() ?? client + stride * generation++;
  const now = () => ({
    // process.hrtime is CLOCK_MONOTONIC, one clock for every process of the host.
    time: Number(process.hrtime.bigint() - originNs),
    wallUs: Math.round((performance.timeOrigin + performance.now()) * 1000),
  });

  const invoke = (f: string, fields: OpFields): PendingOp => {
    const process = take();
    emit({ type: "invoke", f, process, ...now(), client, ...fields });
    let done = false;
    return {
      process,
      complete(outcome) {
        if (done) throw new Error(`operation ${f} of process ${process} completed twice`);
        done = true;
        emit({
          type: outcome.type,
          f,
          process,
          ...now(),
          client,
          key: fields.key,
          runId: outcome.runId ?? fields.runId,
          token: outcome.token ?? fields.token,
          value: outcome.value,
          error: outcome.error,
        });
        if (outcome.type !== "info") {
          idle.push(process);
          idle.sort((a, b) => a - b);
        }
      },
    };
  };

  return {
    invoke,
    async run(f, fields, call, answer, failure) {
      const op = invoke(f, fields);
      let result: Awaited<ReturnType<typeof call>>;
      try {
        result = await call();
      } catch (error) {
        op.complete(failure(error));
        throw error;
      }
      op.complete(answer(result));
      return result;
    },
    now,
  };
}

/** Completed operations of a history by kind and outcome, and those left without a completion. */
export function countOperations(
  history: readonly HistoryEvent[],
): Record<string, Record<Completion | "open", number>> {
  const byF: Record<string, Record<Completion | "open", number>> = {};
  for (const e of history) {
    if (typeof e.process !== "number") continue;
    byF[e.f] ??= { ok: 0, fail: 0, info: 0, open: 0 };
    const counts = byF[e.f] as Record<Completion | "open", number>;
    // Each invocation is open until its completion comes.
    if (e.type === "invoke") counts.open += 1;
    else {
      counts.open -= 1;
      counts[e.type] += 1;
    }
  }
  return byF;
}
