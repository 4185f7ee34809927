import { join, resolve } from 'node:path';
import pg from 'pg';
import type { Config } from '../adapters/config.js';
import { EsdbEventStore } from '../adapters/esdb/esdb-event-store.js';
import type { Logger } from '../adapters/logger.js';
import { LEGACY_PASSWORD, startEmbeddedPostgres } from '../adapters/postgres/embedded.js';
import { readSecrets, secretsFile } from '../adapters/secrets.js';
import { createPool } from '../adapters/postgres/pool.js';
import { PostgresEventStore } from '../adapters/postgres/postgres-event-store.js';
import type { EventStore } from '../domain/event-store.port.js';

/**
 * What an operator CLI needs: the same database and event store the service
 * uses. On the embedded default it joins the running service's Postgres, or
 * starts the embedded server itself when the service is down.
 */
export async function connectForCli(config: Config, logger: Logger): Promise<{ pool: pg.Pool; store: EventStore; close(): Promise<void> }> {
  const closers: Array<() => Promise<void>> = [];
  let url = config.DATABASE_URL;
  if (!url) {
    // Read, never generated here: keys made by a CLI run would never be printed by the service's first start.
    const secrets = await readSecrets(resolve(config.DATA_DIR));
    if (!secrets)
      throw new Error(
        `${secretsFile(resolve(config.DATA_DIR))} does not exist: start the service once (npm start) on this DATA_DIR, or set DATABASE_URL`,
      );
    // No password in the file yet: the service has not started since passwords were generated, so the server has the old one.
    const password = secrets.embedded_pg_password ?? LEGACY_PASSWORD;
    const candidate = `postgres://postgres:${encodeURIComponent(password)}@127.0.0.1:${config.EMBEDDED_PG_PORT}/fleet`;
    const probe = new pg.Client({ connectionString: candidate, connectionTimeoutMillis: 1500 });
    try {
      await probe.connect();
      url = candidate;
    } catch {
      const server = await startEmbeddedPostgres({
        dataDir: join(resolve(config.DATA_DIR), 'pg'),
        port: config.EMBEDDED_PG_PORT,
        logger,
        password,
      });
      closers.push(() => server.stop());
      url = server.url;
    } finally {
      await probe.end().catch(() => undefined);
    }
  }
  const pool = createPool({ url, max: 4, applicationName: 'fleet-cli', logger });
  closers.push(async () => {
    await pool.end();
  });
  const store: EventStore = config.EVENTSTORE_URL
    ? new EsdbEventStore({ connectionString: config.EVENTSTORE_URL, logger })
    : new PostgresEventStore({ pool, logger });
  closers.push(() => store.close());
  return {
    pool,
    store,
    async close() {
      for (const c of closers.reverse()) await c().catch(() => undefined);
    },
  };
}
