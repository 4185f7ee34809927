import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type { Actor } from '../../src/commands/vm/vm-commands.js';
import { decodeVmEvent } from '../../src/domain/vm/vm.aggregate.js';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import { hostAllocation } from '../../src/domain/host/host.decider.js';
import { vmDecider, type VmState } from '../../src/domain/vm/vm.decider.js';
import { startService, apiKeysFrom, type Service } from '../../src/adapters/service.js';
import { ADMIN_KEY, startControlPlane, type ControlPlane } from '../support/control-plane.js';
import { foldHosts, readSettledLog } from './host-streams.js';
import { startStubAgents, type StubAgents } from './stub-agent.js';
import { pino } from 'pino';
import { registerHostRequestSchema } from '../../src/commands/host/host-commands.js';
import { parseVmSpec } from '../../src/domain/vm/spec.js';

/**
 * Races at the command layer: many concurrent CreateVm against hosts whose
 * agents are the STUB AGENT test double (see stub-agent.ts for why a double:
 * 400 real sandboxes do not boot on a 2-core CI machine). Everything else is
 * real: the HTTP client, Postgres event store, projections, placement.
 * Over-commitment is judged by folding every `host-*` stream from the event
 * store, event by event — never from the read model.
 */

const HOSTS = 20;
/** Per-host room, summing to 400: even hosts are bound by VM slots, odd ones by CPUs. */
const SIZES = Array.from({ length: HOSTS }, (_, i) => 10 + (i % 5) * 5);
const TOTAL = SIZES.reduce((a, b) => a + b, 0);
const SPEC = { image: 'base', cpus: 1, ram_mb: 512, storage_gb: 1 };

/** The VMs one race asked for: their events carry the race's correlation id. */
function foldVms(events: readonly RecordedEvent[], correlationId: string): Map<string, VmState> {
  const vms = new Map<string, VmState>();
  for (const e of events) {
    if (!e.streamId.startsWith('vm-') || e.metadata.correlationId !== correlationId) continue;
    const ev = decodeVmEvent(e);
    if (ev) vms.set(e.streamId.slice(3), vmDecider.evolve(vms.get(e.streamId.slice(3)) ?? vmDecider.initialState, ev));
  }
  return vms;
}

const actorFor = (race: string): Actor => ({ correlationId: race, actor: 'tenant:acme', tenantId: 'acme', admin: false });

const meta = { correlationId: 'setup', actor: 'admin', tenantId: 'admin' };

/** Registers HOSTS stub hosts through `service` and waits until the read models hold them (the placement view lists hosts from there). */
async function registerStubHosts(services: Service[], stub: StubAgents, prefix: string): Promise<void> {
  let last: string | undefined;
  for (let i = 0; i < HOSTS; i++) {
    const id = `${prefix}${i}`;
    const { url, token } = stub.add(id, i % 2 === 0 ? { vm_count: SIZES[i]!, cpus: 64 } : { vm_count: 64, cpus: SIZES[i]! });
    last = (await services[0]!.hosts.register(registerHostRequestSchema.parse({ id, url, token, backend: 'process' }), meta)).position;
  }
  for (const s of services) await s.runner.waitFor(last!, 30_000);
}

function tally(results: PromiseSettledResult<{ vm: { status: string } }>[]): Record<string, number> {
  const out: Record<string, number> = {};
  for (const r of results) {
    const k = r.status === 'fulfilled' ? `ok:${r.value.vm.status}` : String((r.reason as { code?: string }).code ?? r.reason);
    out[k] = (out[k] ?? 0) + 1;
  }
  return out;
}

/** The stream-level verdict: who holds what, and that failed VMs hold nothing. */
async function verifyFromStreams(cp: ControlPlane, stub: StubAgents, prefix: string, race: string): Promise<void> {
  const store = cp.service.store;
  const events = await readSettledLog(store, cp.service.pool);
  const hosts = foldHosts(events);
  const vms = foldVms(events, race);
  let reserved = 0;
  const holders = new Map<string, string>();
  for (let i = 0; i < HOSTS; i++) {
    const s = hosts.get(`host-${prefix}${i}`);
    if (!s || s.status === 'unregistered') assert.fail(`host ${prefix}${i} is not registered`);
    assert.equal(hostAllocation(s).vm_count, SIZES[i], `host ${prefix}${i} is exactly full`);
    reserved += s.reservations.size;
    for (const vmId of s.reservations.keys()) {
      assert.ok(!holders.has(vmId), `vm ${vmId} reserved twice`);
      holders.set(vmId, `${prefix}${i}`);
    }
  }
  assert.equal(reserved, TOTAL);
  let running = 0;
  let failed = 0;
  for (const [id, vm] of vms) {
    if (vm.status === 'initial') continue;
    if (vm.status === 'running') {
      running++;
      assert.equal(holders.get(id), vm.host_id, `running vm ${id} holds capacity on its own host`);
    } else {
      assert.equal(vm.status, 'failed', `vm ${id} is ${vm.status}`);
      if (vm.status !== 'failed') continue;
      failed++;
      assert.equal(vm.reason, 'error');
      assert.equal(vm.error_code, 'CAPACITY_EXHAUSTED');
      assert.ok(!holders.has(id), `failed vm ${id} holds no capacity`);
    }
  }
  assert.equal(running, TOTAL);
  assert.equal(failed, 500 - TOTAL);
  assert.equal(vms.size, 500);
  // The double's own books agree: nothing was ever refused for lack of room at the "host".
  for (let i = 0; i < HOSTS; i++) {
    const h = stub.hosts.get(`${prefix}${i}`)!;
    assert.equal(h.overCommits, 0);
    assert.equal(h.live.size, SIZES[i]);
  }
}

