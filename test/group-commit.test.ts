// Group commit's queueing rules (db/group-commit.ts), with a statement the
// test answers when it chooses, so that what "arrived before the statement
// was sent" means is exact. The store's use of it on PostgreSQL is in
// test/batched-store.test.ts.

import { describe, expect, it } from "vitest";
import { createGroupCommit } from "../src/server/db/group-commit.js";

interface Statement {
  items: string[];
  answer(results: string[]): void;
}

function harness(shareByKey: boolean) {
  const sent: Statement[] = [];
  const commit = createGroupCommit<string, string>({
    run: (items) =>
      new Promise<string[]>((resolve) => {
        sent.push({ items: [...items], answer: resolve });
      }),
    keyOf: (item) => item.split(":")[0] as string,
    maxBatch: 100,
    maxInFlight: 1,
    shareByKey,
  });
  const answered = new Map<string, string>();
  const submit = (item: string) =>
    commit.submit(item).then((r) => {
      answered.set(item, r);
      return r;
    });
  return { commit, sent, answered, submit };
}

const settle = () => new Promise<void>((resolve) => setImmediate(resolve));

describe("group commit of reads (shareByKey)", () => {
  it("calls of one key waiting for the same statement share its answer: one row per key", async () => {
    const { commit, sent, answered, submit } = harness(true);
    void submit("k:first");
    // While the first statement is in flight, more calls of k (and one of j) queue.
    for (const item of ["k:a", "k:b", "k:c", "j:a"]) void submit(item);
    expect(sent.map((s) => s.items)).toEqual([["k:first"]]);
    sent[0]?.answer(["reading 1"]);
    await settle();
    // One statement for all of them, each key once.
    expect(sent.map((s) => s.items)).toEqual([["k:first"], ["k:a", "j:a"]]);
    sent[1]?.answer(["reading 2 of k", "reading 2 of j"]);
    await settle();
    expect(Object.fromEntries(answered)).toEqual({
      "k:first": "reading 1",
      "k:a": "reading 2 of k",
      "k:b": "reading 2 of k",
      "k:c": "reading 2 of k",
      "j:a": "reading 2 of j",
    });
    expect(commit.stats).toMatchObject({ statements: 2, items: 3, shared: 2 });
  });

  it("a call that arrives after a statement was sent is not answered by it, even for the same key", async () => {
    const { sent, answered, submit } = harness(true);
    void submit("k:early");
    void submit("k:late");
    // Only the first went out; the second arrived after it was sent.
    expect(sent.map((s) => s.items)).toEqual([["k:early"]]);
    sent[0]?.answer(["read before k:late arrived"]);
    await settle();
    expect(answered.get("k:early")).toBe("read before k:late arrived");
    expect(answered.has("k:late")).toBe(false);
    expect(sent.map((s) => s.items)).toEqual([["k:early"], ["k:late"]]);
    sent[1]?.answer(["read after k:late arrived"]);
    await settle();
    expect(answered.get("k:late")).toBe("read after k:late arrived");
  });

  it("writes (no sharing) still take a key once per statement, one statement after the other", async () => {
    const { sent, submit } = harness(false);
    void submit("k:first");
    for (const item of ["k:a", "k:b"]) void submit(item);
    sent[0]?.answer(["1"]);
    await settle();
    sent[1]?.answer(["2"]);
    await settle();
    expect(sent.map((s) => s.items)).toEqual([["k:first"], ["k:a"], ["k:b"]]);
  });
});
