import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import { freePort, startEmbeddedPostgres, type EmbeddedPostgres } from '../../src/adapters/postgres/embedded.js';

/**
 * One fresh database per test file, on the server the test runner started
 * (TEST_DATABASE_URL, a URL of a maintenance database such as `postgres`).
 * Run a file on its own (`node --import tsx --test test/x.test.ts`) and this
 * starts an embedded server of its own in .tmp/test-pg-<pid> (files run in
 * parallel must not share a data directory), stopped and removed when the
 * process is about to exit.
 */
export interface TestDatabase {
  readonly url: string;
  readonly name: string;
  readonly pool: pg.Pool;
  drop(): Promise<void>;
}

let standalone: Promise<EmbeddedPostgres> | undefined;

async function serverUrl(): Promise<string> {
  const fromEnv = process.env.TEST_DATABASE_URL;
  if (fromEnv) return fromEnv;
  standalone ??= (async () => {
    const dataDir = path.resolve('.tmp', `test-pg-${process.pid}`);
    // Unref'd so the test process can finish; beforeExit then stops and removes it (and if the
    // process exits another way, embedded.ts still takes the server down with it).
    const server = await startEmbeddedPostgres({ dataDir, port: await freePort(), database: 'postgres', unref: true });
    process.once('beforeExit', () => {
      void server
        .stop()
        .then(() => fs.rm(dataDir, { recursive: true, force: true }))
        .then(() => fs.rm(`${dataDir}.log`, { force: true }))
        .then(() => fs.rm(`${dataDir}.password`, { force: true }));
    });
    return server;
  })();
  return (await standalone).adminUrl;
}

function withDatabase(url: string, database: string): string {
  const u = new URL(url);
  u.pathname = `/${database}`;
  return u.toString();
}

export async function createTestDatabase(prefix = 'test'): Promise<TestDatabase> {
  let admin: pg.Client | undefined;
  try {
    const base = await serverUrl();
    const name = `${prefix.replace(/[^a-z0-9_]/gi, '_').toLowerCase()}_${randomBytes(5).toString('hex')}`;
    admin = new pg.Client({ connectionString: base });
    await admin.connect();
    await admin.query(`CREATE DATABASE ${admin.escapeIdentifier(name)}`);
    await admin.end();
    admin = undefined;
    const url = withDatabase(base, name);
    const pool = new pg.Pool({ connectionString: url, max: 10 });
    pool.on('error', () => undefined);
    let dropped = false;
    return {
      url,
      name,
      pool,
      async drop(): Promise<void> {
        if (dropped) return;
        dropped = true;
        await pool.end().catch(() => undefined);
        const client = new pg.Client({ connectionString: base });
        await client.connect();
        try {
          await client.query(`DROP DATABASE IF EXISTS ${client.escapeIdentifier(name)} WITH (FORCE)`);
        } finally {
          await client.end();
        }
      },
    };
  } catch (err) {
    await admin?.end().catch(() => undefined);
    throw err;
  }
}
