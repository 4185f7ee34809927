import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, it } from 'node:test';
import type { Position, RecordedEvent } from '../../src/domain/event-store.port.js';
import { LiveFeed } from '../../src/projections/live-feed.js';
import { until } from '../event-store/postgres-helpers.js';
import { databaseFor } from './database.js';

/**
 * The shared live feed is gap-free for every sink, wherever it starts: a sink
 * behind what the feed has delivered gets a subscription of its own (joining
 * would skip the events between its position and the feed's), one at the
 * feed's position joins it and gets only what comes after.
 */
describe('live feed: joining at, and behind, what it has delivered', { timeout: 60_000 }, () => {
  const setup = databaseFor('livefeed', []);

  const append = async (n: number): Promise<Position[]> => {
    const out: Position[] = [];
    for (let i = 0; i < n; i++)
      out.push(
        (await setup.store().append(`feed-${randomUUID()}`, [{ id: randomUUID(), type: 'Ticked', data: {} }], 'no_stream')).position,
      );
    return out;
  };
  const sink = (): { got: Position[]; next(e: RecordedEvent): void; error(err: unknown): void } => {
    const got: Position[] = [];
    return {
      got,
      next: (e) => void got.push(e.position),
      error: (err) => assert.fail(`the feed failed: ${String(err)}`),
    };
  };

  it('a sink behind the feed gets every event after its own position; one at the feed joins it; each exactly once', async () => {
    const store = setup.store();
    let upstreams = 0;
    const original = store.subscribeToAll.bind(store);
    store.subscribeToAll = (opts) => {
      upstreams++;
      return original(opts);
    };
    const first = await append(3);
    const feed = LiveFeed.of(store);
    const a = sink();
    const subA = feed.subscribe(undefined, a);
    await until('the feed delivered the first three', () => a.got.length >= 3);
    assert.deepEqual(a.got, first);

    const behind = sink();
    const subBehind = feed.subscribe(first[0], behind);
    const atFeed = sink();
    const subAt = feed.subscribe(first[2], atFeed);
    assert.equal(upstreams, 2, 'the sink behind the feed has a subscription of its own; the one at the feed joined');

    const later = await append(2);
    await until('every sink has the later events', () => a.got.length >= 5 && behind.got.length >= 4 && atFeed.got.length >= 2);
    await new Promise((r) => setTimeout(r, 200));
    assert.deepEqual(a.got, [...first, ...later]);
    assert.deepEqual(behind.got, [first[1], first[2], ...later], 'the events between its position and the feed came too, once');
    assert.deepEqual(atFeed.got, later);
    for (const s of [subA, subBehind, subAt]) s.unsubscribe();
  });
});
