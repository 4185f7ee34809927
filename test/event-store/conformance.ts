import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import type { Observable } from 'rxjs';
import {
  ConcurrencyError,
  type EventStore,
  type ExpectedRevision,
  type NewEvent,
  type Position,
  type RecordedEvent,
  type SubscriptionItem,
} from '../../src/domain/event-store.port.js';

/**
 * The one suite every EventStore adapter passes: Postgres always, EventStoreDB
 * through a gRPC test double and against a real server when EVENTSTORE_URL is
 * set. It asserts port semantics only, never an engine's internals, and uses
 * unique stream names and event types per test, so it runs against a shared
 * store that already holds other events.
 */
export interface ConformanceTarget {
  readonly store: EventStore;
  close(): Promise<void>;
  /**
   * Optional: write one event as a foreign client would (raw JSON text, no
   * metadata), to check the adapter reads what it did not write itself.
   */
  appendRaw?(streamId: string, event: { id: string; type: string; data: string }): Promise<void>;
}

export interface ConformanceOptions {
  /** Per-test timeout. Default 30 s. */
  readonly timeoutMs?: number;
}

const rand = (): string => randomBytes(6).toString('hex');
/** A category unique to one test: its streams are `<category>-<n>`. */
const category = (): string => `c${rand()}`;
const typeName = (): string => `Tested${rand()}`;

function ev(type = 'Tested', data: unknown = { n: 1 }, metadata?: NewEvent['metadata']): NewEvent {
  return { id: randomUUID(), type, data, ...(metadata ? { metadata } : {}) };
}

async function rejectsWithCode(promise: Promise<unknown>, code: string): Promise<Error & { code: string; status: number }> {
  try {
    await promise;
  } catch (err) {
    const e = err as Error & { code: string; status: number };
    assert.equal(e.code, code, `expected error code ${code}, got ${e.code}: ${e.message}`);
    assert.ok(e.message.length > 0);
    return e;
  }
  assert.fail(`expected a rejection with code ${code}`);
}

function throwsWithCode(fn: () => unknown, code: string): void {
  assert.throws(fn, (err: Error & { code?: string }) => {
    assert.equal(err.code, code, `expected error code ${code}, got ${String(err.code)}: ${err.message}`);
    return true;
  });
}

async function eventually<T>(fn: () => Promise<T>, ok: (value: T) => boolean, timeoutMs = 10_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let value = await fn();
  while (!ok(value) && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
    value = await fn();
  }
  return value;
}

/** Subscribes, collects items until `done(items)` holds, then unsubscribes. Rejects on timeout or error. */
function collect(
  source: Observable<SubscriptionItem>,
  done: (items: SubscriptionItem[]) => boolean,
  timeoutMs = 15_000,
): { items: SubscriptionItem[]; finished: Promise<SubscriptionItem[]> } {
  const items: SubscriptionItem[] = [];
  const finished = new Promise<SubscriptionItem[]>((resolve, reject) => {
    const timer = setTimeout(() => {
      sub.unsubscribe();
      reject(
        new Error(`subscription timed out after ${timeoutMs} ms with ${items.length} items: ${JSON.stringify(items.map(describeItem))}`),
      );
    }, timeoutMs);
    const sub = source.subscribe({
      next: (item) => {
        items.push(item);
        if (done(items)) {
          clearTimeout(timer);
          queueMicrotask(() => sub.unsubscribe());
          resolve(items);
        }
      },
      error: (err: unknown) => {
        clearTimeout(timer);
        // eslint-disable-next-line @typescript-eslint/prefer-promise-reject-errors -- relays what the subscription failed with, for the test to inspect
        reject(err);
      },
      complete: () => {
        clearTimeout(timer);
        reject(new Error('subscription completed unexpectedly'));
      },
    });
  });
  return { items, finished };
}

function describeItem(item: SubscriptionItem): string {
  if (item.kind === 'event') return `event ${item.event.streamId}@${item.event.revision} ${item.event.position}`;
  if (item.kind === 'checkpoint') return `checkpoint ${item.position}`;
  return `caught-up ${String(item.position)}`;
}

const events = (items: SubscriptionItem[]): RecordedEvent[] => items.flatMap((i) => (i.kind === 'event' ? [i.event] : []));
const itemPosition = (i: SubscriptionItem): Position | undefined => (i.kind === 'event' ? i.event.position : i.position);

