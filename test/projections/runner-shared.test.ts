import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { pino } from 'pino';
import { setTimeout as sleep } from 'node:timers/promises';
import { Observable } from 'rxjs';
import { runMigrations } from '../../src/adapters/postgres/migrations.js';
import { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import { EventStoreUnavailableError, type RecordedEvent, type SubscriptionItem } from '../../src/domain/event-store.port.js';
import type { Projection } from '../../src/projections/projection.js';
import { CHECKPOINTS_MIGRATION, ProjectionRunner } from '../../src/projections/runner.js';
import { until } from '../event-store/postgres-helpers.js';
import { databaseFor } from './database.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';

/** Counts the calls of one of the store's methods from now on. */
function countCalls(store: PostgresEventStore, method: 'readAll' | 'subscribeToAll'): () => number {
  let n = 0;
  const target = store as unknown as Record<typeof method, (...a: unknown[]) => unknown>;
  const original = target[method].bind(store);
  target[method] = (...a: unknown[]) => {
    n++;
    return original(...a);
  };
  return () => n;
}
const countSubscriptions = (store: PostgresEventStore): (() => number) => countCalls(store, 'subscribeToAll');
const countReads = (store: PostgresEventStore): (() => number) => countCalls(store, 'readAll');

/** A recorder read model: each event's id and the transaction that applied it. */
const txRecorder = (name: string, before?: (e: RecordedEvent) => Promise<void>): Projection => ({
  name,
  migrations: [{ id: `${name}_0001`, sql: `CREATE TABLE IF NOT EXISTS ${name} (event_id text PRIMARY KEY, tx xid8 NOT NULL)` }],
  tables: [{ name, key: ['event_id'] }],
  async apply(sql, e) {
    await before?.(e);
    await sql.query(`INSERT INTO ${name} (event_id, tx) VALUES ($1, pg_current_xact_id())`, [e.id]);
  },
});

const txOf = async (db: TestDatabase, table: string, eventId: string): Promise<string | undefined> =>
  (await db.pool.query<{ tx: string }>(`SELECT tx::text FROM ${table} WHERE event_id = $1`, [eventId])).rows[0]?.tx;

const rowCount = async (db: TestDatabase, table: string): Promise<number> =>
  Number((await db.pool.query<{ n: string }>(`SELECT count(*) AS n FROM ${table}`)).rows[0]!.n);

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
    const reads = countReads(store);
    const runner = new ProjectionRunner(store, db.pool, [good, bad], pino({ level: 'silent' }));
    try {
      await runner.start();
      assert.equal(reads(), 1, 'one page, read once for both read models');
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

/**
 * Live, the read models caught up together follow one subscription and
 * apply each batch in one transaction; one that cannot apply a batch fails
 * alone (the batch is retried per read model), and resumes exactly once.
 */
describe('projection runner: one subscription and one transaction for the live read models', { timeout: 60_000 }, () => {
  let poisoned = true;
  const recorder = (name: string, poison: boolean): Projection =>
    txRecorder(name, (e) =>
      poison && poisoned && e.type === 'Poison' ? Promise.reject(new Error('cannot apply a Poison event')) : Promise.resolve(),
    );
  const a = recorder('live_a', false);
  const b = recorder('live_b', false);
  const bad = recorder('live_bad', true);
  const setup = databaseFor('runnerlive', [a, b, bad]);

  it('follows with one subscription, applies a batch in one transaction, and isolates a read model that fails', async () => {
    const [db, store] = [setup.db(), setup.store()];
    const stream = `test-${randomUUID()}`;
    const subscriptions = countSubscriptions(store);
    const runner = new ProjectionRunner(store, db.pool, [a, b, bad], pino({ level: 'silent' }));
    try {
      await runner.start();
      assert.equal(subscriptions(), 1, 'one live subscription for the three read models');
      const first = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], 'no_stream');
      await runner.waitFor(first.position, 10_000);
      const txOf = async (table: string) => (await db.pool.query<{ tx: string }>(`SELECT tx::text FROM ${table}`)).rows.map((r) => r.tx);
      const [txA, txB, txBad] = [await txOf('live_a'), await txOf('live_b'), await txOf('live_bad')];
      assert.equal(txA.length, 1);
      assert.deepEqual(txB, txA, 'both read models applied the event in the same transaction');
      assert.deepEqual(txBad, txA);

      const poison = await store.append(
        stream,
        ['Counted', 'Poison', 'Counted'].map((type) => ({ id: randomUUID(), type, data: {} })),
        first.nextExpectedRevision,
      );
      const status = (name: string) => runner.status().find((s) => s.name === name)!;
      await until('the failing one to report', () => status('live_bad').lastError !== undefined, 10_000);
      const count = (table: string) => rowCount(db, table);
      // The others went on: their share of the batch committed without the failing one's.
      await until('the others to apply the batch', async () => (await count('live_a')) === 4 && (await count('live_b')) === 4, 10_000);
      assert.equal(await count('live_bad'), 1, 'the failing read model kept nothing of the batch');
      poisoned = false;
      await runner.waitFor(poison.position, 20_000);
      assert.equal(await count('live_bad'), 4, 'every event applied exactly once after the retry');
      const thirdId = randomUUID();
      const third = await store.append(stream, [{ id: thirdId, type: 'Counted', data: {} }], poison.nextExpectedRevision);
      await runner.waitFor(third.position, 10_000);
      assert.deepEqual([await count('live_a'), await count('live_b'), await count('live_bad')], [5, 5, 5]);
      // The failed one caught up alone, then joined the group again: one transaction for the three.
      const txOfThird = async (table: string) =>
        (await db.pool.query<{ tx: string }>(`SELECT tx::text FROM ${table} WHERE event_id = $1`, [thirdId])).rows[0]?.tx;
      const thirdTx = await txOfThird('live_a');
      assert.deepEqual(
        [await txOfThird('live_b'), await txOfThird('live_bad')],
        [thirdTx, thirdTx],
        'the recovered read model rejoined the group',
      );
      assert.equal(subscriptions(), 1, 'still the one live subscription');
      assert.equal(status('live_a').eventsApplied, 5);
      assert.equal(status('live_bad').eventsApplied, 5);
    } finally {
      await runner.stop();
    }
  });
});

