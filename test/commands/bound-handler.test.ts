import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { CommandHandler, bindAggregate } from '../../src/commands/command-handler.js';
import { hostAggregate } from '../../src/domain/host/host.aggregate.js';
import type { HostCommand } from '../../src/domain/host/host.decider.js';
import { MemoryEventStore } from '../support/memory-event-store.js';

const meta = { correlationId: 'test', actor: 'admin' };
const T0 = new Date('2026-01-01T00:00:00Z');

const register: HostCommand = {
  type: 'RegisterHost',
  data: {
    host_id: 'h1',
    url: 'http://10.0.0.1:7070',
    region: 'eu',
    backend: 'process',
    labels: {},
    probed_capacity: { cpus: 4, ram_mb: 8192, storage_gb: 100, vm_count: 4, arch: 'amd64' },
    token_encrypted: 'v1.iv.ct.tag',
  },
};
const reserve = (vm_id: string): HostCommand => ({
  type: 'ReserveCapacity',
  data: { host_id: 'h1', vm_id, cpus: 2, ram_mb: 1024, storage_gb: 10 },
});

describe('bound handler (host aggregate)', () => {
  test('names the stream itself, and what it appends folds back to the state it returned', async () => {
    const store = new MemoryEventStore();
    const hosts = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
    const done = await hosts.handle('h1', register, meta);
    assert.equal(done.state.status, 'active');
    assert.equal(done.revision, 0n);
    const stored = await store.readStream(hostAggregate.streamName('h1'));
    assert.deepEqual(
      stored.map((e) => e.type),
      ['HostRegistered'],
    );
    assert.equal(stored[0]?.metadata.correlationId, 'test');
    // A handler with an empty cache reads the stream back through the aggregate's decoder.
    const fresh = await bindAggregate(new CommandHandler(store, () => T0), hostAggregate).load('h1');
    assert.deepEqual(fresh, { state: done.state, revision: 0n });
  });

  test('a writer that lost the race re-reads and decides again on the state it appends after', async () => {
    const store = new MemoryEventStore();
    const a = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
    const b = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
    await a.handle('h1', register, meta);
    await b.load('h1'); // b caches revision 0
    await a.handle('h1', reserve('vm-a'), meta); // revision 1: b's cache is now stale
    const won = await b.handle('h1', reserve('vm-b'), meta);
    assert.equal(won.revision, 2n);
    assert.equal(won.state.status === 'unregistered' ? -1 : won.state.reservations.size, 2);
    // Full now (4 CPUs, 2 + 2): a third reservation is refused by the decider on the re-read state, and nothing is written.
    const before = store.appends;
    await assert.rejects(
      a.handle('h1', reserve('vm-c'), meta),
      (err: unknown) => err instanceof AppError && err.code === 'HOST_CAPACITY_EXHAUSTED',
    );
    assert.equal(store.appends, before);
  });

  test('a refused command leaves the stream as it was', async () => {
    const store = new MemoryEventStore();
    const hosts = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
    await assert.rejects(hosts.handle('h1', reserve('vm-a'), meta), (err: unknown) => err instanceof AppError && err.status === 404);
    assert.deepEqual(await store.readStream(hostAggregate.streamName('h1')), []);
  });
});
