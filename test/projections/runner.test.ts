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
 * The runner's failure path: an event a read model cannot apply stops that
 * read model at the event before it (its checkpoint does not move past it),
 * the error names the event, the runner retries with backoff, and once the
 * cause is gone it resumes with nothing lost or applied twice.
 */
describe('projection runner: a failing event', { timeout: 60_000 }, () => {
  let db: TestDatabase;
  let store: PostgresEventStore;
  let poisoned = true;
  const projection: Projection = {
    name: 'counter',
    migrations: [{ id: 'counter_0001', sql: 'CREATE TABLE IF NOT EXISTS counter (stream text PRIMARY KEY, n integer NOT NULL)' }],
    tables: [{ name: 'counter', key: ['stream'] }],
    async apply(sql, e) {
      if (e.type === 'Poison' && poisoned) throw new Error('cannot apply a Poison event');
      await sql.query('INSERT INTO counter (stream, n) VALUES ($1, 1) ON CONFLICT (stream) DO UPDATE SET n = counter.n + 1', [e.streamId]);
    },
  };

  before(async () => {
    db = await createTestDatabase('runner');
    await PostgresEventStore.migrate(db.pool);
    await runMigrations(db.pool, [CHECKPOINTS_MIGRATION, ...projection.migrations]);
    store = new PostgresEventStore({ pool: db.pool });
  });
  after(async () => {
    await store?.close();
    await db?.drop();
  });

  it('stops at the event, names it, and resumes exactly once the cause is gone', async () => {
    const stream = `test-${randomUUID()}`;
    const ok = await store.append(
      stream,
      [
        { id: randomUUID(), type: 'Counted', data: {} },
        { id: randomUUID(), type: 'Counted', data: {} },
      ],
      'no_stream',
    );
    await store.append(stream, [{ id: randomUUID(), type: 'Poison', data: {} }], ok.nextExpectedRevision);
    await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], ok.nextExpectedRevision + 1n);
    const runner = new ProjectionRunner(store, db.pool, [projection], pino({ level: 'silent' }));
    try {
      await runner.start();
      await until('the runner to report the failure', () => runner.status()[0]?.lastError !== undefined, 10_000);
      const failed = runner.status()[0]!;
      assert.equal(failed.running, false);
      assert.match(failed.lastError!, /applying Poison at [0-9a-f]{16}-[0-9a-f]{16} \(test-.*@2\)/);
      // All-or-nothing per batch: the checkpoint did not pass the poison, and nothing after it was applied.
      const before = await db.pool.query<{ n: number }>('SELECT n FROM counter WHERE stream = $1', [stream]);
      assert.ok((before.rows[0]?.n ?? 0) <= 2);
      poisoned = false;
      await until(
        'the runner to recover',
        () => runner.status()[0]?.running === true && runner.status()[0]?.lastError === undefined,
        15_000,
      );
      await runner.waitFor((await store.headPosition())!, 10_000);
      const { rows } = await db.pool.query<{ n: number }>('SELECT n FROM counter WHERE stream = $1', [stream]);
      assert.equal(rows[0]?.n, 4, 'every event applied exactly once');
    } finally {
      await runner.stop();
    }
  });
});