describe('control plane races (stub agent test double)', { timeout: 240_000 }, () => {
  let stub: StubAgents;
  let cp: ControlPlane;
  const extra: Service[] = [];

  before(async () => {
    stub = await startStubAgents();
    cp = await startControlPlane();
  });
  after(async () => {
    for (const s of extra) await s.close().catch(() => undefined);
    await cp?.close();
    await stub?.close();
  });

  it(`500 concurrent CreateVm on ${HOSTS} hosts that fit ${TOTAL}: exactly ${TOTAL} run, the rest CAPACITY_EXHAUSTED, no host over-committed`, async () => {
    await registerStubHosts([cp.service], stub, 'r');
    const t0 = performance.now();
    const results = await Promise.allSettled(
      Array.from({ length: 500 }, () => cp.service.vms.create(parseVmSpec(SPEC), actorFor('race-1'))),
    );
    const ms = performance.now() - t0;
    process.stdout.write(`# 500 concurrent creates on ${HOSTS} hosts: ${ms.toFixed(0)} ms, ${JSON.stringify(tally(results))}\n`);
    for (const r of results) {
      if (r.status === 'rejected')
        assert.match(
          (r.reason as Error).message,
          /no host fits: 20 hosts: 10 short of CPUs \(need 1, best has 0\), 10 with no VM slot free/,
        );
    }
    assert.deepEqual(tally(results), { 'ok:running': TOTAL, CAPACITY_EXHAUSTED: 500 - TOTAL });
    await verifyFromStreams(cp, stub, 'r', 'race-1');
  });

  it('the same race split over two control-plane processes sharing one event store (the stream is the only guard between them)', async () => {
    // A second service on the same database: its own placement view, host queues and client — like a second replica.
    const second = await startService({
      config: cp.config,
      logger: pino({ level: 'silent' }),
      databaseUrl: cp.db.url,
      tokenEncryptionKey: cp.tokenKey,
      apiKeys: apiKeysFrom(ADMIN_KEY, []),
      defaultMetrics: false,
      httpLogger: false,
    });
    extra.push(second);
    // The r-hosts are full from the first race; cordoned, they leave the s-hosts as the only candidates.
    for (let i = 0; i < HOSTS; i++) await cp.service.hosts.cordon(`r${i}`, 'race 1 done', meta);
    await registerStubHosts([cp.service, second], stub, 's');
    const halves = [cp.service, second];
    const t0 = performance.now();
    const results = await Promise.allSettled(
      Array.from({ length: 500 }, (_, i) => halves[i % 2]!.vms.create(parseVmSpec(SPEC), actorFor('race-2'))),
    );
    const ms = performance.now() - t0;
    process.stdout.write(`# 500 concurrent creates split over 2 processes: ${ms.toFixed(0)} ms, ${JSON.stringify(tally(results))}\n`);
    assert.deepEqual(tally(results), { 'ok:running': TOTAL, CAPACITY_EXHAUSTED: 500 - TOTAL });
    await verifyFromStreams(cp, stub, 's', 'race-2');
  });

  it('concurrent destroys of one VM: one destroy, every caller answered with the destroyed VM', async () => {
    const { url, token } = stub.add('d0', { vm_count: 4 });
    const reg = await cp.service.hosts.register(registerHostRequestSchema.parse({ id: 'd0', url, token, backend: 'process' }), meta);
    await cp.service.runner.waitFor(reg.position!, 30_000);
    const created = await cp.service.vms.create(parseVmSpec({ ...SPEC, host_id: 'd0' }), actorFor('destroy'));
    assert.equal(created.vm.status, 'running');
    const vmId = created.vm.vm_id;
    const destroysBefore = stub.calls.destroys;
    const answers = await Promise.all(Array.from({ length: 12 }, () => cp.request('DELETE', `/v1/vms/${vmId}`, { as: 'acme' })));
    for (const a of answers) {
      assert.equal(a.status, 200, JSON.stringify(a.body));
      assert.equal(a.body.state, 'destroyed');
      assert.equal(a.body.reason, 'client');
    }
    const stream = await cp.service.store.readStream(`vm-${vmId}`);
    assert.equal(stream.filter((e) => e.type === 'VmDestroyRequested').length, 1);
    assert.equal(stream.filter((e) => e.type === 'VmDestroyed').length, 1);
    const host = await cp.service.store.readStream('host-d0');
    assert.equal(host.filter((e) => e.type === 'CapacityReleased').length, 1);
    assert.equal(stub.hosts.get('d0')!.live.size, 0);
    assert.ok(stub.calls.destroys - destroysBefore >= 1);
    // And once more, after the fact: still idempotent.
    const again = await cp.request('DELETE', `/v1/vms/${vmId}`, { as: 'acme' });
    assert.equal(again.status, 200);
    assert.equal(again.body.state, 'destroyed');
  });
});
