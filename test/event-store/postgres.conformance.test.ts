import { after, before } from 'node:test';
import { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';
import { describeEventStoreConformance } from './conformance.js';

let db: TestDatabase;
before(async () => {
  db = await createTestDatabase('conformance');
});
after(async () => {
  await db?.drop();
});

describeEventStoreConformance('postgres', async () => {
  const store = await PostgresEventStore.open({ url: db.url, pollIntervalMs: 200 });
  return {
    store,
    close: () => store.close(),
    async appendRaw(streamId, event) {
      // A foreign writer: raw JSON text and no metadata, straight into the append function.
      await db.pool.query(`SELECT * FROM es_append($1, 'any', ARRAY[$2::uuid], ARRAY[$3::text], ARRAY[$4::text], ARRAY[NULL::text])`, [
        streamId,
        event.id,
        event.type,
        event.data,
      ]);
    },
  };
});
