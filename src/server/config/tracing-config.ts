// Settings of tracing (docs/operations.md, "Tracing"): off unless --tracing
// on; then the standard OpenTelemetry variables choose the exporter and
// configure it. Only the choice is read here, so that a wrong value stops
// the server at start, naming the variable: OTEL_SDK_DISABLED and
// OTEL_TRACES_EXPORTER=none turn tracing off again, as the specification
// says; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL)
// picks the OTLP encoding. The endpoint, headers, timeout, compression,
// sampler, batching and resource variables are read by the SDK packages
// themselves (observability/tracing.ts).

import { ConfigError, type SettingsReader } from "../../config/settings.js";

/** An exporter spans go to. */
export type TraceExporterKind = "otlp-http-protobuf" | "otlp-http-json" | "console";

export interface TracingConfig {
  /** Spans are made: --tracing on, and the OTel variables do not turn the SDK off. */
  enabled: boolean;
  /** Where spans go (OTEL_TRACES_EXPORTER, default otlp; the OTLP protocol default http/protobuf). */
  exporters: TraceExporterKind[];
  /** Call spans carry the session id (--trace-session-keys on); the account is always there. */
  sessionKeys: boolean;
}

export const tracingSettings = {
  tracing: {
    env: "LEASEHOLD_TRACING",
    help: "on|off: OpenTelemetry spans of calls and batched statements, configured by OTEL_* (default off)",
  },
  "trace-session-keys": {
    env: "LEASEHOLD_TRACE_SESSION_KEYS",
    help: "on|off: call spans carry the session id, not only the account (default off)",
  },
} as const;

export type TracingSettingName = keyof typeof tracingSettings;

function onOff(read: SettingsReader<TracingSettingName>, name: TracingSettingName): boolean {
  const text = read.get(name) ?? "off";
  if (text !== "on" && text !== "off") {
    throw new ConfigError(
      `--${name} (${tracingSettings[name].env}) must be on or off, got ${JSON.stringify(text)}`,
    );
  }
  return text === "on";
}

// As the SDK reads its variables: trimmed, empty as unset.
function otelVariable(env: NodeJS.ProcessEnv, name: string): string | undefined {
  const value = env[name]?.trim();
  return value === undefined || value === "" ? undefined : value;
}

export function parseTracingConfig(
  read: SettingsReader<TracingSettingName>,
  env: NodeJS.ProcessEnv,
): TracingConfig {
  const requested = onOff(read, "tracing");
  const sessionKeys = onOff(read, "trace-session-keys");
  const off: TracingConfig = { enabled: false, exporters: [], sessionKeys };
  if (!requested) return off;
  const disabled = otelVariable(env, "OTEL_SDK_DISABLED")?.toLowerCase();
  if (disabled !== undefined && disabled !== "true" && disabled !== "false") {
    throw new ConfigError(
      `OTEL_SDK_DISABLED must be true or false, got ${JSON.stringify(disabled)}`,
    );
  }
  if (disabled === "true") return off;
  const names = (otelVariable(env, "OTEL_TRACES_EXPORTER") ?? "otlp")
    .split(",")
    .map((n) => n.trim().toLowerCase())
    .filter((n) => n !== "");
  if (names.includes("none")) return off;
  const protocolName = otelVariable(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    ? "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    : "OTEL_EXPORTER_OTLP_PROTOCOL";
  const exporters = [...new Set(names)].map((name): TraceExporterKind => {
    if (name === "console") return "console";
    if (name !== "otlp") {
      throw new ConfigError(
        `OTEL_TRACES_EXPORTER must list otlp, console or none, got ${JSON.stringify(name)}`,
      );
    }
    const protocol = otelVariable(env, protocolName) ?? "http/protobuf";
    if (protocol === "http/protobuf") return "otlp-http-protobuf";
    if (protocol === "http/json") return "otlp-http-json";
    throw new ConfigError(
      `${protocolName} must be http/protobuf or http/json (the lease server exports no OTLP over gRPC), got ${JSON.stringify(protocol)}`,
    );
  });
  return { enabled: true, exporters, sessionKeys };
}
