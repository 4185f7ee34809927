import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { freePort } from '../../src/adapters/postgres/embedded.js';
import { runMigrations } from '../../src/adapters/postgres/migrations.js';
import { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import type { NewEvent } from '../../src/domain/event-store.port.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';
import { eventsOf, record, sleep, until } from './postgres-helpers.js';

/** What the conformance suite cannot say about Postgres: its wake-ups, connections and migrations. */

const cat = (): string => `pg${randomBytes(4).toString('hex')}`;
const ev = (type = 'Pg', data: unknown = {}): NewEvent => ({ id: randomUUID(), type, data });

describe('Postgres event store specifics', { timeout: 180_000 }, () => {
  let db: TestDatabase;
  let store: PostgresEventStore;
  before(async () => {
    db = await createTestDatabase('pg_event_store');
    store = await PostgresEventStore.open({ url: db.url, pollIntervalMs: 100 });
  });
  after(async () => {
    await store?.close();
    await db?.drop();
  });

  async function listenerConnections(): Promise<number> {
    const { rows } = await db.pool.query<{ n: string }>(
      `SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'fleet-event-store-listener'`,
    );
    return Number(rows[0]?.n ?? 0);
  }

  it('headPosition of an empty log is undefined', async () => {
    const empty = await createTestDatabase('pg_empty');
    const s = await PostgresEventStore.open({ url: empty.url });
    try {
      assert.equal(await s.headPosition(), undefined);
      assert.deepEqual(await s.readAll(), []);
    } finally {
      await s.close();
      await empty.drop();
    }
  });

  it('a batch that only partly overlaps the stream is EVENT_ID_CONFLICT and writes nothing', async () => {
    const s = `${cat()}-1`;
    const a = ev();
    const b = ev();
    await store.append(s, [a, b], 'no_stream');
    await assert.rejects(store.append(s, [b, ev()], 'any'), (err: Error & { code?: string; status?: number }) => {
      assert.equal(err.code, 'EVENT_ID_CONFLICT');
      assert.equal(err.status, 409);
      assert.match(err.message, /some of these event ids/);
      return true;
    });
    assert.equal((await store.readStream(s)).length, 2);
    // the same id in another stream is a different event
    await store.append(`${cat()}-2`, [a], 'no_stream');
  });

  it("revisions beyond bigint: a conflict on append, the stream's end on read", async () => {
    const s = `${cat()}-1`;
    await store.append(s, [ev(), ev()], 'no_stream');
    await assert.rejects(
      store.append(s, [ev()], 2n ** 64n),
      (err: Error & { code?: string; actual?: unknown }) => err.code === 'CONCURRENCY_CONFLICT' && err.actual === 1n,
    );
    assert.deepEqual(await store.readStream(s, { fromRevision: 2n ** 64n }), []);
    assert.deepEqual(
      (await store.readStream(s, { direction: 'backwards', fromRevision: 2n ** 64n, maxCount: 1 })).map((e) => e.revision),
      [1n],
    );
    assert.equal((await store.readStream(s)).length, 2);
  });

  it('a filtered subscription reports checkpoints across pages with no match', async () => {
    const small = await PostgresEventStore.open({ url: db.url, batchSize: 5, pollIntervalMs: 100 });
    const wanted = `Wanted${randomBytes(3).toString('hex')}`;
    try {
      const c = cat();
      const noise = Array.from({ length: 23 }, () => ev('Noise'));
      await small.append(`${c}-1`, noise, 'no_stream');
      const hit = await small.append(`${c}-1`, [ev(wanted)], 'any');
      const live = record(small, { filter: { eventTypes: [wanted] } });
      try {
        await until('caught-up', () => live.items.some((i) => i.kind === 'caught-up'));
        const checkpoints = live.items.flatMap((i) => (i.kind === 'checkpoint' ? [i.position] : []));
        assert.ok(checkpoints.length >= 4, `expected checkpoints over the noise pages, got ${checkpoints.length}`);
        const positions = live.items.flatMap((i) =>
          i.kind === 'event' ? [i.event.position] : i.kind === 'checkpoint' ? [i.position] : [],
        );
        for (let i = 1; i < positions.length; i++) assert.ok((positions[i - 1] as string) < (positions[i] as string));
        assert.deepEqual(
          eventsOf(live.items).map((e) => e.position),
          [hit.position],
        );
      } finally {
        live.sub.unsubscribe();
      }
    } finally {
      await small.close();
    }
  });

  for (const notify of ['after-commit', 'in-transaction'] as const) {
    it(`another process's append wakes a subscriber through NOTIFY (${notify})`, async () => {
      // Polling once a minute: only a notification can deliver within the deadline.
      const reader = await PostgresEventStore.open({ url: db.url, pollIntervalMs: 60_000 });
      const writer = await PostgresEventStore.open({ url: db.url, notify });
      const c = cat();
      const live = record(reader, { filter: { streamPrefixes: [`${c}-`] } });
      try {
        await until('caught-up', () => live.items.some((i) => i.kind === 'caught-up'));
        await until('listening', async () => (await listenerConnections()) >= 1);
        await writer.append(`${c}-1`, [ev()], 'no_stream');
        await until('the event', () => eventsOf(live.items).length === 1, 5_000);
      } finally {
        live.sub.unsubscribe();
        await reader.close();
        await writer.close();
      }
    });
  }

  it('polling delivers what no notification announced', async () => {
    const c = cat();
    const live = record(store, { filter: { streamPrefixes: [`${c}-`] } });
    try {
      await until('caught-up', () => live.items.some((i) => i.kind === 'caught-up'));
      await db.pool.query(
        `SELECT status FROM es_append($1, 'no_stream', ARRAY[$2::uuid], ARRAY['Quiet'], ARRAY['{}'], ARRAY[NULL::text], false)`,
        [`${c}-1`, randomUUID()],
      );
      await until('the unannounced event', () => eventsOf(live.items).length === 1, 5_000);
    } finally {
      live.sub.unsubscribe();
    }
  });

  it('one listening connection is shared, and released when the last subscriber leaves', async () => {
    const s = await PostgresEventStore.open({ url: db.url });
    try {
      await until('no listener', async () => (await listenerConnections()) === 0);
      const a = record(s, { filter: { streamPrefixes: ['nothing-'] } });
      const b = record(s, {});
      await until('one listener', async () => (await listenerConnections()) === 1);
      a.sub.unsubscribe();
      await sleep(200);
      assert.equal(await listenerConnections(), 1);
      b.sub.unsubscribe();
      await until('listener released', async () => (await listenerConnections()) === 0, 5_000);
    } finally {
      await s.close();
    }
  });

  it('survives the loss of every connection: the listener comes back and events keep flowing', async () => {
    const reader = await PostgresEventStore.open({ url: db.url, pollIntervalMs: 60_000, applicationName: 'conn-loss-reader' });
    const c = cat();
    const live = record(reader, { filter: { streamPrefixes: [`${c}-`] } });
    try {
      await until('caught-up', () => live.items.some((i) => i.kind === 'caught-up'));
      await until('listening', async () => (await listenerConnections()) === 1);
      const admin = new pg.Client({ connectionString: db.url });
      await admin.connect();
      try {
        await admin.query(
          `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND application_name IN ('conn-loss-reader', 'fleet-event-store-listener')`,
        );
      } finally {
        await admin.end();
      }
      await until('the listener reconnected', async () => (await listenerConnections()) === 1, 10_000);
      // the reader's pool lost its connections too: its next page read must reconnect
      await sleep(300);
      await store.append(`${c}-1`, [ev()], 'no_stream');
      await until('the event after reconnecting', () => eventsOf(live.items).length === 1, 10_000);
      assert.deepEqual(live.errors, []);
    } finally {
      live.sub.unsubscribe();
      await reader.close();
    }
  });

  it('closing the store completes its subscriptions', async () => {
    const s = await PostgresEventStore.open({ url: db.url });
    let completed = false;
    s.subscribeToAll({}).subscribe({ complete: () => (completed = true) });
    await s.close();
    assert.equal(completed, true);
    await assert.rejects(s.ping(), (err: Error & { code?: string }) => err.code === 'EVENT_STORE_UNAVAILABLE');
  });

  it('ping against a server that is not there is EVENT_STORE_UNAVAILABLE', async () => {
    const port = await freePort();
    const pool = new pg.Pool({ connectionString: `postgres://postgres:x@127.0.0.1:${port}/none`, connectionTimeoutMillis: 2_000 });
    pool.on('error', () => undefined);
    const s = new PostgresEventStore({ pool, ownsPool: true });
    try {
      await assert.rejects(
        s.ping(),
        (err: Error & { code?: string; status?: number }) => err.code === 'EVENT_STORE_UNAVAILABLE' && err.status === 503,
      );
      await assert.rejects(
        s.append(`${cat()}-1`, [ev()], 'any'),
        (err: Error & { code?: string }) => err.code === 'EVENT_STORE_UNAVAILABLE',
      );
    } finally {
      await s.close();
    }
  });
});

describe('runMigrations', { timeout: 60_000 }, () => {
  let db: TestDatabase;
  before(async () => {
    db = await createTestDatabase('migrations');
  });
  after(async () => {
    await db?.drop();
  });

  it('replicas migrating at once apply each migration exactly once, in order', async () => {
    const migrations = [
      { id: 'test/001-a', sql: 'CREATE TABLE a (id int PRIMARY KEY); SELECT pg_sleep(0.2);' },
      { id: 'test/002-b', sql: 'CREATE TABLE b (id int REFERENCES a(id))' },
    ];
    const pools = Array.from({ length: 5 }, () => new pg.Pool({ connectionString: db.url, max: 2 }));
    try {
      const results = await Promise.all(pools.map((p) => runMigrations(p, migrations)));
      assert.equal(results.flatMap((r) => r.applied).length, 2, 'each applied by exactly one replica');
      const { rows } = await db.pool.query<{ id: string }>('SELECT id FROM schema_migrations ORDER BY applied_at, id');
      assert.deepEqual(
        rows.map((r) => r.id),
        ['test/001-a', 'test/002-b'],
      );
      assert.deepEqual((await runMigrations(db.pool, migrations)).applied, []);
    } finally {
      await Promise.all(pools.map((p) => p.end()));
    }
  });

  it('a failing migration rolls back and is not recorded; an edited one is refused', async () => {
    await assert.rejects(
      runMigrations(db.pool, [{ id: 'test/003-bad', sql: 'CREATE TABLE c (id int); SELECT no_such_function();' }]),
      (err: Error & { code?: string }) => {
        assert.equal(err.code, 'MIGRATION_FAILED');
        assert.match(err.message, /test\/003-bad/);
        return true;
      },
    );
    const c = await db.pool.query(`SELECT to_regclass('c') AS t`);
    assert.equal(c.rows[0]?.t, null, 'nothing of the failed migration remains');
    await assert.rejects(
      runMigrations(db.pool, [{ id: 'test/001-a', sql: 'CREATE TABLE a2 (id int)' }]),
      (err: Error & { code?: string }) => err.code === 'MIGRATION_CHANGED',
    );
    await assert.rejects(
      runMigrations(db.pool, [
        { id: 'x', sql: 'SELECT 1' },
        { id: 'x', sql: 'SELECT 2' },
      ]),
      (err: Error & { code?: string }) => err.code === 'MIGRATION_INVALID',
    );
  });
});