/**
 * A read model that failed catches up alone while the group goes on; the
 * events the group took off its queue meanwhile (after the last page that
 * read model read) reach it when it rejoins, each exactly once.
 */
describe('projection runner: a read model rejoining gets what the group applied while it caught up', { timeout: 60_000 }, () => {
  let poisoned = true;
  const a = txRecorder('rejoin_a');
  const bad = txRecorder('rejoin_bad', (e) =>
    poisoned && e.type === 'Poison' ? Promise.reject(new Error('cannot apply a Poison event')) : Promise.resolve(),
  );
  const setup = databaseFor('runnerrejoin', [a, bad]);

  it('requeues the events the group already took for the read model that rejoins', async () => {
    const [db, store] = [setup.db(), setup.store()];
    const stream = `test-${randomUUID()}`;
    const runner = new ProjectionRunner(store, db.pool, [a, bad], pino({ level: 'silent' }));
    const count = (table: string) => rowCount(db, table);
    try {
      await runner.start();
      const first = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], 'no_stream');
      await runner.waitFor(first.position, 10_000);
      const poison = await store.append(stream, [{ id: randomUUID(), type: 'Poison', data: {} }], first.nextExpectedRevision);
      const status = (name: string) => runner.status().find((s) => s.name === name)!;
      await until('the failing one to report', () => status('rejoin_bad').lastError !== undefined, 10_000);
      // Its retry (alone, from its checkpoint) reads the page [Poison], which is held back (no transaction open: an
      // open one would hold back every reader of the log) while three more events come and the group applies them.
      let hold = true;
      let held = false;
      const readAll = store.readAll.bind(store);
      store.readAll = async (opts) => {
        const page = await readAll(opts);
        if (hold && opts?.after === first.position) {
          held = true;
          await until('the test to release the page', () => !hold, 20_000);
        }
        return page;
      };
      poisoned = false;
      await until('the retry to read its page', () => held, 20_000);
      let rev = poison.nextExpectedRevision;
      for (let i = 0; i < 3; i++)
        rev = (await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], rev)).nextExpectedRevision;
      await until('the group to apply them', async () => (await count('rejoin_a')) === 5, 10_000);
      hold = false;
      await until('the rejoined read model to have them all', async () => (await count('rejoin_bad')) === 5, 10_000);
      const lastId = randomUUID();
      const last = await store.append(stream, [{ id: lastId, type: 'Counted', data: {} }], rev);
      await runner.waitFor(last.position, 10_000);
      assert.deepEqual([await count('rejoin_a'), await count('rejoin_bad')], [6, 6]);
      assert.equal(status('rejoin_bad').lastError, undefined, 'no event applied twice (a second insert of an id fails)');
      assert.equal(await txOf(db, 'rejoin_bad', lastId), await txOf(db, 'rejoin_a', lastId), 'it follows in the group again');
    } finally {
      await runner.stop();
    }
  });
});