function assertStrictlyIncreasing(positions: Position[], what: string): void {
  for (let i = 1; i < positions.length; i++) {
    assert.ok(
      (positions[i - 1] as string) < (positions[i] as string),
      `${what}: ${positions[i - 1]} then ${positions[i]} is not strictly increasing`,
    );
  }
}

export function describeEventStoreConformance(
  name: string,
  open: () => Promise<ConformanceTarget>,
  options: ConformanceOptions = {},
): void {
  const timeout = options.timeoutMs ?? 30_000;
  describe(`EventStore conformance: ${name}`, { timeout: timeout * 40 }, () => {
    let target: ConformanceTarget;
    let store: EventStore;
    before(async () => {
      target = await open();
      store = target.store;
    });
    after(async () => {
      await target?.close();
    });

    describe('expected revision', () => {
      it('no_stream creates a stream and returns the next revision and a position', { timeout }, async () => {
        const s = `${category()}-1`;
        const result = await store.append(s, [ev(), ev()], 'no_stream');
        assert.equal(result.nextExpectedRevision, 1n);
        assert.equal(store.parsePosition(result.position), result.position);
        const read = await store.readStream(s);
        assert.deepEqual(
          read.map((e) => e.revision),
          [0n, 1n],
        );
        assert.equal(read[1]?.position, result.position, 'the append result names the position of its last event');
      });

      it('no_stream on an existing stream is a ConcurrencyError carrying stream, expected and actual', { timeout }, async () => {
        const s = `${category()}-1`;
        await store.append(s, [ev(), ev()], 'no_stream');
        const err = await rejectsWithCode(store.append(s, [ev()], 'no_stream'), 'CONCURRENCY_CONFLICT');
        assert.ok(err instanceof ConcurrencyError);
        assert.equal(err.stream, s);
        assert.equal(err.expected, 'no_stream');
        assert.equal(err.actual, 1n);
        assert.equal(err.status, 409);
        assert.equal((await store.readStream(s)).length, 2, 'nothing written on conflict');
      });

      it('stream_exists fails on an absent stream with actual no_stream, succeeds on an existing one', { timeout }, async () => {
        const s = `${category()}-1`;
        const err = await rejectsWithCode(store.append(s, [ev()], 'stream_exists'), 'CONCURRENCY_CONFLICT');
        assert.ok(err instanceof ConcurrencyError);
        assert.equal(err.expected, 'stream_exists');
        assert.equal(err.actual, 'no_stream');
        assert.deepEqual(await store.readStream(s), [], 'nothing written on conflict');
        await store.append(s, [ev()], 'no_stream');
        const result = await store.append(s, [ev()], 'stream_exists');
        assert.equal(result.nextExpectedRevision, 1n);
      });

      it('any appends whether or not the stream exists', { timeout }, async () => {
        const s = `${category()}-1`;
        assert.equal((await store.append(s, [ev()], 'any')).nextExpectedRevision, 0n);
        assert.equal((await store.append(s, [ev(), ev()], 'any')).nextExpectedRevision, 2n);
      });

      it('an exact revision succeeds when current and conflicts when stale or absent', { timeout }, async () => {
        const s = `${category()}-1`;
        const absent = await rejectsWithCode(store.append(s, [ev()], 0n), 'CONCURRENCY_CONFLICT');
        assert.ok(absent instanceof ConcurrencyError);
        assert.equal(absent.actual, 'no_stream');
        assert.equal(absent.expected, 0n);
        await store.append(s, [ev(), ev(), ev()], 'no_stream');
        assert.equal((await store.append(s, [ev()], 2n)).nextExpectedRevision, 3n);
        const stale = await rejectsWithCode(store.append(s, [ev()], 2n), 'CONCURRENCY_CONFLICT');
        assert.ok(stale instanceof ConcurrencyError);
        assert.equal(stale.stream, s);
        assert.equal(stale.expected, 2n);
        assert.equal(stale.actual, 3n);
        const ahead = await rejectsWithCode(store.append(s, [ev()], 10n), 'CONCURRENCY_CONFLICT');
        assert.equal((ahead as typeof ahead & Partial<Pick<ConcurrencyError, 'actual'>>).actual, 3n);
        assert.equal((await store.readStream(s)).length, 4, 'nothing written on conflict');
      });
    });

    describe('idempotent append', () => {
      it('re-appending the same batch writes nothing and returns the original result', { timeout }, async () => {
        const s = `${category()}-1`;
        const batch = [ev(), ev(), ev()];
        const first = await store.append(s, batch, 'no_stream');
        const again = await store.append(s, batch, 'no_stream');
        assert.deepEqual(again, first);
        const withAny = await store.append(s, batch, 'any');
        assert.deepEqual(withAny, first);
        const read = await store.readStream(s);
        assert.deepEqual(
          read.map((e) => e.id),
          batch.map((e) => e.id),
        );
      });

      it('re-appending a later batch at its original expected revision is idempotent too', { timeout }, async () => {
        const s = `${category()}-1`;
        await store.append(s, [ev()], 'no_stream');
        const batch = [ev(), ev()];
        const first = await store.append(s, batch, 0n);
        assert.deepEqual(await store.append(s, batch, 0n), first);
        assert.equal((await store.readStream(s)).length, 3);
      });
    });

    describe('reading a stream', () => {
      it('reads forwards, backwards, from a revision and up to maxCount', { timeout }, async () => {
        const s = `${category()}-1`;
        const batch = [0, 1, 2, 3, 4].map((n) => ev('Counted', { n }));
        await store.append(s, batch, 'no_stream');
        const fwd = await store.readStream(s);
        assert.deepEqual(
          fwd.map((e) => e.revision),
          [0n, 1n, 2n, 3n, 4n],
        );
        assert.deepEqual(
          fwd.map((e) => e.id),
          batch.map((e) => e.id),
        );
        assert.deepEqual(
          fwd.map((e) => e.data),
          [0, 1, 2, 3, 4].map((n) => ({ n })),
        );
        assert.ok(fwd.every((e) => e.streamId === s && e.type === 'Counted'));
        assertStrictlyIncreasing(
          fwd.map((e) => e.position),
          'stream positions',
        );
        assert.deepEqual(
          (await store.readStream(s, { direction: 'backwards' })).map((e) => e.revision),
          [4n, 3n, 2n, 1n, 0n],
        );
        assert.deepEqual(
          (await store.readStream(s, { fromRevision: 2n })).map((e) => e.revision),
          [2n, 3n, 4n],
        );
        assert.deepEqual(
          (await store.readStream(s, { fromRevision: 2n, maxCount: 2 })).map((e) => e.revision),
          [2n, 3n],
        );
        assert.deepEqual(
          (await store.readStream(s, { direction: 'backwards', fromRevision: 2n })).map((e) => e.revision),
          [2n, 1n, 0n],
        );
        assert.deepEqual(
          (await store.readStream(s, { direction: 'backwards', maxCount: 2 })).map((e) => e.revision),
          [4n, 3n],
        );
        assert.deepEqual(await store.readStream(s, { fromRevision: 9n }), []);
      });

      it('an absent stream reads as empty in both directions', { timeout }, async () => {
        const s = `${category()}-1`;
        assert.deepEqual(await store.readStream(s), []);
        assert.deepEqual(await store.readStream(s, { direction: 'backwards' }), []);
      });
    });

    describe('reading all', () => {
      it('reads after a position (exclusive), with maxCount, in strictly increasing order', { timeout }, async () => {
        const cat = category();
        const a = await store.append(`${cat}-a`, [ev('Ra', { i: 0 })], 'no_stream');
        await store.append(`${cat}-b`, [ev('Ra', { i: 1 }), ev('Ra', { i: 2 })], 'no_stream');
        await store.append(`${cat}-a`, [ev('Ra', { i: 3 })], 0n);
        const filter = { streamPrefixes: [`${cat}-`] };
        const mine = await eventually(
          () => store.readAll({ after: a.position, filter }),
          (r) => r.length >= 3,
        );
        assert.deepEqual(
          mine.map((e) => (e.data as { i: number }).i),
          [1, 2, 3],
        );
        assert.ok(mine.every((e) => e.position > a.position));
        assertStrictlyIncreasing(
          mine.map((e) => e.position),
          'readAll positions',
        );
        const two = await store.readAll({ after: a.position, filter, maxCount: 2 });
        assert.deepEqual(
          two.map((e) => (e.data as { i: number }).i),
          [1, 2],
        );
        const fromStart = await store.readAll({ filter });
        assert.deepEqual(
          fromStart.map((e) => (e.data as { i: number }).i),
          [0, 1, 2, 3],
        );
        assert.equal(fromStart[0]?.position, a.position, 'readAll and append agree on positions');
        const stream = await store.readStream(`${cat}-b`);
        assert.deepEqual(
          stream.map((e) => e.position),
          fromStart.slice(1, 3).map((e) => e.position),
          'readStream and readAll agree on positions',
        );
        for (const bad of [-1, 1.5, Number.NaN]) {
          await assert.rejects(store.readAll({ maxCount: bad }), { code: 'INVALID_MAX_COUNT' });
          await assert.rejects(store.readStream(`${cat}-b`, { maxCount: bad }), { code: 'INVALID_MAX_COUNT' });
        }
      });

      it('filters by stream prefix and by event type', { timeout }, async () => {
        const cat = category();
        const other = category();
        const t1 = typeName();
        const t2 = typeName();
        await store.append(`${cat}-1`, [ev(t1), ev(t2)], 'no_stream');
        await store.append(`${other}-1`, [ev(t1)], 'no_stream');
        const byPrefix = await eventually(
          () => store.readAll({ filter: { streamPrefixes: [`${cat}-`, `${other}-`] } }),
          (r) => r.length >= 3,
        );
        assert.deepEqual(
          byPrefix.map((e) => e.streamId),
          [`${cat}-1`, `${cat}-1`, `${other}-1`],
        );
        const byType = await store.readAll({ filter: { eventTypes: [t1] } });
        assert.deepEqual(
          byType.map((e) => e.streamId),
          [`${cat}-1`, `${other}-1`],
        );
        const both = await store.readAll({ filter: { streamPrefixes: [`${cat}-`], eventTypes: [t2] } });
        assert.deepEqual(
          both.map((e) => e.type),
          [t2],
        );
      });

      it('headPosition is at or beyond the last append', { timeout }, async () => {
        const r = await store.append(`${category()}-1`, [ev()], 'no_stream');
        const head = await eventually(
          () => store.headPosition(),
          (h) => h !== undefined && h >= r.position,
        );
        assert.ok(head !== undefined && head >= r.position, `head ${String(head)} before ${r.position}`);
      });
    });

    describe('subscriptions', () => {
      it('catches up from the start, says caught-up once, then delivers live events', { timeout }, async () => {
        const cat = category();
        await store.append(`${cat}-1`, [ev('Sub', { i: 0 }), ev('Sub', { i: 1 })], 'no_stream');
        await store.append(`${cat}-2`, [ev('Sub', { i: 2 })], 'no_stream');
        let appendedLive = false;
        const { items, finished } = collect(store.subscribeToAll({ filter: { streamPrefixes: [`${cat}-`] } }), (all) => {
          if (!appendedLive && all.some((i) => i.kind === 'caught-up')) {
            appendedLive = true;
            void store.append(`${cat}-1`, [ev('Sub', { i: 3 })], 1n);
          }
          return events(all).length >= 4;
        });
        await finished;
        const evs = events(items);
        assert.deepEqual(
          evs.map((e) => (e.data as { i: number }).i),
          [0, 1, 2, 3],
        );
        const caughtUp = items.findIndex((i) => i.kind === 'caught-up');
        assert.equal(items.filter((i) => i.kind === 'caught-up').length, 1, 'caught-up is emitted once');
        assert.ok(
          items.findIndex((i) => i.kind === 'event' && (i.event.data as { i: number }).i === 2) < caughtUp,
          'history before caught-up',
        );
        assert.ok(
          items.findIndex((i) => i.kind === 'event' && (i.event.data as { i: number }).i === 3) > caughtUp,
          'the live event after caught-up',
        );
        assertStrictlyIncreasing(
          items.flatMap((i) => (i.kind === 'caught-up' ? [] : [itemPosition(i) as Position])),
          'subscription positions',
        );
      });

      it('resumes after a checkpoint, exclusive', { timeout }, async () => {
        const cat = category();
        const first = await store.append(`${cat}-1`, [ev('Sub', { i: 0 })], 'no_stream');
        await store.append(`${cat}-1`, [ev('Sub', { i: 1 }), ev('Sub', { i: 2 })], 0n);
        const { items, finished } = collect(
          store.subscribeToAll({ after: first.position, filter: { streamPrefixes: [`${cat}-`] } }),
          (all) => events(all).length >= 2 && all.some((i) => i.kind === 'caught-up'),
        );
        await finished;
        assert.deepEqual(
          events(items).map((e) => (e.data as { i: number }).i),
          [1, 2],
        );
        assert.ok(events(items).every((e) => e.position > first.position));
      });

      it('filters by event type, with every position strictly increasing', { timeout }, async () => {
        const cat = category();
        const wanted = typeName();
        const unwanted = typeName();
        await store.append(`${cat}-1`, [ev(wanted, { i: 0 }), ev(unwanted), ev(unwanted), ev(wanted, { i: 1 })], 'no_stream');
        await store.append(`${cat}-2`, [ev(unwanted), ev(wanted, { i: 2 })], 'no_stream');
        const { items, finished } = collect(
          store.subscribeToAll({ filter: { eventTypes: [wanted] } }),
          (all) => events(all).length >= 3 && all.some((i) => i.kind === 'caught-up'),
        );
        await finished;
        assert.deepEqual(
          events(items).map((e) => (e.data as { i: number }).i),
          [0, 1, 2],
        );
        assert.ok(events(items).every((e) => e.type === wanted));
        assertStrictlyIncreasing(
          items.flatMap((i) => (i.kind === 'caught-up' ? [] : [itemPosition(i) as Position])),
          'events and checkpoints',
        );
        const caughtUp = items.find((i) => i.kind === 'caught-up');
        const last = events(items).at(-1);
        assert.ok(
          caughtUp?.kind === 'caught-up' && caughtUp.position !== undefined && last && caughtUp.position >= last.position,
          'caught-up position is at or after the last delivered event',
        );
      });

      it('filters by stream prefix, live as well as catching up', { timeout }, async () => {
        const cat = category();
        const noise = category();
        await store.append(`${cat}-1`, [ev('P', { i: 0 })], 'no_stream');
        await store.append(`${noise}-1`, [ev('P', { i: -1 })], 'no_stream');
        let live = false;
        const { items, finished } = collect(store.subscribeToAll({ filter: { streamPrefixes: [`${cat}-`] } }), (all) => {
          if (!live && all.some((i) => i.kind === 'caught-up')) {
            live = true;
            void (async () => {
              await store.append(`${noise}-1`, [ev('P', { i: -2 })], 0n);
              await store.append(`${cat}-2`, [ev('P', { i: 1 })], 'no_stream');
            })();
          }
          return events(all).length >= 2;
        });
        await finished;
        assert.deepEqual(
          events(items).map((e) => (e.data as { i: number }).i),
          [0, 1],
        );
      });

      it('a bad checkpoint errors the subscription with INVALID_CHECKPOINT', { timeout }, async () => {
        const err = await new Promise<Error & { code?: string }>((resolve, reject) => {
          const timer = setTimeout(() => reject(new Error('no error emitted')), 5_000);
          store.subscribeToAll({ after: 'not-a-checkpoint' }).subscribe({
            next: () => undefined,
            error: (e: Error) => {
              clearTimeout(timer);
              resolve(e);
            },
          });
        });
        assert.equal(err.code, 'INVALID_CHECKPOINT');
      });
    });

    describe('bad input is a typed error and writes nothing', () => {
      const badStreams: unknown[] = ['', 'nodash', 'UPPER-1', ' space-1', '-1', 'vm-', 'vm-a b', 42, null, `vm-${'x'.repeat(300)}`];
      for (const bad of badStreams) {
        it(`stream name ${JSON.stringify(bad)?.slice(0, 30)}`, { timeout }, async () => {
          await rejectsWithCode(store.append(bad as string, [ev()], 'any'), 'INVALID_STREAM_NAME');
          await rejectsWithCode(store.readStream(bad as string), 'INVALID_STREAM_NAME');
        });
      }

      for (const bad of ['', '1abc', 'has space', 'x'.repeat(200), 7]) {
        it(`event type ${JSON.stringify(bad).slice(0, 30)}`, { timeout }, async () => {
          const s = `${category()}-1`;
          await rejectsWithCode(store.append(s, [ev(), { ...ev(), type: bad as string }], 'any'), 'INVALID_EVENT_TYPE');
          assert.deepEqual(await store.readStream(s), []);
        });
      }

      for (const [label, bad] of [
        ['-1n', -1n],
        ['the number 1', 1],
        ['"nope"', 'nope'],
        ['null', null],
        ['"NO_STREAM"', 'NO_STREAM'],
      ] as const) {
        it(`expected revision ${label}`, { timeout }, async () => {
          const s = `${category()}-1`;
          await rejectsWithCode(store.append(s, [ev()], bad as unknown as ExpectedRevision), 'INVALID_EXPECTED_REVISION');
          assert.deepEqual(await store.readStream(s), []);
        });
      }

      const cycle: Record<string, unknown> = { a: 1 };
      cycle.self = cycle;
      const nonJson: Array<[string, unknown]> = [
        ['a bigint', { big: 1n }],
        ['a cycle', cycle],
        ['NaN', { x: Number.NaN }],
        ['Infinity', [Number.POSITIVE_INFINITY]],
        ['a function', { f: () => 1 }],
        ['a Map', new Map([[1, 2]])],
        ['undefined', undefined],
        ['a symbol in an array', [Symbol('s')]],
      ];
      for (const [label, data] of nonJson) {
        it(`event data holding ${label}`, { timeout }, async () => {
          const s = `${category()}-1`;
          // the bad event is second: the first must not be written either
          await rejectsWithCode(
            store.append(s, [ev('Ok', { fine: true }), { id: randomUUID(), type: 'Bad', data }], 'no_stream'),
            'INVALID_EVENT_DATA',
          );
          assert.deepEqual(await store.readStream(s), []);
        });
      }

      it('a non-UUID event id', { timeout }, async () => {
        const s = `${category()}-1`;
        await rejectsWithCode(store.append(s, [{ id: 'not-a-uuid', type: 'X', data: {} }], 'any'), 'INVALID_EVENT_ID');
        assert.deepEqual(await store.readStream(s), []);
      });

      it('an empty batch', { timeout }, async () => {
        const s = `${category()}-1`;
        await assert.rejects(store.append(s, [], 'any'), (err: Error & { status?: number }) => err.status === 400);
        assert.deepEqual(await store.readStream(s), []);
      });

      for (const bad of [
        '',
        'junk',
        '0000000000000000-000000000000000g',
        '0-0',
        '00000000000000000000000000000000',
        ' 0000000000000000-0000000000000000',
      ]) {
        it(`checkpoint ${JSON.stringify(bad)}`, { timeout }, async () => {
          throwsWithCode(() => store.parsePosition(bad), 'INVALID_CHECKPOINT');
          await rejectsWithCode(store.readAll({ after: bad }), 'INVALID_CHECKPOINT');
        });
      }
    });

    describe('event contents', () => {
      it('data and metadata round-trip', { timeout }, async () => {
        const s = `${category()}-1`;
        const data = {
          text: 'héllo ✓ "quoted" \\ back',
          zero: 'a\u0000b',
          n: 1.5,
          neg: -7,
          big: 9007199254740991,
          t: true,
          f: false,
          nil: null,
          list: [1, 'two', { three: 3 }],
          nested: { deep: { deeper: [] } },
        };
        const metadata = {
          correlationId: randomUUID(),
          causationId: randomUUID(),
          tenantId: 'tenant-a',
          actor: 'user:alice',
          recordedAt: '2026-01-02T03:04:05.678Z',
        };
        const before = Date.now();
        await store.append(s, [ev('Rich', data, metadata), ev('Plain', { when: new Date('2026-01-01T00:00:00.000Z') })], 'no_stream');
        const [rich, plain] = await store.readStream(s);
        assert.ok(rich && plain);
        assert.deepEqual(rich.data, data);
        assert.deepEqual({ ...rich.metadata }, metadata);
        assert.ok(rich.created instanceof Date && !Number.isNaN(rich.created.getTime()));
        assert.ok(Math.abs(rich.created.getTime() - before) < 5 * 60_000, 'created is the commit time');
        assert.deepEqual(plain.data, { when: '2026-01-01T00:00:00.000Z' }, 'a Date becomes its ISO string, as in JSON');
        assert.equal(plain.metadata.correlationId, undefined);
        assert.equal(typeof plain.metadata, 'object');
        const viaAll = await eventually(
          () => store.readAll({ filter: { streamPrefixes: [s] } }),
          (r) => r.length >= 2,
        );
        assert.deepEqual({ ...viaAll[0]?.metadata }, metadata);
        assert.deepEqual(viaAll[0]?.data, data);
      });

      it('event ids come back lowercase as given', { timeout }, async () => {
        const s = `${category()}-1`;
        const id = randomUUID().toUpperCase();
        await store.append(s, [{ id, type: 'X', data: {} }], 'no_stream');
        assert.equal((await store.readStream(s))[0]?.id, id.toLowerCase());
      });

      it('reads an event written by a foreign client without metadata', { timeout }, async (t) => {
        if (!target.appendRaw) {
          t.skip('this target offers no raw writer');
          return;
        }
        const s = `${category()}-1`;
        const id = randomUUID();
        await target.appendRaw(s, { id, type: 'Foreign', data: '{"a":[1,2]}' });
        const [e] = await store.readStream(s);
        assert.equal(e?.id, id);
        assert.deepEqual(e?.data, { a: [1, 2] });
        assert.equal(typeof e?.metadata, 'object');
      });

      it('ping answers', { timeout }, async () => {
        await store.ping();
      });
    });
  });
}
