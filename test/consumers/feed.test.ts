import assert from 'node:assert/strict';
import type { AddressInfo } from 'node:net';
import { after, before, describe, it } from 'node:test';
import type { FastifyInstance } from 'fastify';
import { buildApp } from '../../src/adapters/http/app.js';
import { ApiKeys } from '../../src/adapters/http/auth.js';
import { eventsRoutes, FeedStats, toEnvironmentEvent } from '../../src/adapters/http/events.routes.js';
import { Metrics } from '../../src/adapters/http/metrics.js';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import {
  ADMIN_KEY,
  KEYS,
  appendLifecycle,
  auth,
  lifecycle,
  openSse,
  startHarness,
  vmEvent,
  type Harness,
  type SseClient,
} from './support.js';

const T0 = new Date('2026-04-01T08:00:00.000Z');
const at = (s: number): Date => new Date(T0.getTime() + s * 1000);

/** Every feed frame a tenant should get after `after`, straight from the store: the expected answer. */
async function expectedFor(h: Harness, tenant: string | undefined, after?: string): Promise<string[]> {
  const all = await h.service.store.readAll({ after });
  const owners = new Map<string, string>();
  for (const e of await h.service.store.readAll())
    if (e.type === 'VmRequested') owners.set(e.streamId, (e.data as { tenant_id: string }).tenant_id);
  return all
    .filter((e: RecordedEvent) => toEnvironmentEvent(e) && (tenant === undefined || owners.get(e.streamId) === tenant))
    .map((e) => e.position);
}

/** 100 VmFailed events of one VM, each with 8 KiB of `fill` in its error: bytes to fill a feed's buffers. */
const bigFailures = (vmId: string, batch: number, fill: string, when: Date): ReturnType<typeof vmEvent>[] => {
  const big = fill.repeat(8 * 1024);
  return Array.from({ length: 100 }, (_, i) =>
    vmEvent('VmFailed', { vm_id: vmId, reason: 'host_lost', error: `${batch}-${i} ${big}`, phase: 'booting', at: when.toISOString() }),
  );
};
const ids = (c: SseClient): string[] => c.frames.filter((f) => f.event === undefined).map((f) => f.id!);
const caughtUp = (c: SseClient): boolean => c.comments.some((x) => x.startsWith('caught-up'));

