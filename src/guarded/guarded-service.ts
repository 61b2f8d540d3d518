// GuardedStoreService: validates requests, asks the lease server about the
// writes that need it (live-check.ts), calls the document store and maps the
// records to messages. No SQL here. Callers are authenticated before, by the
// call policy with the store's rules (caller-auth.ts).

import { create } from "@bufbuild/protobuf";
import type { ServiceImpl } from "@connectrpc/connect";
import {
  type DocumentInfo,
  DocumentInfoSchema,
  GetResponseSchema,
  type GuardedStoreService,
  ListResponseSchema,
  PutResponseSchema,
} from "../gen/leasehold/guarded/v1/guarded_pb.js";
import { SessionKeySchema } from "../gen/leasehold/v1/lease_pb.js";
import { InvalidArgumentError, NotFoundError } from "../lease/errors.js";
import type { Limits } from "../lease/limits.js";
import { checkFencingToken, checkKey, checkText } from "../lease/validation.js";
import { timestampFromMicros } from "../protocol/timestamps.js";
import type { DocumentLimits, DocumentRecord, DocumentStore } from "./document-store.js";
import { checkWrite, type WriteChecks } from "./live-check.js";

export interface GuardedLimits extends DocumentLimits, Pick<Limits, "maxIdLength"> {
  maxNameLength: number;
  maxValueBytes: number;
}

export const defaultGuardedLimits: GuardedLimits = {
  maxIdLength: 128,
  maxNameLength: 512,
  maxValueBytes: 4 * 1024 * 1024,
  maxDocumentsPerSession: 1_000,
};

export interface GuardedServiceDeps {
  store: DocumentStore;
  limits: GuardedLimits;
  /** What the lease server is asked before a write. */
  checks: WriteChecks;
}

export function createGuardedService(
  deps: GuardedServiceDeps,
): ServiceImpl<typeof GuardedStoreService> {
  const { store, limits, checks } = deps;
  const checkName = (name: string) => {
    if (name === "") throw new InvalidArgumentError("name", "must not be empty");
    return checkText("name", name, limits.maxNameLength);
  };
  return {
    async put(req) {
      const key = checkKey("key", req.key, limits);
      const name = checkName(req.name);
      const token = checkFencingToken("fencing_token", req.fencingToken);
      if (req.value.byteLength > limits.maxValueBytes) {
        throw new InvalidArgumentError(
          "value",
          `must be at most ${limits.maxValueBytes} bytes, got ${req.value.byteLength}`,
        );
      }
      // Outside the write transaction: no row lock is held across a call to
      // the lease server. The fence in the transaction still refuses any
      // token older than one a write has already used.
      await checkWrite(checks, key, token, () => store.highestToken(key));
      const written = await store.put(key, name, req.value, token);
      return create(PutResponseSchema, {
        document: documentInfo(written.document),
        highestToken: written.highestToken,
      });
    },

    async get(req) {
      const key = checkKey("key", req.key, limits);
      const name = checkName(req.name);
      const found = await store.get(key, name);
      if (!found) throw new NotFoundError(`document ${JSON.stringify(name)} not found`);
      return create(GetResponseSchema, {
        value: found.value,
        fencingToken: found.fencingToken,
        updatedAt: timestampFromMicros(found.updatedAtUs),
        document: documentInfo(found),
      });
    },

    async list(req) {
      const key = checkKey("key", req.key, limits);
      const listed = await store.list(key);
      return create(ListResponseSchema, {
        documents: listed.documents.map(documentInfo),
        highestToken: listed.highestToken,
      });
    },
  };
}

function documentInfo(d: DocumentRecord): DocumentInfo {
  return create(DocumentInfoSchema, {
    key: create(SessionKeySchema, { accountId: d.accountId, sessionId: d.sessionId }),
    name: d.name,
    fencingToken: d.fencingToken,
    size: d.size,
    updatedAt: timestampFromMicros(d.updatedAtUs),
  });
}
