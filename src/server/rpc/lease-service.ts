// The bridge between Connect and the lease domain: validates requests, calls
// the store, maps results to messages. No SQL; domain errors are thrown as
// they are and mapped to codes once, by the call policy (src/call/error-codes.ts).

import { randomUUID } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import type { ServiceImpl } from "@connectrpc/connect";
import {
  type LeaseService,
  ListResponseSchema,
  ReleaseResponseSchema,
  RenewResponseSchema,
} from "../../gen/leasehold/v1/lease_pb.js";
import { InvalidArgumentError, LeaseNotHeldError } from "../../lease/errors.js";
import type { Limits } from "../../lease/limits.js";
import { sessionPageToken } from "../../lease/page-token.js";
import type { LeaseStore } from "../../lease/types.js";
import {
  checkId,
  checkKey,
  checkOptionalTtl,
  checkPageSize,
  checkRunId,
  checkText,
  checkTtl,
  checkWait,
} from "../../lease/validation.js";
import type { Waiters } from "../streams/waiters.js";
import { acquireResponse, getResponse, leaseToProto } from "./convert.js";

export interface LeaseServiceDeps {
  store: LeaseStore;
  limits: Limits;
  /** Serves Acquire with `wait`; without it, Acquire answers at once. */
  waiters?: Waiters;
}

// A waiting Acquire answers this long before the call's deadline (at most a
// quarter of the call's time), so that the answer (acquired or not) reaches
// the client in time to be used: the last attempt at the end of the wait is
// one or two statements, which a busy database can take tens of ms for.
const deadlineMarginMs = 250;

type Impl = ServiceImpl<typeof LeaseService>;

/** The unary core of LeaseService: Acquire, Renew, Release, Get, List. */
export function createLeaseService(
  deps: LeaseServiceDeps,
): Pick<Impl, "acquire" | "renew" | "release" | "get" | "list"> {
  const { store, limits } = deps;
  return {
    async acquire(req, ctx) {
      const key = checkKey("key", req.key, limits);
      // On a keeper (K1) the lease lives as long as the keeper: its TTL is the keeper's.
      const keeperId = req.keeperId === "" ? undefined : checkRunId("keeper_id", req.keeperId);
      if (keeperId !== undefined && req.ttl !== undefined) {
        throw new InvalidArgumentError(
          "ttl",
          "must be unset with keeper_id: the lease lives as long as its keeper",
        );
      }
      const ttlMs = keeperId === undefined ? checkTtl("ttl", req.ttl, limits) : limits.minTtlMs;
      const waitMs = checkWait("wait", req.wait, limits);
      const runId = req.runId === "" ? randomUUID() : checkRunId("run_id", req.runId);
      const holder = checkText("holder", req.holder, limits.maxHolderLength);
      const input = { ...key, runId, ttlMs, holder, ...(keeperId ? { keeperId } : {}) };
      const timeoutMs = ctx.timeoutMs();
      const waitFor =
        timeoutMs === undefined
          ? waitMs
          : Math.min(waitMs, timeoutMs - Math.min(deadlineMarginMs, timeoutMs / 4));
      const result =
        deps.waiters && waitFor > 0
          ? await deps.waiters.acquire(input, waitFor, ctx.signal)
          : await store.acquire(input);
      return acquireResponse(result);
    },

    async renew(req) {
      const key = checkKey("key", req.key, limits);
      const runId = checkRunId("run_id", req.runId);
      const ttlMs = checkOptionalTtl("ttl", req.ttl, limits);
      const result = await store.renew(key, runId, ttlMs);
      if (!result.held) throw new LeaseNotHeldError(result.cause);
      return create(RenewResponseSchema, { lease: leaseToProto(result.lease) });
    },

    async release(req) {
      const key = checkKey("key", req.key, limits);
      const runId = checkRunId("run_id", req.runId);
      const ended = await store.release(key, runId);
      return create(ReleaseResponseSchema, { released: ended !== undefined });
    },

    async get(req) {
      const key = checkKey("key", req.key, limits);
      const lease = await store.get(key);
      // K2: a key free of any valid lease may still be in its lock-delay.
      const delayUntil = lease === undefined ? await store.lockDelayUntil(key) : undefined;
      return getResponse(lease, delayUntil);
    },

    async list(req) {
      const accountId = checkId("account_id", req.accountId, limits);
      const pageSize = checkPageSize("page_size", req.pageSize, limits);
      const after = sessionPageToken.decode(req.pageToken);
      const page = await store.list(accountId, pageSize, after);
      return create(ListResponseSchema, {
        leases: page.leases.map(leaseToProto),
        nextPageToken: page.nextAfter === undefined ? "" : sessionPageToken.encode(page.nextAfter),
      });
    },
  };
}
