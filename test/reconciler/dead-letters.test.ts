import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { pino } from 'pino';
import { configSchema } from '../../src/adapters/config.js';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import { CommandHandler } from '../../src/commands/command-handler.js';
import { decodeHostEvent, hostStream } from '../../src/domain/host/host.aggregate.js';
import { hostDecider } from '../../src/domain/host/host.decider.js';
import { decodeVmEvent, vmStream } from '../../src/domain/vm/vm.aggregate.js';
import { validateVmSpec, DEFAULT_SPEC_LIMITS } from '../../src/domain/vm/spec.js';
import { vmDecider } from '../../src/domain/vm/vm.decider.js';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';
import {
  ADMIN_KEY,
  AgentFaultProxy,
  prepareTestImages,
  skipReason,
  sleep,
  startTestAgent,
  TOKEN_KEY,
  waitFor,
  type TestAgent,
} from './harness.js';
import { registerHostRequestSchema } from '../../src/commands/host/host-commands.js';

/**
 * Dead letters end to end, in process (the reconciler driven one cycle at a
 * time, so the count of attempts is exact) against a real agent behind the
 * fault proxy: a destroy that always fails is dead-lettered after
 * ORPHAN_DESTROY_MAX_RETRIES, then skipped; an operator retry succeeds once
 * the fault is gone; a discard is never touched again. Plus the crash
 * window no process kill can hit reliably: a VM left `requested` with a
 * reservation already on its host stream.
 */
const prereq = await skipReason();

