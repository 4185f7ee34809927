import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { CommandHandler, bindAggregate } from '../../src/commands/command-handler.js';
import { ConcurrencyError } from '../../src/domain/event-store.port.js';
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

/** The create path's two savings: several commands in one append, and no read of a stream the caller just named at random. */
describe('command handler: a list of commands, a new stream', () => {
  test('a list is decided in order, each on the state the one before left, and appended once', async () => {
    const store = new MemoryEventStore();
    const hosts = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
    const before = store.appends;
    const done = await hosts.handle('h1', [register, reserve('a'), reserve('b')], meta);
    assert.equal(store.appends - before, 1, 'one append');
    assert.deepEqual(
      (await store.readStream(hostAggregate.streamName('h1'))).map((e) => e.type),
      ['HostRegistered', 'CapacityReserved', 'CapacityReserved'],
    );
    assert.equal(done.revision, 2n);
    // The third reservation sees the two before it (4 CPUs, 2 + 2): refused, and nothing of the list is written.
    await assert.rejects(hosts.handle('h1', [reserve('c'), reserve('d'), reserve('e')], meta));
    assert.equal((await store.readStream(hostAggregate.streamName('h1'))).length, 3);
  });

  test('newStream: no read before the append, and a stream that exists after all is a conflict, not a retry loop', async () => {
    const store = new MemoryEventStore();
    let reads = 0;
    const readStream = store.readStream.bind(store);
    store.readStream = (...a: Parameters<typeof store.readStream>) => {
      reads++;
      return readStream(...a);
    };
    const hosts = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
    await hosts.handle('h1', register, meta, { newStream: true });
    assert.equal(reads, 0);
    const appends = store.appends;
    await assert.rejects(
      bindAggregate(new CommandHandler(store, () => T0), hostAggregate).handle('h1', register, meta, { newStream: true }),
      (err: unknown) => err instanceof ConcurrencyError,
    );
    assert.equal(store.appends, appends, 'nothing written');
  });
});