describe('live event feed (SSE)', { timeout: 120_000 }, () => {
  let h: Harness;
  let base: string;
  const open: SseClient[] = [];
  const sse = async (headers: Record<string, string>, path = '/v1/events', paused = false): Promise<SseClient> => {
    const c = await openSse(`${base}${path}`, headers, { paused });
    open.push(c);
    return c;
  };

  before(async () => {
    h = await startHarness('feed');
    await h.service.app.listen({ port: 0, host: '127.0.0.1' });
    base = `http://127.0.0.1:${(h.service.app.server.address() as AddressInfo).port}`;
    for (let i = 0; i < 4; i++) {
      await appendLifecycle(
        h.service.store,
        `a${i}`,
        lifecycle(`a${i}`, 'acme', 'h1', { requested: at(i * 60), booted: at(i * 60 + 2), ended: at(i * 60 + 30) }),
      );
      await appendLifecycle(
        h.service.store,
        `g${i}`,
        lifecycle(`g${i}`, 'globex', 'h1', { requested: at(i * 60 + 1), booted: at(i * 60 + 3) }),
      );
    }
  });
  after(async () => {
    for (const c of open) c.close();
    await h?.close();
  });

  it('sends a tenant its own EnvironmentEvents in order, admins everything', async () => {
    const acme = await sse(auth(KEYS.acme));
    assert.equal(acme.status, 200);
    assert.match(String(acme.res.headers['content-type']), /^text\/event-stream/);
    await acme.waitFor('acme caught up', () => caughtUp(acme));
    // Caught up is a moment of the log (rows below the server's oldest open transaction): what committed just then
    // arrives live right after, as in the catch-up test below.
    const forAcme = await expectedFor(h, 'acme');
    await acme.waitFor('every acme event', () => ids(acme).length >= forAcme.length, 10_000).catch(() => undefined);
    assert.deepEqual(ids(acme), forAcme);
    const first = JSON.parse(acme.frames[0]!.data!);
    assert.deepEqual(first, {
      id: acme.frames[0]!.id,
      event: 'vm.requested',
      vm_id: 'a0',
      state: 'requested',
      updated_at: at(0).toISOString(),
    });
    const booted = acme.frames.map((f) => JSON.parse(f.data!)).find((e) => e.event === 'vm.booted');
    assert.equal(booted.state, 'running');
    assert.match(booted.url, /^http:\/\//);
    assert.ok(acme.frames.every((f) => !f.data!.includes('auth_token')));

    const admin = await sse(auth(ADMIN_KEY));
    await admin.waitFor('admin caught up', () => caughtUp(admin));
    const forAdmin = await expectedFor(h, undefined);
    await admin.waitFor('every event', () => ids(admin).length >= forAdmin.length, 10_000).catch(() => undefined);
    assert.deepEqual(ids(admin), forAdmin);
    const onlyGlobex = await sse(auth(ADMIN_KEY), '/v1/events?tenant=globex');
    await onlyGlobex.waitFor('globex caught up', () => caughtUp(onlyGlobex));
    const forGlobex = await expectedFor(h, 'globex');
    await onlyGlobex.waitFor('every globex event', () => ids(onlyGlobex).length >= forGlobex.length, 10_000).catch(() => undefined);
    assert.deepEqual(ids(onlyGlobex), forGlobex);

    const refused = await sse(auth(KEYS.acme), '/v1/events?tenant=globex');
    assert.equal(refused.status, 403);
    const bad = await sse({ ...auth(KEYS.acme), 'last-event-id': 'nope' });
    assert.equal(bad.status, 400);
  });

  it('resumes from a mid position with exactly the rest, while events keep arriving live', async () => {
    const everything = await expectedFor(h, 'acme');
    const mid = everything[Math.floor(everything.length / 2)]!;
    // Appends run while the client catches up: catch-up and live must meet without a gap or a repeat.
    const writing = (async () => {
      for (let i = 10; i < 30; i++)
        await appendLifecycle(
          h.service.store,
          `a${i}`,
          lifecycle(`a${i}`, 'acme', 'h1', { requested: at(i * 60), booted: at(i * 60 + 2), ended: at(i * 60 + 9) }),
        );
      await appendLifecycle(h.service.store, 'g99', lifecycle('g99', 'globex', 'h1', { requested: at(5000) }));
      return appendLifecycle(h.service.store, 'a99', lifecycle('a99', 'acme', 'h1', { requested: at(5000), booted: at(5001) }));
    })();
    const resumed = await sse({ ...auth(KEYS.acme), 'last-event-id': mid });
    const last = await writing;
    await resumed.waitFor('the last live event', () => ids(resumed).includes(last), 20_000);
    await new Promise((r) => setTimeout(r, 300)); // anything extra would show up here
    const expected = await expectedFor(h, 'acme', mid);
    assert.equal(expected.at(-1), last);
    assert.deepEqual(ids(resumed), expected);
    assert.equal(new Set(ids(resumed)).size, ids(resumed).length);
    // The browser way: ?last_event_id= when no header can be set on the first connect.
    const viaQuery = await sse(auth(KEYS.acme), `/v1/events?last_event_id=${mid}`);
    await viaQuery.waitFor('caught up', () => caughtUp(viaQuery));
    assert.deepEqual(ids(viaQuery), expected);
  });

  it('sends heartbeat comments', async () => {
    const app = await feedApp({ heartbeatMs: 50 });
    try {
      const c = await openSse(`${app.url}/v1/events`, auth(KEYS.acme));
      open.push(c);
      await c.waitFor('two heartbeats', () => c.comments.filter((x) => x.startsWith('heartbeat')).length >= 2, 5_000);
    } finally {
      await app.close();
    }
  });

  it('cuts a slow consumer off with an error frame instead of buffering without bound', async () => {
    const stats = new FeedStats();
    const bound = 64 * 1024;
    const app = await feedApp({ maxBufferBytes: bound, closeGraceMs: 60_000, stallTimeoutMs: 2_000, stats });
    try {
      const slow = await openSse(`${app.url}/v1/events`, auth(KEYS.acme), { paused: true });
      open.push(slow);
      await appendLifecycle(h.service.store, 'slow', lifecycle('slow', 'acme', 'h1', { requested: at(9000) }));
      let total = 0;
      for (let batch = 0; batch < 12; batch++) {
        const events = bigFailures('slow', batch, 'x', at(9001));
        total += events.length * 8 * 1024;
        await h.service.store.append('vm-slow', events, 'any');
      }
      await slow.waitFor('the server to give up on the client', () => (stats.disconnects.get('slow_consumer') ?? 0) === 1, 20_000);
      assert.equal(stats.clients.size, 0);
      slow.res.resume();
      await slow.ended;
      const error = slow.frames.at(-1)!;
      assert.equal(error.event, 'error');
      const body = JSON.parse(error.data!);
      assert.equal(body.code, 'SLOW_CONSUMER');
      assert.match(body.message, /(more than 65536 bytes|took nothing for 2000 ms).*Last-Event-ID/);
      const received = slow.frames.reduce((n, f) => n + f.data!.length, 0);
      assert.ok(received < total / 2, `the server sent ${received} of ${total} bytes: it should have stopped early`);
    } finally {
      await app.close();
    }
  });

  it('catches a reading client up over a history far larger than the bound, without cutting it off', async () => {
    const stats = new FeedStats();
    const app = await feedApp({ maxBufferBytes: 64 * 1024, stats });
    try {
      const reader = await openSse(`${app.url}/v1/events`, auth(KEYS.acme));
      open.push(reader);
      await reader.waitFor('caught up', () => caughtUp(reader), 30_000);
      const expected = await expectedFor(h, 'acme');
      // Caught up is a moment of the log: what committed just then arrives live right after.
      await reader.waitFor('every event', () => ids(reader).length >= expected.length, 10_000).catch(() => undefined);
      assert.ok(reader.frames.reduce((n, f) => n + f.data!.length, 0) > 20 * 64 * 1024, 'the history is many times the bound');
      assert.deepEqual(ids(reader), expected);
      assert.equal(stats.disconnects.size, 0);
    } finally {
      await app.close();
    }
  });

  it('a live client that falls behind a burst catches up from the store again instead of being cut off', async () => {
    const stats = new FeedStats();
    const app = await feedApp({ maxBufferBytes: 64 * 1024, maxQueuedEvents: 50, stats });
    try {
      const reader = await openSse(`${app.url}/v1/events`, auth(KEYS.acme), { paused: true });
      open.push(reader);
      reader.res.resume();
      await reader.waitFor('caught up', () => caughtUp(reader), 30_000);
      // Not reading while the burst arrives live: the socket fills, the live queue passes its bound.
      reader.res.pause();
      await appendLifecycle(h.service.store, 'burst', lifecycle('burst', 'acme', 'h1', { requested: at(9500) }));
      for (let batch = 0; batch < 4; batch++) await h.service.store.append('vm-burst', bigFailures('burst', batch, 'y', at(9501)), 'any');
      await new Promise((r) => setTimeout(r, 1_000));
      reader.res.resume();
      const expected = await expectedFor(h, 'acme');
      await reader.waitFor('every event', () => ids(reader).length >= expected.length, 20_000).catch(() => undefined);
      assert.deepEqual(ids(reader), expected);
      assert.equal(stats.disconnects.size, 0, `cut off: ${JSON.stringify([...stats.disconnects])}`);
      assert.ok(stats.fallbacks >= 1, 'the burst went past the live queue bound: the feed fell back to the store');
    } finally {
      await app.close();
    }
  });

  /** A second API on the same store with tighter feed limits. */
  async function feedApp(opts: {
    heartbeatMs?: number;
    maxBufferBytes?: number;
    maxQueuedEvents?: number;
    closeGraceMs?: number;
    stallTimeoutMs?: number;
    stats?: FeedStats;
  }): Promise<{ url: string; close(): Promise<void> }> {
    const app: FastifyInstance = await buildApp({
      logger: false,
      apiKeys: new ApiKeys([
        { key: ADMIN_KEY, tenant: 'admin', admin: true },
        { key: KEYS.acme, tenant: 'acme', admin: false },
      ]),
      metrics: new Metrics({ defaultMetrics: false }),
      readiness: { checks: {} },
      routes: [eventsRoutes({ store: h.service.store, closeGraceMs: 200, ...opts })],
    });
    await app.listen({ port: 0, host: '127.0.0.1' });
    return { url: `http://127.0.0.1:${(app.server.address() as AddressInfo).port}`, close: () => app.close() };
  }
});
