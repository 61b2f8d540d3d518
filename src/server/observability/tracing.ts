// OpenTelemetry tracing of the lease server (docs/operations.md, "Tracing"):
// a span per call, made by the call policy's tracing step
// (rpc/tracing-step.ts), and a span per group-committed statement, linked to
// the span of every call the statement decided.
//
// Off (the default), none of this exists: the server builds no Tracing, the
// policy has no tracing step, and the batchers hold no tracer, so the off
// path is a check for undefined. On, the provider is built from the OTEL_*
// variables by the SDK packages: the exporters read their endpoint, headers,
// timeout and compression; the provider its sampler and limits; the batch
// processor its OTEL_BSP_* settings; the resource OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES (service.name defaults to "leasehold").
//
// A statement decides calls of many callers: it links to each call, and is
// the child of the first of them. Not a root span: a root is sampled on its
// own (under parentbased_traceidratio, at the ratio), so most sampled calls
// would lose the statement that decided them; a child of a sampled call is
// kept by any sampler that follows its parent. Only sampled calls are linked
// (`within` enters no context for a call the sampler left out). To make the links,
// the call's span context travels with its request into the batch: the
// adapters run each call's handler inside `within` (an AsyncLocalStorage,
// used only when tracing is on), and the group commit reads it when a
// request joins a batch. The tracer's own context manager is not used, so
// nothing global is registered and a process can run servers with and
// without tracing side by side. The server loads this module only when
// tracing is on.

import {
  type Attributes,
  ROOT_CONTEXT,
  type Span,
  type SpanContext,
  SpanKind,
  SpanStatusCode,
  type TextMapGetter,
  type TracerProvider,
  trace,
} from "@opentelemetry/api";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import { OTLPTraceExporter as OtlpJsonExporter } from "@opentelemetry/exporter-trace-otlp-http";
import { OTLPTraceExporter as OtlpProtobufExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import {
  defaultResource,
  detectResources,
  envDetector,
  resourceFromAttributes,
} from "@opentelemetry/resources";
import {
  BasicTracerProvider,
  BatchSpanProcessor,
  ConsoleSpanExporter,
  SimpleSpanProcessor,
  type SpanProcessor,
} from "@opentelemetry/sdk-trace-base";
import { currentCall, withinCall } from "./call-trace.js";

/** Where spans go: config/tracing-config.ts chooses from the OTEL_* variables. */
export type TraceExporterKind = "otlp-http-protobuf" | "otlp-http-json" | "console";

export interface TracingOptions {
  exporters: readonly TraceExporterKind[];
  /**
   * Used instead of a provider built from `exporters`, and not shut down
   * with the server (a test's provider with an in-memory exporter).
   */
  provider?: TracerProvider;
}

/** What the group commit and the renewal batcher use (db/statement-tracer.ts StatementTracer). */
export interface StatementTracing {
  link(): SpanContext | undefined;
  statement<T>(
    operation: string,
    links: readonly object[],
    rows: number,
    run: () => Promise<T>,
  ): Promise<T>;
}

export interface Tracing {
  /** Starts the span of one call; its parent is the caller's `traceparent`, when valid. */
  startCall(name: string, header: (name: string) => string | null, attributes: Attributes): Span;
  /**
   * Runs `work` as part of the call of `span`: the batched statements that
   * requests made inside it (and in what it starts) join link to the span.
   */
  within<T>(span: Span, work: () => T): T;
  readonly statements: StatementTracing;
  /** Exports the spans still buffered and stops the exporters. */
  shutdown(): Promise<void>;
}

const headerGetter: TextMapGetter<(name: string) => string | null> = {
  get: (header, key) => header(key) ?? undefined,
  keys: () => ["traceparent", "tracestate"],
};

const instrumentation = "leasehold";

export function createTracing(options: TracingOptions): Tracing {
  const own = options.provider === undefined ? providerFromEnv(options.exporters) : undefined;
  const provider = options.provider ?? own;
  if (provider === undefined) throw new Error("tracing needs a provider or an exporter");
  const tracer = provider.getTracer(instrumentation);
  const propagator = new W3CTraceContextPropagator();

  const statements: StatementTracing = {
    link: currentCall,
    async statement(operation, links, rows, run) {
      // One link per call: a KeepAlive stream's renewals in one batch share its context.
      const spanLinks = [...new Set(links)].map((context) => ({ context: context as SpanContext }));
      const first = spanLinks[0]?.context;
      const span = tracer.startSpan(
        `${operation} leases`,
        {
          kind: SpanKind.CLIENT,
          links: spanLinks,
          attributes: {
            "db.system.name": "postgresql",
            "db.collection.name": "leases",
            "db.operation.name": operation,
            "db.operation.batch.size": rows,
          },
        },
        first ? trace.setSpanContext(ROOT_CONTEXT, first) : ROOT_CONTEXT,
      );
      try {
        return await run();
      } catch (error) {
        span.recordException(error as Error);
        span.setStatus({ code: SpanStatusCode.ERROR, message: (error as Error).message });
        throw error;
      } finally {
        span.end();
      }
    },
  };

  const within = <T>(span: Span, work: () => T): T => {
    // A call the sampler left out is linked from nothing.
    if (!span.isRecording()) return work();
    return withinCall(span.spanContext(), work);
  };

  return {
    startCall(name, header, attributes) {
      const parent = propagator.extract(ROOT_CONTEXT, header, headerGetter);
      return tracer.startSpan(name, { kind: SpanKind.SERVER, attributes }, parent);
    },
    within,
    statements,
    shutdown: async () => {
      await own?.shutdown();
    },
  };
}

function providerFromEnv(exporters: readonly TraceExporterKind[]): BasicTracerProvider {
  const spanProcessors: SpanProcessor[] = exporters.map((kind) => {
    if (kind === "console") return new SimpleSpanProcessor(new ConsoleSpanExporter());
    return new BatchSpanProcessor(
      kind === "otlp-http-json" ? new OtlpJsonExporter() : new OtlpProtobufExporter(),
    );
  });
  // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the default name.
  const resource = defaultResource()
    .merge(resourceFromAttributes({ "service.name": "leasehold" }))
    .merge(detectResources({ detectors: [envDetector] }));
  return new BasicTracerProvider({ resource, spanProcessors });
}
