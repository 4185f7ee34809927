import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { PostgresEventStore } from '../../src/adapters/postgres/postgres-event-store.js';
import { ConcurrencyError, type AppendResult, type NewEvent } from '../../src/domain/event-store.port.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';
import { eventsOf, record, until } from './postgres-helpers.js';

/**
 * Group commit: appends queued while a flush is in flight go together in the
 * next flush, one transaction, each with its own outcome. To know what shares a
 * flush, a test holds the stream lock es_append takes (a second connection's
 * advisory lock): the first append blocks on it, everything appended meanwhile
 * queues, and releasing the lock lets that queue go as one flush. One flush is
 * one transaction, so its events share the txid half of their positions.
 */

const cat = (): string => `gc${randomBytes(4).toString('hex')}`;
const ev = (data: unknown = {}): NewEvent => ({ id: randomUUID(), type: 'Grouped', data });
const txOf = (r: AppendResult): string => r.position.slice(0, 16);

/** A connection holding the per-stream lock of es_append/es_append_batch on some streams. */
async function holdStreams(url: string, streams: string[]): Promise<{ release(stream: string): Promise<void>; end(): Promise<void> }> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  for (const s of streams) await client.query(`SELECT pg_advisory_lock(17747, hashtext($1))`, [s]);
  return {
    release: async (s) => {
      await client.query(`SELECT pg_advisory_unlock(17747, hashtext($1))`, [s]);
    },
    end: () => client.end(),
  };
}

/** Waits until `n` backends of this application are blocked on a lock. */
async function blockedOnLock(pool: pg.Pool, applicationName: string, n: number, query: string): Promise<void> {
  await until(`${n} appends blocked on the stream lock`, async () => {
    const { rows } = await pool.query<{ n: string }>(
      `SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE $2`,
      [applicationName, `%${query}%`],
    );
    return Number(rows[0]?.n ?? 0) === n;
  });
}

/** Settles every promise, keeping each outcome. */
const outcomes = <T>(ps: Array<Promise<T>>): Promise<Array<PromiseSettledResult<T>>> => Promise.allSettled(ps);
function value<T>(r: PromiseSettledResult<T> | undefined): T {
  assert.ok(r, 'an outcome');
  if (r.status === 'rejected') throw new assert.AssertionError({ message: `expected success, got ${(r.reason as Error).message}` });
  return r.value;
}
function reason(r: PromiseSettledResult<unknown> | undefined): Error & { code?: string } {
  assert.ok(r?.status === 'rejected', 'expected a failure');
  return r.reason as Error & { code?: string };
}

