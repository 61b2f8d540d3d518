// A DATABASE_URL that lists several servers (a primary and its standbys,
// docs/failover.md) must make the driver skip standbys: postgres.js does so
// only for target_session_attrs=primary (its read-write check misses a hot
// standby). Anything else is refused at start, naming the setting and the rule.

import { describe, expect, it } from "vitest";
import { parseServerConfig } from "../src/server/config/server-config.js";
import { ConfigError } from "../src/server/config/settings.js";

const hosts = "postgres://u:p@127.0.0.1:5432,127.0.0.1:5433/leasehold";

function refusal(url: string): string {
  try {
    parseServerConfig(["--database-url", url], {});
  } catch (error) {
    expect(error).toBeInstanceOf(ConfigError);
    return (error as Error).message;
  }
  throw new Error(`${url} was accepted`);
}

describe("multi-host DATABASE_URL", () => {
  it("is refused without target_session_attrs, naming the setting and the rule", () => {
    const message = refusal(hosts);
    expect(message).toContain("--database-url (DATABASE_URL)");
    expect(message).toContain("target_session_attrs=primary");
    expect(message).toContain("got none");
  });

  it("is refused with read-write, which postgres.js lets through to a hot standby", () => {
    expect(refusal(`${hosts}?target_session_attrs=read-write`)).toContain("got read-write");
    expect(refusal(`${hosts}?sslmode=disable&target_session_attrs=any`)).toContain("got any");
  });

  it("is accepted with target_session_attrs=primary; one host needs nothing", () => {
    const url = `${hosts}?target_session_attrs=primary`;
    expect(parseServerConfig(["--database-url", url], {}).databaseUrl).toBe(url);
    const single = "postgres://u:p@127.0.0.1:5432/leasehold";
    expect(parseServerConfig(["--database-url", single], {}).databaseUrl).toBe(single);
  });
});