/**
 * Runners of one process on one store (the read models' and the webhook
 * outbox's) share one live subscription; a runner whose position the shared
 * one has already passed gets one of its own and still misses nothing.
 */
describe('projection runners of one store: one live subscription between them', { timeout: 60_000 }, () => {
  const counter = (name: string): Projection => ({
    name,
    migrations: [{ id: `${name}_0001`, sql: `CREATE TABLE IF NOT EXISTS ${name} (event_id text PRIMARY KEY)` }],
    tables: [{ name, key: ['event_id'] }],
    async apply(sql, e) {
      await sql.query(`INSERT INTO ${name} (event_id) VALUES ($1)`, [e.id]);
    },
  });
  const one = counter('feed_one');
  const two = counter('feed_two');
  const late = counter('feed_late');
  const setup = databaseFor('runnerfeed', [one, two, late]);

  it('shares the subscription, and a runner behind it follows on its own', async () => {
    const [db, store] = [setup.db(), setup.store()];
    const stream = `test-${randomUUID()}`;
    const subscriptions = countSubscriptions(store);
    const silent = pino({ level: 'silent' });
    const first = new ProjectionRunner(store, db.pool, [one], silent);
    const second = new ProjectionRunner(store, db.pool, [two], silent);
    const count = (table: string) => rowCount(db, table);
    let third: ProjectionRunner | undefined;
    try {
      await first.start();
      await second.start();
      assert.equal(subscriptions(), 1, 'the second runner joined the first one’s subscription');
      let rev = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], 'no_stream');
      await first.waitFor(rev.position, 10_000);
      await second.waitFor(rev.position, 10_000);
      rev = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], rev.nextExpectedRevision);
      await first.waitFor(rev.position, 10_000);
      // A runner whose checkpoint is at the very start: the shared subscription has passed it.
      third = new ProjectionRunner(store, db.pool, [late], silent);
      await db.pool.query(`INSERT INTO projection_checkpoints (name, position) VALUES ('feed_late', NULL) ON CONFLICT DO NOTHING`);
      const catchUp = store.readAll.bind(store);
      let held = true;
      // Its catch-up sees nothing (as if it read before the events), so it follows from the start, behind the feed.
      store.readAll = async (...a: Parameters<typeof store.readAll>) => (held ? [] : catchUp(...a));
      await third.start();
      held = false;
      assert.equal(subscriptions(), 2, 'the runner behind subscribed on its own');
      rev = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], rev.nextExpectedRevision);
      for (const r of [first, second, third]) await r.waitFor(rev.position, 10_000);
      assert.deepEqual([await count('feed_one'), await count('feed_two'), await count('feed_late')], [3, 3, 3]);
    } finally {
      await first.stop();
      await second.stop();
      await third?.stop();
    }
  });
});

