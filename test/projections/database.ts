import { after, before } from 'node:test';
import { runMigrations } from '../../src/adapters/postgres/migrations.js';
import { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import type { Projection } from '../../src/projections/projection.js';
import { CHECKPOINTS_MIGRATION } from '../../src/projections/runner.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';

/** A fresh database with the event store and these read models' tables, for the tests of one describe. */
export function databaseFor(
  prefix: string,
  projections: readonly Projection[],
): { db: () => TestDatabase; store: () => PostgresEventStore } {
  let db: TestDatabase | undefined;
  let store: PostgresEventStore | undefined;
  before(async () => {
    db = await createTestDatabase(prefix);
    await PostgresEventStore.migrate(db.pool);
    await runMigrations(db.pool, [CHECKPOINTS_MIGRATION, ...projections.flatMap((p) => p.migrations)]);
    store = new PostgresEventStore({ pool: db.pool });
  });
  after(async () => {
    await store?.close();
    await db?.drop();
  });
  return { db: () => db!, store: () => store! };
}
