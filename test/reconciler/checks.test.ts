import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { pino } from 'pino';
import { configSchema } from '../../src/adapters/config.js';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import { CommandHandler } from '../../src/commands/command-handler.js';
import { decodeHostEvent, hostStream } from '../../src/domain/host/host.aggregate.js';
import { hostDecider } from '../../src/domain/host/host.decider.js';
import { vmStream } from '../../src/domain/vm/vm.aggregate.js';
import { migrationRecorder } from '../support/migration-recorder.js';
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
 * The per-VM and per-host checks, one reconcile cycle at a time (in
 * process, real agents): missing, max runtime, idle, and an agent that
 * hangs (the fault proxy accepts and never answers) — its calls time out,
 * the host is marked unreachable after HOST_UNREACHABLE_AFTER_CYCLES,
 * creates go to the other host, and it is marked reachable when it answers.
 */
const prereq = await skipReason();

describe('reconciler: missing, stuck, idle, hung agent', { skip: prereq, timeout: 300_000 }, () => {
  let images: { imageDir: string } | { skip: string };
  let a: TestAgent | undefined;
  let b: TestAgent | undefined;
  let proxy: AgentFaultProxy | undefined;
  let db: TestDatabase | undefined;
  let svc: Service | undefined;
  const inject = async (method: 'GET' | 'POST' | 'DELETE', url: string, payload?: unknown) => {
    const r = await svc!.app.inject({
      method,
      url,
      headers: { authorization: `Bearer ${ADMIN_KEY}` },
      ...(payload !== undefined ? { payload: payload as object } : {}),
    });
    return { status: r.statusCode, body: r.json() };
  };
  const create = async (spec: Record<string, unknown>): Promise<{ id: string; host_id: string }> => {
    const r = await inject('POST', '/v1/vms', { cpus: 1, ram_mb: 128, ...spec });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    return r.body;
  };
  const reservations = async (host: string): Promise<string[]> => {
    const { state } = await svc!.hosts.load(host);
    return state.status === 'unregistered' ? [] : [...state.reservations.keys()];
  };
  const vmState = (id: string) => svc!.vms.get(id, { tenantId: 'admin', admin: true });

  before(async () => {
    images = await prepareTestImages();
    if ('skip' in images) return;
    a = await startTestAgent(images.imageDir);
    b = await startTestAgent(images.imageDir);
    proxy = await AgentFaultProxy.start(b.url);
    db = await createTestDatabase('rec_checks');
    svc = await startService({
      config: configSchema.parse({
        RECONCILER_ENABLED: 'false',
        HOST_UNREACHABLE_AFTER_CYCLES: '2',
        RECONCILE_AGENT_TIMEOUT_MS: '1000',
        AGENT_CALL_TIMEOUT_MS: '15000',
        READ_YOUR_WRITES_TIMEOUT_MS: '10000',
        ACTIVITY_COALESCE_MS: '200',
        RECONCILE_GRACE_MS: '3000',
      }),
      logger: pino({ level: process.env.FLEET_TEST_LOG ?? 'silent' }),
      databaseUrl: db.url,
      tokenEncryptionKey: Buffer.from(TOKEN_KEY, 'base64'),
      apiKeys: apiKeysFrom(ADMIN_KEY, []),
      defaultMetrics: false,
      httpLogger: false,
    });
    const meta = { correlationId: 't', actor: 'test' };
    // Declared room for a few small sandboxes each: CI machines have 2 cores, and these barely use any.
    const capacity_overrides = { cpus: 8, ram_mb: 4096 };
    await svc.hosts.register(
      registerHostRequestSchema.parse({ id: 'h1', url: a.url, token: a.token, backend: 'process', capacity_overrides }),
      meta,
    );
    await svc.hosts.register(
      registerHostRequestSchema.parse({ id: 'h2', url: proxy.url, token: b.token, backend: 'process', capacity_overrides }),
      meta,
    );
    await waitFor('hosts in the read model', 10_000, async () => (await inject('GET', '/v1/hosts')).body.hosts?.length === 2);
  });

  after(async () => {
    await svc?.close();
    await proxy?.close();
    await a?.dispose();
    await b?.dispose();
    await db?.drop();
  });

  test('a running VM whose sandbox vanished is failed `missing` and its capacity released', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const vm = await create({ host_id: 'h1' });
    await waitFor('running in the read model', 10_000, async () => (await inject('GET', `/v1/vms/${vm.id}`)).body.state === 'running');
    const quiet = await svc!.reconciler.reconcileOnce();
    assert.equal(quiet.vms_missing_provider, 0, 'a healthy VM is left alone');
    assert.equal(quiet.orphans_destroyed, 0);

    await a!.client.destroyVm(`fl-${vm.id}`, { force: true });
    const once = await svc!.reconciler.reconcileOnce();
    assert.equal(once.vms_missing_provider, 0, 'one absent listing is not enough (an agent may still be recovering)');
    const s = await svc!.reconciler.reconcileOnce();
    assert.equal(s.vms_missing_provider, 1);
    assert.equal(s.capacity_released, 1);
    const v = await vmState(vm.id);
    assert.ok(v.status === 'failed' && v.reason === 'host_lost' && v.error_code === 'SANDBOX_MISSING', JSON.stringify(v));
    assert.deepEqual(await reservations('h1'), []);
  });

  test('a VM past its max_runtime_s is failed and destroyed; an idle one past idle_timeout_s is destroyed with reason idle', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    // Limits of 6 s, so that three creates on a loaded machine (a few seconds) still come before any of them expires.
    const LIMIT_S = 6;
    const t0 = Date.now();
    const stuck = await create({ host_id: 'h1', max_runtime_s: LIMIT_S });
    const idle = await create({ host_id: 'h1', idle_timeout_s: LIMIT_S });
    const busy = await create({ host_id: 'h1', idle_timeout_s: LIMIT_S });
    await waitFor('running in the read model', 10_000, async () => (await inject('GET', `/v1/vms/${busy.id}`)).body.state === 'running');
    // Every limit has passed by then: the three were created and running before now.
    const due = Date.now() + LIMIT_S * 1000 + 500;
    const early = await svc!.reconciler.reconcileOnce();
    t.diagnostic(`three creates in ${Date.now() - t0} ms`);
    assert.equal(early.stuck_tasks_failed + early.idle_vms_failed, 0, 'nothing expires early');

    await sleep(due - 3000 - Date.now());
    // Activity keeps `busy` alive (exec is recorded as activity, at most every ACTIVITY_COALESCE_MS).
    const ex = await inject('POST', `/v1/vms/${busy.id}/exec`, { argv: ['true'] });
    assert.equal(ex.status, 200, JSON.stringify(ex.body));
    await waitFor(
      'activity in the read model',
      10_000,
      async () => Date.parse((await inject('GET', `/v1/vms/${busy.id}`)).body.updated_at) > Date.now() - 3000,
    );
    await sleep(due - Date.now());

    const s = await svc!.reconciler.reconcileOnce();
    assert.equal(s.stuck_tasks_failed, 1);
    assert.equal(s.idle_vms_failed, 1);
    const sv = await vmState(stuck.id);
    assert.ok(sv.status === 'failed' && sv.reason === 'timeout' && sv.error_code === 'MAX_RUNTIME_EXCEEDED', JSON.stringify(sv));
    const iv = await vmState(idle.id);
    assert.ok(iv.status === 'destroyed' && iv.reason === 'idle', JSON.stringify(iv));
    assert.equal((await vmState(busy.id)).status, 'running', 'a VM with recent activity is not idle');
    const listed = (await a!.client.listVms('fl-')).map((v) => v.name);
    assert.ok(!listed.includes(`fl-${stuck.id}`) && !listed.includes(`fl-${idle.id}`));
    assert.deepEqual(await reservations('h1'), [busy.id]);
    await inject('DELETE', `/v1/vms/${busy.id}`);
  });

  test('a hung agent: calls time out, the host is marked unreachable, creates go elsewhere, and it recovers when it answers', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const onB = await create({ host_id: 'h2' });
    proxy!.mode = 'hang';
    const t0 = Date.now();
    const first = await svc!.reconciler.reconcileOnce();
    const took = Date.now() - t0;
    t.diagnostic(`a cycle with one hung host took ${took} ms`);
    assert.equal(first.hosts_unanswered, 1);
    assert.equal(first.hosts_marked_unreachable, 0, 'one miss is not enough');
    assert.ok(took < 15_000, 'the hung host bounds the cycle by its call timeout');
    const second = await svc!.reconciler.reconcileOnce();
    assert.equal(second.hosts_marked_unreachable, 1, JSON.stringify(second));
    await waitFor(
      'h2 unreachable in the read model',
      10_000,
      async () => (await inject('GET', '/v1/hosts/h2')).body.state === 'unreachable',
    );

    const placed = [await create({}), await create({})];
    assert.deepEqual(
      placed.map((p) => p.host_id),
      ['h1', 'h1'],
      'placement skips the unreachable host',
    );

    proxy!.mode = 'pass';
    proxy!.release();
    const back = await svc!.reconciler.reconcileOnce();
    assert.equal(back.hosts_recovered, 1);
    await waitFor('h2 active again', 10_000, async () => (await inject('GET', '/v1/hosts/h2')).body.state === 'active');
    assert.equal((await vmState(onB.id)).status, 'running', 'a VM on a host that came back is untouched');
    for (const p of [...placed, onB]) await inject('DELETE', `/v1/vms/${p.id}`);
  });

  test('a declared healthcheck is probed; its verdict is recorded only when it changes, and a failing probe never destroys', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const vm = await create({
      host_id: 'h1',
      healthcheck: { exec: ['test', '-f', '/tmp/ok'], interval_seconds: 1, timeout_seconds: 5, retries: 1 },
    });
    const health = async () => (await inject('GET', `/v1/vms/${vm.id}/health`)).body;
    assert.equal((await health()).state, 'none');
    const cycle = async () => {
      await sleep(1050); // interval_seconds
      return svc!.reconciler.reconcileOnce();
    };
    const s1 = await cycle();
    assert.equal(s1.health_checked, 1);
    assert.equal(s1.health_failing, 1);
    await waitFor('starting', 10_000, async () => (await health()).state === 'starting');
    await inject('POST', `/v1/vms/${vm.id}/exec`, { argv: ['touch', '/tmp/ok'] });
    await cycle();
    await waitFor('healthy', 10_000, async () => (await health()).state === 'healthy');
    await cycle(); // still healthy: nothing recorded
    await inject('POST', `/v1/vms/${vm.id}/exec`, { argv: ['rm', '/tmp/ok'] });
    await cycle(); // 1 failure: within retries, still healthy
    assert.equal((await health()).state, 'healthy');
    const s5 = await cycle(); // 2 failures > retries
    assert.equal(s5.health_failing, 1);
    const h = await waitFor('unhealthy', 10_000, async () => {
      const x = await health();
      return x.state === 'unhealthy' ? x : undefined;
    });
    assert.equal(h.failures, 2);
    assert.match(h.message, /exited 1/);
    const events = await svc!.store.readStream(`vmhealth-${vm.id}`);
    assert.deepEqual(
      events.map((e) => (e.data as { state: string }).state),
      ['starting', 'healthy', 'unhealthy'],
      'one event per change, none per probe',
    );
    assert.equal((await vmState(vm.id)).status, 'running', 'a failing probe reports; it does not destroy');
    await inject('DELETE', `/v1/vms/${vm.id}`);
  });

  test('a migration in flight keeps its target reservation and sandbox; abandoned past the grace, both are collected and the VM runs on', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const vm = await create({ host_id: 'h1' });
    const handler = new CommandHandler(svc!.store);
    const meta = { correlationId: 'migrate', actor: 'test' };
    // What a control plane dying mid-migration leaves: the steps on the VM stream, a reservation and a sandbox on the target.
    await handler.handle(
      vmStream(vm.id),
      migrationRecorder,
      () => undefined,
      { type: 'VmMigrationStarted', data: { vm_id: vm.id, from_host_id: 'h1', live: false } },
      meta,
      { expected: 'any' },
    );
    await handler.handle(
      hostStream('h2'),
      hostDecider,
      decodeHostEvent,
      { type: 'ReserveCapacity', data: { host_id: 'h2', vm_id: vm.id, cpus: 1, ram_mb: 128, storage_gb: 1, gpus: 0 } },
      meta,
    );
    await handler.handle(
      vmStream(vm.id),
      migrationRecorder,
      () => undefined,
      { type: 'VmMigrationStepCompleted', data: { vm_id: vm.id, step: 'place', detail: { host_id: 'h2' } } },
      meta,
      { expected: 'any' },
    );
    await b!.client.createVm({ name: `fl-${vm.id}`, image: 'base' });

    const during = await svc!.reconciler.reconcileOnce();
    assert.equal(during.orphans_destroyed, 0, 'the target sandbox of a live migration is not an orphan');
    assert.equal(during.capacity_released, 0, 'nor is its reservation stale');
    assert.ok((await reservations('h2')).includes(vm.id));

    await sleep(3100); // past RECONCILE_GRACE_MS since the last step
    const after = await svc!.reconciler.reconcileOnce();
    assert.equal(after.orphans_destroyed, 1);
    assert.equal(after.capacity_released, 1);
    assert.ok(!(await reservations('h2')).includes(vm.id));
    assert.ok(!(await b!.client.listVms('fl-')).some((v) => v.name === `fl-${vm.id}`));
    const v = await vmState(vm.id);
    assert.ok(v.status === 'running' && v.host_id === 'h1', 'the VM runs on at its source');
    assert.ok((await reservations('h1')).includes(vm.id));
    await inject('DELETE', `/v1/vms/${vm.id}`);
  });

  test('VMs of a host deregistered by force are failed host_lost', async (t) => {
    if ('skip' in images) return t.skip(images.skip);
    const vm = await create({ host_id: 'h2' });
    const dereg = await inject('DELETE', '/v1/hosts/h2?force=true');
    assert.equal(dereg.status, 200, JSON.stringify(dereg.body));
    await waitFor('h2 deregistered in the read model', 10_000, async () => (await inject('GET', '/v1/hosts')).body.hosts?.length === 1);
    const s = await svc!.reconciler.reconcileOnce();
    assert.equal(s.vms_host_lost, 1);
    const v = await vmState(vm.id);
    assert.ok(v.status === 'failed' && v.reason === 'host_lost', JSON.stringify(v));
    assert.equal((await svc!.reconciler.reconcileOnce()).vms_host_lost, 0, 'once');
  });
});
