import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { pino } from 'pino';
import { runMigrations } from '../../src/adapters/postgres/migrations.js';
import { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import type { Projection } from '../../src/projections/projection.js';
import { CHECKPOINTS_MIGRATION, ProjectionRunner } from '../../src/projections/runner.js';
import { until } from '../event-store/postgres-helpers.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';

/**
 * The first catch-up reads each page once for every read model; one that
 * fails leaves the group and retries alone, while the others finish, each
 * applying every event exactly once.
 */
describe('projection runner: one reader for every read model', { timeout: 60_000 }, () => {
  let db: TestDatabase;
  let store: PostgresEventStore;
  let poisoned = true;
  const counter = (name: string, poison: boolean): Projection => ({
    name,
    migrations: [{ id: `${name}_0001`, sql: `CREATE TABLE IF NOT EXISTS ${name} (stream text PRIMARY KEY, n integer NOT NULL)` }],
    tables: [{ name, key: ['stream'] }],
    async apply(sql, e) {
      if (poison && poisoned && e.type === 'Poison') throw new Error('cannot apply a Poison event');
      await sql.query(`INSERT INTO ${name} (stream, n) VALUES ($1, 1) ON CONFLICT (stream) DO UPDATE SET n = ${name}.n + 1`, [e.streamId]);
    },
  });
  const good = counter('shared_good', false);
  const bad = counter('shared_bad', true);

  before(async () => {
    db = await createTestDatabase('runnershared');
    await PostgresEventStore.migrate(db.pool);
    await runMigrations(db.pool, [CHECKPOINTS_MIGRATION, ...good.migrations, ...bad.migrations]);
    store = new PostgresEventStore({ pool: db.pool });
  });
  after(async () => {
    await store?.close();
    await db?.drop();
  });

  it('reads the log once, and a failing read model does not hold back the others', async () => {
    const stream = `test-${randomUUID()}`;
    await store.append(
      stream,
      ['Counted', 'Counted', 'Poison', 'Counted'].map((type) => ({ id: randomUUID(), type, data: {} })),
      'no_stream',
    );
    let reads = 0;
    const readAll = store.readAll.bind(store);
    store.readAll = (...a: Parameters<typeof store.readAll>) => {
      reads++;
      return readAll(...a);
    };
    const runner = new ProjectionRunner(store, db.pool, [good, bad], pino({ level: 'silent' }));
    try {
      await runner.start();
      assert.equal(reads, 1, 'one page, read once for both read models');
      const status = (name: string) => runner.status().find((s) => s.name === name)!;
      assert.equal(status('shared_good').caughtUp, true);
      assert.equal(status('shared_good').eventsApplied, 4);
      await until('the failing one to report', () => status('shared_bad').lastError !== undefined, 10_000);
      const count = async (table: string) =>
        (await db.pool.query<{ n: number }>(`SELECT n FROM ${table} WHERE stream = $1`, [stream])).rows[0]?.n;
      assert.equal(await count('shared_good'), 4);
      assert.equal(await count('shared_bad'), undefined, 'its page rolled back whole');
      poisoned = false;
      await runner.waitFor((await store.headPosition())!, 20_000);
      assert.equal(await count('shared_bad'), 4, 'every event applied exactly once after the retry');
      assert.equal(await count('shared_good'), 4);
    } finally {
      await runner.stop();
    }
  });
});
