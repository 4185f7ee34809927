import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { createServer } from 'node:net';
import { after, describe, it } from 'node:test';
import type { Subscription } from 'rxjs';
import { EsdbEventStore } from '../../src/adapters/esdb/esdb-event-store.js';
import { ApiKeys } from '../../src/adapters/http/auth.js';
import { buildApp } from '../../src/adapters/http/app.js';
import { Metrics } from '../../src/adapters/http/metrics.js';
import {
  ConcurrencyError,
  EventStoreUnavailableError,
  formatPosition,
  type NewEvent,
  type SubscriptionItem,
} from '../../src/domain/event-store.port.js';
import { FakeEsdbServer } from './fake-esdb-server.js';

/**
 * Faults through the same path as production: the EventStoreDB adapter and the
 * real @eventstore/db-client against the gRPC test double, which can drop live
 * subscriptions and stop/start on the same port.
 */

const BACKOFF = { initialMs: 20, maxMs: 250 };
const cleanups: Array<() => Promise<void>> = [];
after(async () => {
  for (const cleanup of cleanups.reverse()) await cleanup().catch(() => undefined);
});

const cat = (): string => `f${randomBytes(5).toString('hex')}`;
const ev = (i: number, type = 'Faulted'): NewEvent => ({ id: randomUUID(), type, data: { i } });

async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const address = server.address();
  await new Promise<void>((resolve) => server.close(() => resolve()));
  assert.ok(address && typeof address === 'object');
  return address.port;
}