describe('reconciler: dead letters and abandoned requests', { skip: prereq, timeout: 240_000 }, () => {
  let images: { imageDir: string } | { skip: string };
  let agent: TestAgent | undefined;
  let proxy: AgentFaultProxy | undefined;
  let db: TestDatabase | undefined;
  let svc: Service | undefined;
  const admin = { authorization: `Bearer ${ADMIN_KEY}` };
  const inject = async (method: 'GET' | 'POST', url: string, payload?: unknown) => {
    const r = await svc!.app.inject({ method, url, headers: admin, ...(payload !== undefined ? { payload: payload as object } : {}) });
    return { status: r.statusCode, body: r.headers['content-type']?.toString().includes('json') ? r.json() : r.body };
  };

  before(async () => {
    images = await prepareTestImages();
    if ('skip' in images) return;
    agent = await startTestAgent(images.imageDir);
    proxy = await AgentFaultProxy.start(agent.url);
    db = await createTestDatabase('rec_dl');
    svc = await startService({
      config: configSchema.parse({
        RECONCILER_ENABLED: 'false',
        ORPHAN_DESTROY_MAX_RETRIES: '3',
        RECONCILE_AGENT_TIMEOUT_MS: '3000',
        RECONCILE_GRACE_MS: '2000',
        AGENT_CALL_TIMEOUT_MS: '5000',
      }),
      logger: pino({ level: process.env.FLEET_TEST_LOG ?? 'silent' }),
      databaseUrl: db.url,
      tokenEncryptionKey: Buffer.from(TOKEN_KEY, 'base64'),
      apiKeys: apiKeysFrom(ADMIN_KEY, []),
      defaultMetrics: false,
      httpLogger: false,
    });
    await svc.hosts.register(registerHostRequestSchema.parse({ id: 'h1', url: proxy.url, token: agent.token, backend: 'process' }), {
      correlationId: 't',
      actor: 'test',
    });
  });

  after(async () => {
    await svc?.close();
    await proxy?.close();
    await agent?.dispose();
    await db?.drop();
  });

  test('a destroy that always fails is dead-lettered after the configured retries, skipped, and an operator retry resolves it', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const r = svc!.reconciler;
    await agent!.client.createVm({ name: 'fl-orphan-a', image: 'base' });
    await agent!.client.createVm({ name: 'fl-orphan-b', image: 'base' });
    await agent!.client.createVm({ name: 'other-sandbox', image: 'base' });
    proxy!.mode = 'fail-destroy';

    for (let i = 1; i <= 3; i++) {
      const s = await r.reconcileOnce();
      assert.equal(s.orphans_failed, 2, `cycle ${i}: both orphans fail`);
      assert.equal(s.orphans_dead_lettered, i === 3 ? 2 : 0, `cycle ${i}: dead-lettered only at the 3rd consecutive failure`);
    }
    const seen = proxy!.destroysSeen;
    const s4 = await r.reconcileOnce();
    assert.equal(s4.orphans_skipped, 2);
    assert.equal(s4.orphans_failed, 0);
    assert.equal(proxy!.destroysSeen, seen, 'a dead letter is not retried by the reconciler');

    const list = await waitFor('dead letters in the read model', 10_000, async () => {
      const res = await inject('GET', '/v1/dead-letters?state=open');
      return res.body.dead_letters?.length === 2 ? res.body.dead_letters : undefined;
    });
    const a = list.find((d: any) => d.entity_id === 'fl-orphan-a');
    const b = list.find((d: any) => d.entity_id === 'fl-orphan-b');
    assert.ok(a && b);
    assert.equal(a.kind, 'orphan_destroy');
    assert.equal(a.host_id, 'h1');
    assert.equal(a.retry_count, 3);
    assert.match(a.reason, /500|fails on purpose|AGENT_ERROR|answered/i);
    assert.equal((await svc!.app.inject({ method: 'GET', url: '/v1/dead-letters' })).statusCode, 401, 'admins only');

    const metrics = (await svc!.app.inject({ method: 'GET', url: '/metrics' })).body;
    assert.match(metrics, /fleet_dead_letters\{state="open",kind="orphan_destroy"\} 2/);
    assert.match(metrics, /fleet_reconcile_actions_total\{kind="orphans_dead_lettered"\} 2/);
    assert.match(metrics, /fleet_reconcile_cycles_total 4/);

    // Retry while the fault is still there: reported, stays retrying.
    const stillFailing = await inject('POST', `/v1/dead-letters/${a.id}/retry`);
    assert.equal(stillFailing.status, 200);
    assert.equal(stillFailing.body.state, 'retrying');
    assert.equal(stillFailing.body.error.code, 'AGENT_ERROR');

    // Discard b: the operator takes it over; the reconciler never touches it again.
    const discarded = await inject('POST', `/v1/dead-letters/${b.id}/discard`, { note: 'handled by hand' });
    assert.equal(discarded.body.state, 'discarded');

    proxy!.mode = 'pass';
    const ok = await inject('POST', `/v1/dead-letters/${a.id}/retry`);
    assert.equal(ok.status, 200);
    assert.equal(ok.body.state, 'resolved');
    const names = (await agent!.client.listVms('')).map((v) => v.name).sort();
    assert.deepEqual(names, ['fl-orphan-b', 'other-sandbox'], 'the retried orphan is gone; the discarded one and a foreign sandbox stay');

    const before5 = proxy!.destroysSeen;
    const s5 = await r.reconcileOnce();
    assert.equal(s5.orphans_skipped, 1);
    assert.equal(proxy!.destroysSeen, before5, 'the discarded orphan is left alone');
    assert.equal((await inject('POST', `/v1/dead-letters/${a.id}/retry`)).status, 409, 'a resolved dead letter cannot be retried');
    assert.equal((await inject('POST', '/v1/dead-letters/nosuchletter/retry')).status, 404);
    await agent!.client.destroyVm('fl-orphan-b', { force: true });
    await agent!.client.destroyVm('other-sandbox', { force: true });
  });

  test('a VM left requested with a reservation on its host (crash between reserve and place) is failed and its capacity released', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const handler = new CommandHandler(svc!.store);
    const meta = { correlationId: 'crashed', actor: 'test' };
    const vmId = 'abandoned0000000000000001';
    const spec = validateVmSpec({ cpus: 1, ram_mb: 256 }, DEFAULT_SPEC_LIMITS);
    await handler.handle(
      vmStream(vmId),
      vmDecider,
      decodeVmEvent,
      { type: 'RequestVm', data: { vm_id: vmId, spec, tenant_id: 'acme' } },
      meta,
    );
    await handler.handle(
      hostStream('h1'),
      hostDecider,
      decodeHostEvent,
      { type: 'ReserveCapacity', data: { host_id: 'h1', vm_id: vmId, cpus: 1, ram_mb: 256, storage_gb: 1, gpus: 0 } },
      meta,
    );
    const held = await svc!.hosts.load('h1');
    assert.ok(held.state.status !== 'unregistered' && held.state.reservations.has(vmId));

    await waitFor(
      'the read model lists the requested VM',
      10_000,
      async () => (await inject('GET', `/v1/vms/${vmId}`)).body.state === 'requested',
    );
    await sleep(2100); // past RECONCILE_GRACE_MS
    const s = await svc!.reconciler.reconcileOnce();
    assert.equal(s.half_done_rolled_back, 1);
    assert.equal(s.capacity_released, 1);
    const vm = await svc!.vms.get(vmId, { tenantId: 'admin', admin: true });
    assert.equal(vm.status, 'failed');
    assert.ok(vm.status === 'failed' && vm.reason === 'orphaned' && vm.error_code === 'INTERRUPTED' && vm.phase === 'requested');
    const host = await svc!.hosts.load('h1');
    assert.ok(host.state.status !== 'unregistered' && host.state.reservations.size === 0, 'no capacity held for the abandoned VM');
  });

  test('a VM left placed (crash after placement, before the boot started) is rolled back, its reservation released', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const handler = new CommandHandler(svc!.store);
    const meta = { correlationId: 'crashed', actor: 'test' };
    const vmId = 'abandoned0000000000000002';
    const spec = validateVmSpec({ cpus: 1, ram_mb: 256 }, DEFAULT_SPEC_LIMITS);
    await handler.handle(
      vmStream(vmId),
      vmDecider,
      decodeVmEvent,
      { type: 'RequestVm', data: { vm_id: vmId, spec, tenant_id: 'acme' } },
      meta,
    );
    const reserved = await handler.handle(
      hostStream('h1'),
      hostDecider,
      decodeHostEvent,
      { type: 'ReserveCapacity', data: { host_id: 'h1', vm_id: vmId, cpus: 1, ram_mb: 256, storage_gb: 1, gpus: 0 } },
      meta,
    );
    const held = reserved.state;
    if (held.status === 'unregistered') throw new Error('host h1 not registered');
    const { vm_id: _v, ...reservation } = held.reservations.get(vmId)!;
    const decision = {
      host_id: 'h1',
      policy: 'spread' as const,
      candidates: 1,
      headroom_cpus: 0,
      headroom_ram: 0,
      artifact_local: false,
      artifact_holders: 0,
    };
    await handler.handle(
      vmStream(vmId),
      vmDecider,
      decodeVmEvent,
      { type: 'PlaceVm', data: { vm_id: vmId, host_id: 'h1', decision, reservation } },
      meta,
    );
    const placedAt = Date.now();

    await waitFor(
      'the read model lists the placed VM',
      10_000,
      async () => (await inject('GET', `/v1/vms/${vmId}`)).body.state === 'placed',
    );
    if (Date.now() - placedAt < 1500) {
      const early = await svc!.reconciler.reconcileOnce();
      assert.equal(early.half_done_rolled_back, 0, 'inside the grace a live create is left alone');
      assert.equal(early.capacity_released, 0);
    }
    await sleep(Math.max(0, placedAt + 2100 - Date.now()));
    const s = await svc!.reconciler.reconcileOnce();
    assert.equal(s.half_done_rolled_back, 1);
    assert.equal(s.capacity_released, 1);
    const vm = await svc!.vms.get(vmId, { tenantId: 'admin', admin: true });
    assert.ok(
      vm.status === 'failed' && vm.reason === 'orphaned' && vm.error_code === 'INTERRUPTED' && vm.phase === 'placed',
      JSON.stringify(vm),
    );
    assert.match(vm.status === 'failed' ? vm.error : '', /capacity was reserved but the boot had not started/);
    const host = await svc!.hosts.load('h1');
    assert.ok(host.state.status !== 'unregistered' && host.state.reservations.size === 0);
  });
});
