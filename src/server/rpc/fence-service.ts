// CheckFence: lets a guarded resource in live mode confirm that a fencing
// token belongs to the session's valid lease (DESIGN §4, §5). No SQL here.

import { create } from "@bufbuild/protobuf";
import type { ServiceImpl } from "@connectrpc/connect";
import { CheckFenceResponseSchema, type LeaseService } from "../../gen/leasehold/v1/lease_pb.js";
import type { Limits } from "../../lease/limits.js";
import type { LeaseStore } from "../../lease/types.js";
import { checkFencingToken, checkKey } from "../../lease/validation.js";

export interface FenceServiceDeps {
  store: LeaseStore;
  limits: Limits;
}

export function createFenceService(
  deps: FenceServiceDeps,
): Pick<ServiceImpl<typeof LeaseService>, "checkFence"> {
  const { store, limits } = deps;
  return {
    async checkFence(req) {
      const key = checkKey("key", req.key, limits);
      const token = checkFencingToken("fencing_token", req.fencingToken);
      const state = await store.checkFence(key, token);
      return create(CheckFenceResponseSchema, state);
    },
  };
}
