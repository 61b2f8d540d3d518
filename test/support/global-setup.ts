// Starts one PostgreSQL for the whole run (embedded, unless DATABASE_URL is
// set) and migrates a template database once; every test file clones it.
// Compiles src/ first when dist/ is stale: tests spawn the compiled CLI.

import { randomBytes } from "node:crypto";
import { rm } from "node:fs/promises";
import path from "node:path";
import postgres from "postgres";
import type { TestProject } from "vitest/node";
import {
  type EmbeddedDatabase,
  makeDataParent,
  startEmbeddedPostgres,
} from "../../src/postgres/embedded-postgres.js";
import { allMigrationSets, migrate } from "../../src/postgres/migrate.js";
import { ensureBuild } from "./ensure-build.js";

declare module "vitest" {
  export interface ProvidedContext {
    adminUrl: string;
    templateDatabase: string;
  }
}

let embedded: EmbeddedDatabase | undefined;
let embeddedParent: string | undefined;

export async function setup(project: TestProject): Promise<void> {
  ensureBuild();
  let adminUrl = process.env.DATABASE_URL;
  if (!adminUrl) {
    const dir = await makeDataParent("leasehold-test-");
    embeddedParent = dir;
    embedded = await startEmbeddedPostgres({ dataDir: path.join(dir, "pgdata"), ephemeral: true });
    adminUrl = embedded.url;
  }
  const templateDatabase = `leasehold_template_${randomBytes(4).toString("hex")}`;
  const admin = postgres(adminUrl, { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE DATABASE ${templateDatabase}`);
  await admin.end();
  const url = new URL(adminUrl);
  url.pathname = `/${templateDatabase}`;
  await migrate(url.toString(), allMigrationSets);
  project.provide("adminUrl", adminUrl);
  project.provide("templateDatabase", templateDatabase);
}

export async function teardown(): Promise<void> {
  await embedded?.stop();
  if (embeddedParent !== undefined) await rm(embeddedParent, { recursive: true, force: true });
}