/** A live group whose subscription fails (the database went away) restarts as a group: one transaction per batch again. */
describe('projection runner: a live group that fails together restarts together', { timeout: 60_000 }, () => {
  const recorder = (name: string): Projection => txRecorder(name);
  const setup = databaseFor('runnerregroup', [recorder('regroup_x'), recorder('regroup_y')]);

  it('fails both, resumes both from one subscription, and applies the next batch in one transaction', async () => {
    const [db, store] = [setup.db(), setup.store()];
    let calls = 0;
    const subscribe = store.subscribeToAll.bind(store);
    store.subscribeToAll = (...args: Parameters<typeof store.subscribeToAll>) => {
      calls++;
      if (calls > 1) return subscribe(...args);
      return new Observable<SubscriptionItem>((sub) => {
        const t = setTimeout(() => sub.error(new EventStoreUnavailableError('injected: the database went away')), 50);
        return () => clearTimeout(t);
      });
    };
    const runner = new ProjectionRunner(store, db.pool, [recorder('regroup_x'), recorder('regroup_y')], pino({ level: 'silent' }));
    try {
      await runner.start();
      await until('both to report the failure', () => runner.status().every((s) => s.lastError !== undefined), 5_000);
      await until('both to resume', () => runner.status().every((s) => s.running && s.caughtUp), 10_000);
      assert.equal(calls, 2, 'one subscription before the failure, one after');
      const appended = await store.append(`test-${randomUUID()}`, [{ id: randomUUID(), type: 'Counted', data: {} }], 'no_stream');
      await runner.waitFor(appended.position, 10_000);
      const tx = async (table: string) => (await db.pool.query<{ tx: string }>(`SELECT tx::text FROM ${table}`)).rows.map((r) => r.tx);
      const x = await tx('regroup_x');
      assert.equal(x.length, 1);
      assert.deepEqual(await tx('regroup_y'), x, 'one transaction for both after the restart');
      assert.ok(runner.status().every((s) => s.lastError === undefined));
    } finally {
      await runner.stop();
    }
  });
});

/**
 * The shared subscription fails while a batch is in flight and that batch
 * then fails too: each read model is restarted once (not once per failure),
 * and stop() afterwards leaves no subscription open.
 */
describe('projection runner: a failure while a live batch is in flight restarts each read model once', { timeout: 60_000 }, () => {
  const gate = { armed: true, entered: false, poisoned: true, release: (): void => undefined };
  const gated = txRecorder('inflight_a', async (e) => {
    if (e.type !== 'Gate') return;
    if (gate.armed) {
      gate.armed = false;
      gate.entered = true;
      await new Promise<void>((resolve) => (gate.release = resolve));
    }
    if (gate.poisoned) throw new Error('cannot apply a Gate event yet');
  });
  const other = txRecorder('inflight_b');
  const setup = databaseFor('runnerinflight', [gated, other]);

  it('restarts once and ends every subscription at stop()', async () => {
    const [db, store] = [setup.db(), setup.store()];
    let active = 0;
    let calls = 0;
    let breakFirst: ((err: unknown) => void) | undefined;
    const subscribe = store.subscribeToAll.bind(store);
    store.subscribeToAll = (...args: Parameters<typeof store.subscribeToAll>) => {
      const n = ++calls;
      const inner = subscribe(...args);
      return new Observable<SubscriptionItem>((sub) => {
        active++;
        if (n === 1) breakFirst = (err) => sub.error(err);
        const s = inner.subscribe(sub);
        return () => {
          active--;
          s.unsubscribe();
        };
      });
    };
    const reads = countReads(store);
    const runner = new ProjectionRunner(store, db.pool, [gated, other], pino({ level: 'silent' }));
    try {
      await runner.start();
      const appended = await store.append(`test-${randomUUID()}`, [{ id: randomUUID(), type: 'Gate', data: {} }], 'no_stream');
      await until('the batch to be in flight', () => gate.entered, 10_000);
      const readsBefore = reads();
      // The subscription fails, then the batch in flight fails too (and, applied per read model, again).
      breakFirst!(new EventStoreUnavailableError('injected: the database went away'));
      gate.release();
      await sleep(300);
      gate.poisoned = false; // before the group's retry (1 s)
      await runner.waitFor(appended.position, 10_000);
      await until('both to follow again', () => runner.status().every((s) => s.running && s.caughtUp), 10_000);
      // A second restart of the same read model (the old code scheduled one per failure) came 2 s after the failure.
      await sleep(2500);
      assert.equal(reads() - readsBefore, 1, 'one restart: one catch-up read for the two read models');
      assert.equal(calls, 2, 'one subscription before the failure, one after');
      assert.equal(await rowCount(db, 'inflight_a'), 1);
      assert.equal(await rowCount(db, 'inflight_b'), 1);
    } finally {
      await runner.stop();
    }
    assert.equal(active, 0, 'no subscription left open after stop()');
  });
});

/**
 * The database goes away while a live batch is applied (every read model's
 * apply fails with a connection error): the group restarts as a group, so
 * afterwards a batch is still one transaction for every read model.
 */
