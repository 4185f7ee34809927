import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { CommandHandler, bindAggregate } from '../../src/commands/command-handler.js';
import { PlacementView } from '../../src/commands/placement/placement-view.js';
import { hostAggregate } from '../../src/domain/host/host.aggregate.js';
import type { HostCommand } from '../../src/domain/host/host.decider.js';
import { MemoryEventStore } from '../support/memory-event-store.js';

const meta = { correlationId: 'test', actor: 'admin' };
const T0 = new Date('2026-01-01T00:00:00Z');

const register = (host_id: string, cpus = 4): HostCommand => ({
  type: 'RegisterHost',
  data: {
    host_id,
    url: `http://${host_id}:7070`,
    region: 'eu',
    backend: 'process',
    labels: {},
    probed_capacity: { cpus, ram_mb: 8192, storage_gb: 100, vm_count: 8, arch: 'amd64' },
    token_encrypted: 'v1.iv.ct.tag',
  },
});
const want = { cpus: 2, ram_mb: 1024, storage_gb: 10 };

async function fleet(ids: string[]) {
  const store = new MemoryEventStore();
  const hosts = bindAggregate(new CommandHandler(store, () => T0), hostAggregate);
  for (const id of ids) await hosts.handle(id, register(id), meta);
  const directory = async () => Promise.all(ids.map(async (id) => ({ id, revision: String((await hosts.load(id)).revision) })));
  return { hosts, view: new PlacementView(hosts, directory, 0) };
}

describe('placement view', () => {
  test('holds a decision in flight, so the next one spreads to another host', async () => {
    const { view } = await fleet(['h1', 'h2']);
    await view.fresh();
    const first = view.placeAndHold('vm-1', want, {});
    const second = view.placeAndHold('vm-2', want, {});
    assert.notEqual(first.decision.host_id, second.decision.host_id);
    const held = view.current().find((h) => h.id === first.decision.host_id);
    assert.equal(held?.allocated.cpus, 2);
  });

  test('a hold whose reservation landed is counted once, and a released hold frees its share', async () => {
    const { hosts, view } = await fleet(['h1']);
    await view.fresh();
    const choice = view.placeAndHold('vm-1', want, {});
    const landed = await hosts.handle(
      choice.decision.host_id,
      { type: 'ReserveCapacity', data: { host_id: 'h1', vm_id: 'vm-1', ...want } },
      meta,
    );
    view.set('h1', landed.state, landed.revision);
    assert.equal(view.current()[0]?.allocated.cpus, 2, 'the reservation, not the reservation plus its hold');
    view.placeAndHold('vm-2', want, {});
    assert.equal(view.current()[0]?.allocated.cpus, 4);
    view.release('vm-2');
    assert.equal(view.current()[0]?.allocated.cpus, 2);
  });

  test('an older state never replaces a newer one, and a reload drops hosts the directory no longer lists', async () => {
    const { hosts, view } = await fleet(['h1', 'h2']);
    await view.fresh();
    const older = await hosts.load('h1');
    const newer = await hosts.handle('h1', { type: 'ReserveCapacity', data: { host_id: 'h1', vm_id: 'vm-1', ...want } }, meta);
    view.set('h1', newer.state, newer.revision);
    view.set('h1', older.state, older.revision);
    assert.equal(view.current().find((h) => h.id === 'h1')?.allocated.cpus, 2);

    const only = new PlacementView(hosts, () => Promise.resolve([{ id: 'h2', revision: '0' }]), 0);
    await only.fresh();
    assert.deepEqual(
      only.current().map((h) => h.id),
      ['h2'],
    );
  });

  test('a reload from a directory that lags keeps a host this process just wrote, and drops one deregistered elsewhere', async () => {
    const { hosts } = await fleet([]);
    const lagging = new PlacementView(hosts, () => Promise.resolve([]), 0);
    await lagging.fresh();
    const h1 = await hosts.handle('h1', register('h1'), meta);
    lagging.set('h1', h1.state, h1.revision);
    await lagging.fresh();
    assert.deepEqual(
      lagging.current().map((h) => h.id),
      ['h1'],
      'the read model has not seen h1 yet, but this process registered it',
    );
    assert.equal(lagging.placeAndHold('vm-1', want, {}).decision.host_id, 'h1');
    lagging.release('vm-1');

    await hosts.handle('h1', { type: 'DeregisterHost', data: { host_id: 'h1', force: true } }, meta);
    await lagging.fresh();
    assert.deepEqual(lagging.current(), [], 'the stream, not the stale cache, decides');
  });
});
