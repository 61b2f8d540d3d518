// Flags and environment variables: every server setting is a flag that falls
// back to an environment variable, then to a default. Every bad value is a
// ConfigError naming the flag, its variable and the rule.

import { parseArgs } from "node:util";
import { parseDuration } from "../lease/limits.js";

export class ConfigError extends Error {
  override readonly name = "ConfigError";
}

/** A flag and the environment variable it falls back to. */
export interface Setting {
  env: string;
  help: string;
  /** A secret: read from the environment only, since a flag shows in `ps`. */
  envOnly?: boolean;
}

/** Reads one settings table: flags first, then the environment. */
export interface SettingsReader<N extends string> {
  get(name: N): string | undefined;
  /** Milliseconds of a duration setting, or `fallback` when unset. */
  duration(name: N, fallback: number): number;
}

export function readSettings<S extends Record<string, Setting>>(
  settings: S,
  argv: string[],
  env: NodeJS.ProcessEnv,
): SettingsReader<keyof S & string> {
  const options = Object.fromEntries(
    Object.entries(settings)
      .filter(([, s]) => !s.envOnly)
      .map(([k]) => [k, { type: "string" as const }]),
  );
  const { values } = parseArgs({ args: argv, options, strict: true, allowPositionals: false });
  // Names are keys of `settings` by their type, so the entry exists.
  const envName = (name: keyof S & string) => (settings[name] as Setting).env;
  const get = (name: keyof S & string): string | undefined => {
    const flag = values[name];
    if (typeof flag === "string") return flag;
    const fromEnv = env[envName(name)];
    return fromEnv === "" ? undefined : fromEnv;
  };
  return {
    get,
    duration: (name, fallback) => {
      const text = get(name);
      if (text === undefined) return fallback;
      const ms = parseDuration(text);
      if (ms === undefined) {
        throw new ConfigError(
          `--${name} (${envName(name)}) must be a duration such as 250ms, 10s, 5m or 1h, got ${JSON.stringify(text)}`,
        );
      }
      return ms;
    },
  };
}

/** The flag table as help text: flag, environment variable, description. */
/**
 * An integer setting from `min` to `max`: `fallback` when unset, else its
 * text as written, or a ConfigError naming the flag, its variable and the rule.
 */
export function integerSetting(
  name: string,
  setting: Setting,
  text: string | undefined,
  fallback: number,
  min: number,
  max: number,
): number {
  if (text === undefined) return fallback;
  const n = Number(text);
  if (!/^\d+$/.test(text.trim()) || !Number.isSafeInteger(n) || n < min || n > max) {
    throw new ConfigError(
      `--${name} (${setting.env}) must be an integer from ${min} to ${max}, got ${JSON.stringify(text)}`,
    );
  }
  return n;
}

export function settingsHelp(settings: Record<string, Setting>): string {
  return Object.entries(settings)
    .map(
      ([flag, s]) => `  ${(s.envOnly ? "" : `--${flag}`).padEnd(28)} ${s.env.padEnd(37)} ${s.help}`,
    )
    .join("\n");
}