describe('Postgres event store: group commit', { timeout: 120_000 }, () => {
  let db: TestDatabase;
  let store: PostgresEventStore;
  const app = `gc-${randomBytes(3).toString('hex')}`;
  before(async () => {
    db = await createTestDatabase('group_commit');
    store = await PostgresEventStore.open({ url: db.url, applicationName: app });
  });
  after(async () => {
    await store?.close();
    await db?.drop();
  });

  /** Appends `first` (which blocks on the held gate stream), then queues `rest` behind it, then opens the gate. */
  async function behindGate<T>(rest: () => Array<Promise<T>>): Promise<{ gate: AppendResult; results: Array<PromiseSettledResult<T>> }> {
    const gateStream = `${cat()}-gate`;
    const held = await holdStreams(db.url, [gateStream]);
    try {
      const gate = store.append(gateStream, [ev()], 'no_stream');
      await blockedOnLock(db.pool, app, 1, 'es_append(');
      const pending = outcomes(rest());
      await held.release(gateStream);
      return { gate: await gate, results: await pending };
    } finally {
      await held.end();
    }
  }

  it('a conflicting or partial append fails alone; the others of its flush commit, in one transaction', async () => {
    const c = cat();
    const [existing, overlap] = [ev(), ev()];
    await store.append(`${c}-exists`, [existing], 'no_stream');
    await store.append(`${c}-overlap`, [overlap], 'no_stream');
    const t = [ev(), ev()];
    const v = ev();
    const { gate, results } = await behindGate(() => [
      store.append(`${c}-exists`, [ev()], 5n),
      store.append(`${c}-t`, t, 'no_stream'),
      store.append(`${c}-overlap`, [overlap, ev()], 'any'),
      store.append(`${c}-missing`, [ev()], 'stream_exists'),
      store.append(`${c}-v`, [v], 'any'),
    ]);
    const wrongRevision = reason(results[0]);
    assert.ok(wrongRevision instanceof ConcurrencyError);
    assert.equal(wrongRevision.actual, 0n);
    assert.equal(reason(results[2]).code, 'EVENT_ID_CONFLICT');
    const missing = reason(results[3]);
    assert.ok(missing instanceof ConcurrencyError);
    assert.equal(missing.actual, 'no_stream');
    const tr = value(results[1]);
    const vr = value(results[4]);
    assert.equal(tr.nextExpectedRevision, 1n);
    assert.equal(vr.nextExpectedRevision, 0n);
    assert.equal(txOf(tr), txOf(vr), 'the two successes committed in one transaction');
    assert.notEqual(txOf(tr), txOf(gate), 'after the gate, in a flush of their own');
    assert.deepEqual(
      (await store.readStream(`${c}-exists`)).map((e) => e.id),
      [existing.id],
    );
    assert.deepEqual(
      (await store.readStream(`${c}-overlap`)).map((e) => e.id),
      [overlap.id],
    );
    assert.deepEqual(await store.readStream(`${c}-missing`), []);
    const readT = await store.readStream(`${c}-t`);
    assert.deepEqual(
      readT.map((e) => [e.id, e.revision]),
      [
        [t[0]?.id, 0n],
        [t[1]?.id, 1n],
      ],
    );
    assert.equal(readT[1]?.position, tr.position);
    assert.deepEqual(
      (await store.readStream(`${c}-v`)).map((e) => e.position),
      [vr.position],
    );
  });

  it('appends to one stream in one flush check exact expected revisions, each seeing the one before', async () => {
    const s = `${cat()}-one`;
    const [a, b, c1, c2] = [ev({ n: 1 }), ev({ n: 2 }), ev({ n: 3 }), ev({ n: 4 })];
    const { results } = await behindGate(() => [
      store.append(s, [a], 'no_stream'),
      store.append(s, [b], 0n),
      store.append(s, [c1, c2], 1n),
      store.append(s, [ev()], 1n), // stale: the stream is at 3 by now
      store.append(s, [ev()], 'no_stream'),
    ]);
    const [ra, rb, rc] = [value(results[0]), value(results[1]), value(results[2])];
    assert.deepEqual([ra.nextExpectedRevision, rb.nextExpectedRevision, rc.nextExpectedRevision], [0n, 1n, 3n]);
    assert.ok(txOf(ra) === txOf(rb) && txOf(rb) === txOf(rc), 'one transaction');
    assert.ok(ra.position < rb.position && rb.position < rc.position, 'positions follow the queue order');
    assert.equal((reason(results[3]) as Error & Partial<Pick<ConcurrencyError, 'actual'>>).actual, 3n);
    assert.equal((reason(results[4]) as Error & Partial<Pick<ConcurrencyError, 'actual'>>).actual, 3n);
    const read = await store.readStream(s);
    assert.deepEqual(
      read.map((e) => [e.id, e.revision]),
      [
        [a.id, 0n],
        [b.id, 1n],
        [c1.id, 2n],
        [c2.id, 3n],
      ],
    );
    assert.equal(read[3]?.position, rc.position);
  });

  it('a re-append within a flush is idempotent: of a committed batch, and of a batch earlier in the same queue', async () => {
    const c = cat();
    const [a, b] = [ev(), ev()];
    const first = await store.append(`${c}-old`, [a, b], 'no_stream');
    const y = ev();
    const { results } = await behindGate(() => [
      store.append(`${c}-old`, [a, b], 'no_stream'),
      store.append(`${c}-new`, [y], 'no_stream'),
      store.append(`${c}-old`, [ev()], 1n),
      store.append(`${c}-new`, [y], 'no_stream'),
    ]);
    assert.deepEqual(value(results[0]), first, 'the committed batch: its original revision and position');
    const written = value(results[1]);
    assert.deepEqual(value(results[3]), written, 'the retry of a batch queued just before it answers like it');
    assert.equal(value(results[2]).nextExpectedRevision, 2n, 'the idempotent re-append wrote nothing, so revision 1 was still current');
    assert.equal((await store.readStream(`${c}-new`)).length, 1);
    assert.equal((await store.readStream(`${c}-old`)).length, 3);
  });

  it("a grouped flush wakes another process's subscriber through its NOTIFY, not by polling", async () => {
    const reader = await PostgresEventStore.open({ url: db.url, pollIntervalMs: 60_000, applicationName: `${app}-reader` });
    const c = cat();
    const live = record(reader, { filter: { streamPrefixes: [`${c}-`] } });
    try {
      await until('caught-up', () => live.items.some((i) => i.kind === 'caught-up'));
      await until('listening', async () => {
        const { rows } = await db.pool.query<{ n: string }>(
          `SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'fleet-event-store-listener'`,
        );
        return Number(rows[0]?.n ?? 0) >= 1;
      });
      const { gate, results } = await behindGate(() => [
        store.append(`${c}-a`, [ev()], 'no_stream'),
        store.append(`${c}-b`, [ev()], 'no_stream'),
      ]);
      const [a, b] = [value(results[0]), value(results[1])];
      assert.equal(txOf(a), txOf(b), 'one flush');
      assert.notEqual(txOf(a), txOf(gate));
      await until('both events, long before the next poll', () => eventsOf(live.items).length === 2, 10_000);
      assert.deepEqual(live.errors, []);
    } finally {
      live.sub.unsubscribe();
      await reader.close();
    }
  });

  it('a connection killed mid-flush fails every append of that flush and commits none of them', async () => {
    const c = cat();
    const gate = `${c}-gate`;
    const blocker = `${c}-blocker`;
    const held = await holdStreams(db.url, [gate, blocker]);
    const admin = new pg.Client({ connectionString: db.url });
    await admin.connect();
    try {
      const first = store.append(gate, [ev()], 'no_stream');
      await blockedOnLock(db.pool, app, 1, 'es_append(');
      const streams = [`${c}-a`, blocker, `${c}-b`, `${c}-c`];
      const pending = outcomes(streams.map((s) => store.append(s, [ev(), ev()], 'any')));
      await held.release(gate);
      await first;
      // The flush has locked what it could and waits for the blocker's lock: kill its connection there.
      await blockedOnLock(db.pool, app, 1, 'es_append_batch(');
      await admin.query(
        `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE '%es_append_batch(%'`,
        [app],
      );
      const results = await pending;
      for (const r of results) assert.equal(reason(r).code, 'EVENT_STORE_UNAVAILABLE');
      await held.release(blocker);
      for (const s of streams) assert.deepEqual(await store.readStream(s), [], `nothing of ${s} committed`);
      // and the writer goes on
      assert.equal((await store.append(`${c}-a`, [ev()], 'no_stream')).nextExpectedRevision, 0n);
    } finally {
      await admin.end();
      await held.end();
    }
  });

  it('racing writers in two processes on shared streams: every stream gap-free, no event lost or doubled', async () => {
    const other = await PostgresEventStore.open({ url: db.url, applicationName: `${app}-other` });
    try {
      const c = cat();
      const streams = Array.from({ length: 5 }, (_, i) => `${c}-${i}`);
      const written: string[] = [];
      await Promise.all(
        Array.from({ length: 40 }, async (_, w) => {
          const s = w % 2 === 0 ? store : other;
          for (let i = 0; i < 15; i++) {
            const batch = Array.from({ length: 1 + ((w + i) % 3) }, () => ev({ w, i }));
            // each writer walks the streams in its own order, so flushes lock overlapping sets both ways round
            await s.append(streams[(w * 7 + i * (w % 2 === 0 ? 1 : 4)) % streams.length] as string, batch, 'any');
            written.push(...batch.map((e) => e.id));
          }
        }),
      );
      let total = 0;
      for (const stream of streams) {
        const read = await store.readStream(stream);
        assert.deepEqual(
          read.map((e) => e.revision),
          read.map((_, i) => BigInt(i)),
          `${stream} has no gap`,
        );
        total += read.length;
      }
      assert.equal(total, written.length);
      const all = await store.readAll({ filter: { streamPrefixes: [`${c}-`] } });
      assert.deepEqual(all.map((e) => e.id).sort(), [...written].sort());
      for (let i = 1; i < all.length; i++) assert.ok((all[i - 1]?.position as string) < (all[i]?.position as string));
    } finally {
      await other.close();
    }
  });

  it('racing optimistic writers: exactly one append per expected revision wins, across flushes and processes', async () => {
    const other = await PostgresEventStore.open({ url: db.url, applicationName: `${app}-racer` });
    try {
      const s = `${cat()}-contended`;
      const rounds = 12;
      let wins = 0;
      let conflicts = 0;
      await Promise.all(
        Array.from({ length: 16 }, async (_, w) => {
          const mine = w % 2 === 0 ? store : other;
          for (;;) {
            const [last] = await mine.readStream(s, { direction: 'backwards', maxCount: 1 });
            const at = last ? last.revision : ('no_stream' as const);
            if (last && last.revision >= BigInt(rounds - 1)) return;
            try {
              const r = await mine.append(s, [ev({ w })], at);
              assert.equal(r.nextExpectedRevision, at === 'no_stream' ? 0n : at + 1n);
              wins += 1;
            } catch (err) {
              assert.ok(err instanceof ConcurrencyError, String(err));
              conflicts += 1;
            }
          }
        }),
      );
      assert.equal(wins, rounds);
      assert.ok(conflicts > 0, 'the writers did race');
      assert.deepEqual(
        (await store.readStream(s)).map((e) => e.revision),
        Array.from({ length: rounds }, (_, i) => BigInt(i)),
      );
    } finally {
      await other.close();
    }
  });
});
