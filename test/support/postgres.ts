import { randomBytes } from 'node:crypto';
import path from 'node:path';
import pg from 'pg';
import { freePort, startEmbeddedPostgres, type EmbeddedPostgres } from '../../src/adapters/postgres/embedded.js';

/**
 * One fresh database per test file, on the server the test runner started
 * (TEST_DATABASE_URL, a URL of a maintenance database such as `postgres`).
 * Run a file on its own (`node --import tsx --test test/x.test.ts`) and this
 * starts an embedded server itself, kept in .tmp/test-pg-standalone and
 * stopped when the last database of the process is dropped.
 */
export interface TestDatabase {
  readonly url: string;
  readonly name: string;
  readonly pool: pg.Pool;
  drop(): Promise<void>;
}

let standalone: Promise<EmbeddedPostgres> | undefined;
let live = 0;

async function serverUrl(): Promise<string> {
  const fromEnv = process.env.TEST_DATABASE_URL;
  if (fromEnv) return fromEnv;
  standalone ??= (async () => {
    const dataDir = path.resolve('.tmp', 'test-pg-standalone');
    return startEmbeddedPostgres({ dataDir, port: await freePort(), database: 'postgres' });
  })();
  return (await standalone).adminUrl;
}

function withDatabase(url: string, database: string): string {
  const u = new URL(url);
  u.pathname = `/${database}`;
  return u.toString();
}

export async function createTestDatabase(prefix = 'test'): Promise<TestDatabase> {
  live += 1;
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
        try {
          await pool.end().catch(() => undefined);
          const client = new pg.Client({ connectionString: base });
          await client.connect();
          try {
            await client.query(`DROP DATABASE IF EXISTS ${client.escapeIdentifier(name)} WITH (FORCE)`);
          } finally {
            await client.end();
          }
        } finally {
          await release();
        }
      },
    };
  } catch (err) {
    await admin?.end().catch(() => undefined);
    await release();
    throw err;
  }
}

async function release(): Promise<void> {
  live -= 1;
  if (live === 0 && standalone) {
    const server = standalone;
    standalone = undefined;
    await server.then((s) => s.stop(), () => undefined);
  }
}