function until(check: () => boolean, what: string, timeoutMs = 10_000): Promise<void> {
  return new Promise((resolve, reject) => {
    const started = Date.now();
    const tick = (): void => {
      if (check()) return resolve();
      if (Date.now() - started > timeoutMs) return reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}`));
      setTimeout(tick, 10);
    };
    tick();
  });
}

function record(store: EsdbEventStore, prefix: string): { items: SubscriptionItem[]; errors: unknown[]; sub: Subscription } {
  const items: SubscriptionItem[] = [];
  const errors: unknown[] = [];
  const sub = store
    .subscribeToAll({ filter: { streamPrefixes: [prefix] } })
    .subscribe({ next: (i) => items.push(i), error: (e) => errors.push(e) });
  cleanups.push(() => {
    sub.unsubscribe();
    return Promise.resolve();
  });
  return { items, errors, sub };
}

const eventNumbers = (items: SubscriptionItem[]): number[] =>
  items.flatMap((i) => (i.kind === 'event' ? [(i.event.data as { i: number }).i] : []));
const range = (n: number): number[] => Array.from({ length: n }, (_, i) => i);

function assertIncreasing(items: SubscriptionItem[]): void {
  const positions = items.flatMap((i) => (i.kind === 'event' ? [i.event.position] : i.kind === 'checkpoint' ? [i.position] : []));
  for (let k = 1; k < positions.length; k++)
    assert.ok(positions[k - 1]! < positions[k]!, `position ${positions[k - 1]} then ${positions[k]}`);
}

describe('EventStoreDB adapter under faults (real client → gRPC test double)', { timeout: 120_000 }, () => {
  it(
    'a subscription dropped mid-stream resubscribes from its last position: nothing lost, nothing duplicated',
    { timeout: 60_000 },
    async () => {
      const fake = await FakeEsdbServer.start();
      cleanups.push(() => fake.stop());
      const store = new EsdbEventStore({ connectionString: fake.connectionString, backoff: BACKOFF });
      cleanups.push(() => store.close());
      const c = cat();
      for (let i = 0; i < 50; i++) await store.append(`${c}-${i % 5}`, [ev(i)], 'any');
      const { items, errors } = record(store, `${c}-`);
      await until(() => items.some((i) => i.kind === 'caught-up'), 'caught-up');
      assert.deepEqual(eventNumbers(items), range(50));

      // Drop the live subscription repeatedly while a writer keeps appending.
      let drops = 0;
      for (let i = 50; i < 250; i++) {
        await store.append(`${c}-${i % 5}`, [ev(i)], 'any');
        if (i % 40 === 0) {
          // Drop only a live subscription: one still in its backoff would make this a no-op.
          await until(() => fake.liveSubscriptionCount === 1, 'a live subscription to drop');
          drops += fake.dropSubscriptions();
        }
      }
      await until(() => eventNumbers(items).length >= 250, 'all 250 events', 20_000);
      await new Promise((r) => setTimeout(r, 200)); // room for a duplicate to show up, were there one
      assert.equal(drops, 5);
      assert.deepEqual(eventNumbers(items), range(250), 'every event exactly once, in order');
      assert.equal(items.filter((i) => i.kind === 'caught-up').length, 1, 'caught-up is said once, not once per resubscription');
      assert.deepEqual(errors, []);
      assertIncreasing(items);
      assert.equal(fake.subscriptionStarts.length, 6, 'one subscription and five resubscriptions');
      assert.ok(
        fake.subscriptionStarts.slice(1).every((s) => typeof s === 'object'),
        'each resubscription starts from a position, not from the start',
      );
    },
  );

  it('resumes from the last server checkpoint when the filter skipped everything since the last event', { timeout: 60_000 }, async () => {
    const fake = await FakeEsdbServer.start();
    cleanups.push(() => fake.stop());
    const store = new EsdbEventStore({ connectionString: fake.connectionString, backoff: BACKOFF });
    cleanups.push(() => store.close());
    const c = cat();
    const noise = cat();
    await store.append(`${c}-1`, [ev(0)], 'no_stream');
    const { items } = record(store, `${c}-`);
    await until(() => items.some((i) => i.kind === 'caught-up'), 'caught-up');
    // 100 events the filter skips: the server checkpoints every 32 scanned events.
    for (let i = 0; i < 100; i++) await store.append(`${noise}-1`, [ev(-1)], 'any');
    await until(() => items.filter((i) => i.kind === 'checkpoint').length >= 3, '3 checkpoints');
    const lastCheckpoint = items.filter((i) => i.kind === 'checkpoint').at(-1)!;
    assert.equal(lastCheckpoint.kind, 'checkpoint');
    const startsBefore = fake.subscriptionStarts.length;
    assert.equal(fake.dropSubscriptions(), 1);
    await until(() => fake.subscriptionStarts.length > startsBefore, 'a resubscription');
    const resumedFrom = fake.subscriptionStarts.at(-1);
    assert.ok(typeof resumedFrom === 'object');
    assert.equal(formatPosition(resumedFrom.commit, resumedFrom.prepare), lastCheckpoint.position, 'resubscribed from the last checkpoint');
    await store.append(`${c}-1`, [ev(1)], 0n);
    await until(() => eventNumbers(items).length >= 2, 'the event after the drop');
    assert.deepEqual(eventNumbers(items), [0, 1]);
    assertIncreasing(items);
  });

  it(
    'unreachable at start-up: ping says so clearly, then recovers; a subscription started meanwhile delivers everything',
    { timeout: 60_000 },
    async () => {
      const port = await freePort();
      const fake = FakeEsdbServer.create({ port });
      cleanups.push(() => fake.stop());
      const store = new EsdbEventStore({ connectionString: `esdb://127.0.0.1:${port}?tls=false`, backoff: BACKOFF, pingTimeoutMs: 2_000 });
      cleanups.push(() => store.close());

      const err = await store.ping().then(
        () => assert.fail('ping succeeded with no server'),
        (e: unknown) => e,
      );
      assert.ok(err instanceof EventStoreUnavailableError, `got ${String(err)}`);
      assert.equal(err.code, 'EVENT_STORE_UNAVAILABLE');
      assert.equal(err.status, 503);
      assert.match(err.message, new RegExp(`EventStoreDB at 127\\.0\\.0\\.1:${port} is unreachable`));
      assert.match(err.message, /check EVENTSTORE_URL/);
      await assert.rejects(store.append(`${cat()}-1`, [ev(0)], 'any'), EventStoreUnavailableError);

      const c = cat();
      const { items, errors } = record(store, `${c}-`);
      await new Promise((r) => setTimeout(r, 300)); // a few failed attempts while the server is down
      assert.equal(items.length, 0);

      await fake.start();
      assert.equal(fake.port, port);
      await retrying(() => store.ping(), 'ping after the server came up');
      for (let i = 0; i < 20; i++) await store.append(`${c}-${i % 2}`, [ev(i)], 'any');
      await until(() => eventNumbers(items).length >= 20, 'the subscription started while the server was down');
      await new Promise((r) => setTimeout(r, 100));
      assert.deepEqual(eventNumbers(items), range(20));
      assert.deepEqual(errors, []);
      assert.equal(items.filter((i) => i.kind === 'caught-up').length, 1);
    },
  );

  it('/readyz is 503 naming the event store while EventStoreDB is unreachable, 200 once it is up', { timeout: 30_000 }, async () => {
    const port = await freePort();
    const fake = FakeEsdbServer.create({ port });
    cleanups.push(() => fake.stop());
    const store = new EsdbEventStore({ connectionString: `esdb://127.0.0.1:${port}?tls=false`, pingTimeoutMs: 1_500 });
    cleanups.push(() => store.close());
    // The checks' text is for the operator: /readyz shows it to the admin key (or METRICS_TOKEN) only.
    const admin = `admin-${'a'.repeat(24)}`;
    const app = await buildApp({
      logger: false,
      apiKeys: new ApiKeys([{ key: admin, tenant: 'admin', admin: true }]),
      metrics: new Metrics({ defaultMetrics: false }),
      readiness: { checks: { eventStore: () => store.ping() } },
      routes: [],
    });
    cleanups.push(() => app.close());
    const down = await app.inject({ method: 'GET', url: '/readyz', headers: { authorization: `Bearer ${admin}` } });
    assert.equal(down.statusCode, 503);
    const body = down.json<{ checks: Record<string, string> }>();
    assert.match(body.checks.eventStore ?? '', /EventStoreDB at 127\.0\.0\.1:\d+ is unreachable/);
    await fake.start();
    await retrying(async () => {
      const up = await app.inject({ method: 'GET', url: '/readyz' });
      assert.equal(up.statusCode, 200, up.body);
    }, '/readyz 200');
  });

  it(
    'survives a server restart mid-subscription: catches up on what was written meanwhile, exactly once',
    { timeout: 60_000 },
    async () => {
      const fake = await FakeEsdbServer.start();
      cleanups.push(() => fake.stop());
      const store = new EsdbEventStore({ connectionString: fake.connectionString, backoff: BACKOFF });
      cleanups.push(() => store.close());
      const c = cat();
      for (let i = 0; i < 10; i++) await store.append(`${c}-1`, [ev(i)], 'any');
      const { items, errors } = record(store, `${c}-`);
      await until(() => eventNumbers(items).length >= 10, 'history');
      await fake.stop();
      await assert.rejects(store.append(`${c}-1`, [ev(99)], 'any'), EventStoreUnavailableError);
      // Another writer adds events while this adapter cannot reach the server.
      await fake.start();
      const other = new EsdbEventStore({ connectionString: fake.connectionString });
      cleanups.push(() => other.close());
      for (let i = 10; i < 20; i++) await other.append(`${c}-2`, [ev(i)], 'any');
      await until(() => eventNumbers(items).length >= 20, 'events written around the restart', 20_000);
      await retrying(() => store.append(`${c}-1`, [ev(20)], 'any'), 'append after restart');
      await until(() => eventNumbers(items).length >= 21, 'the event after the restart');
      await new Promise((r) => setTimeout(r, 100));
      assert.deepEqual(eventNumbers(items), range(21));
      assert.deepEqual(errors, []);
      assertIncreasing(items);
    },
  );

  it(
    'Streams.Append (servers without BatchAppend): conflicts carry actual no_stream or revision, re-appends are idempotent',
    { timeout: 30_000 },
    async () => {
      const fake = await FakeEsdbServer.start({ batchAppend: false });
      cleanups.push(() => fake.stop());
      const store = new EsdbEventStore({ connectionString: fake.connectionString });
      cleanups.push(() => store.close());
      const s = `${cat()}-1`;
      const absent = await store.append(s, [ev(0)], 'stream_exists').catch((e: unknown) => e);
      assert.ok(absent instanceof ConcurrencyError);
      assert.equal(absent.actual, 'no_stream');
      const batch = [ev(0), ev(1)];
      const first = await store.append(s, batch, 'no_stream');
      assert.deepEqual(await store.append(s, batch, 'no_stream'), first);
      const stale = await store.append(s, [ev(2)], 0n).catch((e: unknown) => e);
      assert.ok(stale instanceof ConcurrencyError);
      assert.equal(stale.actual, 1n);
      assert.equal(stale.expected, 0n);
      assert.equal((await store.readStream(s)).length, 2);
      assert.ok((fake.calls.get('Streams.Append') ?? 0) >= 4);
      assert.equal(fake.calls.get('Streams.BatchAppend'), undefined, 'the client took the Streams.Append path');
    },
  );
});

async function retrying<T>(fn: () => Promise<T>, what: string, timeoutMs = 10_000): Promise<T> {
  const started = Date.now();
  for (;;) {
    try {
      return await fn();
    } catch (err) {
      if (Date.now() - started > timeoutMs) throw new Error(`timed out after ${timeoutMs} ms: ${what}`, { cause: err });
      await new Promise((r) => setTimeout(r, 50));
    }
  }
}
