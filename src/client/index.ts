// The public API of the Leasehold client library.

export {
  type AcquireInit,
  type CheckFenceInit,
  type ClientEvent,
  createLeaseClient,
  type GetInit,
  type HistoryInit,
  type KeepAliveInit,
  type LeaseClient,
  type LeaseClientOptions,
  type ListInit,
  type ReleaseInit,
  type RenewInit,
  type RequestHandoffInit,
  type RevokeInit,
  type WatchInit,
} from "./client.js";
export { type ClientTls, type ClientTlsOptions, clientTlsOptions } from "./client-tls.js";
export { dateFromTimestamp, durationFromMs, msFromDuration } from "./durations.js";
export {
  type CampaignOptions,
  campaign,
  type ElectionCallbacks,
  type ElectionChange,
  type ElectionKey,
  type Leader,
  type Leadership,
  leader,
  maxElectionValueLength,
  observe,
  type RunElectionOptions,
  runElection,
  type StopReason,
} from "./election.js";
export {
  type AuthFailure,
  CanceledError,
  DeadlineExceededError,
  errorDomain,
  InvalidArgumentError,
  LateGrantError,
  LeaseholdError,
  type LeaseLossReason,
  LeaseLostError,
  LeaseNotHeldError,
  type LossCause,
  NotAcquiredError,
  type NotHeldCause,
  PermissionDeniedError,
  ResourceExhaustedError,
  StaleFencingTokenError,
  toLeaseholdError,
  UnauthenticatedError,
  UnavailableError,
} from "./errors.js";
export {
  type FencingSource,
  fencingContextKey,
  fencingHeaderNames,
  fencingHeaders,
  fencingInterceptor,
} from "./fencing.js";
export {
  createGrpcTransport,
  type GrpcTransport,
  type GrpcTransportOptions,
} from "./grpc-transport.js";
export type { KeepAliveEvent } from "./keepalive.js";
export type {
  Keeper,
  KeeperAcquireInit,
  KeeperEvent,
  KeeperRunOptions,
  OpenKeeperOptions,
} from "./keeper.js";
export type { LeaseContext, RunExclusiveOptions, SessionKeyInit } from "./run-exclusive.js";
export {
  bearerTokenInterceptor,
  createEndpoint,
  type Endpoint,
  type FailoverEvent,
  type Protocol,
  type TransportOptions,
  traceparentInterceptor,
} from "./transport.js";