describe('projection runner: a live group whose batch fails on a lost connection stays one group', { timeout: 60_000 }, () => {
  const down = { on: false };
  const outage = (): Promise<void> =>
    down.on
      ? Promise.reject(Object.assign(new Error('injected: terminating connection due to administrator command'), { code: '57P01' }))
      : Promise.resolve();
  const x = txRecorder('outage_x', outage);
  const y = txRecorder('outage_y', outage);
  const setup = databaseFor('runneroutage', [x, y]);

  it('applies the next batch in one transaction after the outage', async () => {
    const [db, store] = [setup.db(), setup.store()];
    const runner = new ProjectionRunner(store, db.pool, [x, y], pino({ level: 'silent' }));
    const stream = `test-${randomUUID()}`;
    try {
      await runner.start();
      down.on = true;
      let rev = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], 'no_stream');
      await until('both to report the failure', () => runner.status().every((s) => s.lastError !== undefined), 10_000);
      down.on = false;
      await runner.waitFor(rev.position, 20_000);
      await until('both to follow again', () => runner.status().every((s) => s.running && s.caughtUp), 10_000);
      const id = randomUUID();
      rev = await store.append(stream, [{ id, type: 'Counted', data: {} }], rev.nextExpectedRevision);
      await runner.waitFor(rev.position, 10_000);
      const tx = await txOf(db, 'outage_x', id);
      assert.ok(tx);
      assert.equal(await txOf(db, 'outage_y', id), tx, 'one transaction for both after the outage');
    } finally {
      await runner.stop();
    }
  });
});

/**
 * A read model whose checkpoint row is held (a rebuild's swap locks it FOR
 * UPDATE) does not hold back the others: the shared transaction gives up on
 * the lock after a bound and the batch is applied per read model. (The lock
 * is taken after the batch was delivered: an open transaction that locks a
 * row holds back the store's delivery of later events anyway.)
 */
describe('projection runner: a locked checkpoint row does not stall the live group', { timeout: 60_000 }, () => {
  const a = txRecorder('locked_a');
  const b = txRecorder('locked_b');
  const held = txRecorder('locked_held');
  const setup = databaseFor('runnerlocked', [a, b, held]);

  it('applies the others’ share while one row is locked, and that one’s after', async () => {
    const [db, store] = [setup.db(), setup.store()];
    // The runner's pool, with a gate before the next connection it takes (its batch's transaction).
    const gate = { armed: false, entered: false, release: (): void => undefined };
    const pool = new Proxy(db.pool, {
      get(target, prop) {
        if (prop === 'connect' && gate.armed) {
          return async () => {
            gate.armed = false;
            gate.entered = true;
            await new Promise<void>((resolve) => (gate.release = resolve));
            return target.connect();
          };
        }
        const v: unknown = Reflect.get(target, prop, target);
        return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
      },
    });
    const runner = new ProjectionRunner(store, pool, [a, b, held], pino({ level: 'silent' }));
    const stream = `test-${randomUUID()}`;
    const holder = await db.pool.connect();
    try {
      await runner.start();
      let rev = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], 'no_stream');
      await runner.waitFor(rev.position, 10_000);
      gate.armed = true;
      rev = await store.append(stream, [{ id: randomUUID(), type: 'Counted', data: {} }], rev.nextExpectedRevision);
      await until('the batch to be delivered', () => gate.entered, 10_000);
      await holder.query('BEGIN');
      await holder.query(`SELECT position FROM projection_checkpoints WHERE name = 'locked_held' FOR UPDATE`);
      gate.release();
      await until(
        'the others to apply the batch while the row is locked',
        async () => (await rowCount(db, 'locked_a')) === 2 && (await rowCount(db, 'locked_b')) === 2,
        15_000,
      );
      assert.equal(await rowCount(db, 'locked_held'), 1, 'the locked one waits');
      await holder.query('COMMIT');
      await runner.waitFor(rev.position, 10_000);
      assert.equal(await rowCount(db, 'locked_held'), 2);
      assert.ok(runner.status().every((s) => s.running && s.lastError === undefined));
    } finally {
      gate.release();
      await holder.query('ROLLBACK').catch(() => undefined);
      holder.release();
      await runner.stop();
    }
  });
});
