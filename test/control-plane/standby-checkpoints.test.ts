import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { after, before, describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import { decodeStandbyEvent } from '../../src/domain/standby/standby.aggregate.js';
import type { StandbyEvent } from '../../src/domain/standby/standby.events.js';
import type { RunningAgent } from '../agent/harness.js';
import {
  ADMIN_KEY,
  prepareAgents,
  registerHost,
  startCheckedAgent,
  startControlPlane,
  TENANT_KEYS,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * Standby checkpoints (CHECKPOINT_INTERVAL_MS) with three real agents, all
 * with CRIU (CRIU_PATH): the copy lands on another host, only the latest is
 * kept, two replicas ticking at once take one checkpoint, and a live migrate
 * to the standby moves fewer bytes than one to a host without the copy. The
 * ticks are called directly (the timer runs them on the lease holder).
 */

const criu = process.env.CRIU_PATH;
const noCriu = !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0 ? 'a working CRIU at CRIU_PATH' : undefined;
if (noCriu && process.env.CI === 'true') it('CRIU is available in CI', () => assert.fail(`missing: ${noCriu}`));

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

const MIB = 1024 * 1024;
const INTERVAL_MS = 1500;
// A 16 MiB file in the VM's layer that never changes after boot; the counter lives in /dev (a tmpfs: memory, not the layer).
const STARTUP =
  'dd if=/dev/urandom of=/blob bs=1M count=16 2>/dev/null\n' +
  'echo 0 > /dev/count; (i=0; while true; do i=$((i+1)); echo $i > /dev/count.new; mv /dev/count.new /dev/count; sleep 0.05; done) >/dev/null 2>&1 &\n';

describe('standby checkpoints and a live migrate to the standby (real agents with CRIU)', { timeout: 400_000 }, () => {
  let skip: string | undefined = noCriu;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let second: Service | undefined;
  const agents: RunningAgent[] = [];
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    if (skip) return;
    const f = await prepareAgents();
    if ('skip' in f) {
      skip = f.skip;
      return;
    }
    fleet = f;
    for (let i = 0; i < 3; i++) {
      const a = await startCheckedAgent(f, {});
      if ('skip' in a) {
        skip = a.skip;
        return;
      }
      agents.push(a);
    }
    cp = await startControlPlane({
      env: {
        RECONCILER_ENABLED: 'false',
        EXEC_DEFAULT_TIMEOUT_MS: '20000',
        CHECKPOINT_INTERVAL_MS: String(INTERVAL_MS),
        SNAPSHOT_QUOTA_MAX_COUNT: '1',
      },
    });
    for (const [i, a] of agents.entries()) ok(await registerHost(cp, `h${i + 1}`, a), 201);
    // A second replica on the same database: its own handlers, placement view and agent clients.
    second = await startService({
      config: cp.config,
      logger: pino({ level: 'silent' }),
      databaseUrl: cp.db.url,
      tokenEncryptionKey: cp.tokenKey,
      apiKeys: apiKeysFrom(
        ADMIN_KEY,
        Object.entries(TENANT_KEYS).map(([tenant, key]) => ({ tenant, key })),
      ),
      defaultMetrics: false,
      httpLogger: false,
    });
  });

  after(async () => {
    await second?.close();
    await cp?.close();
    await fleet?.close();
  });

  const count = async (vm: string): Promise<number> => {
    const r = ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['cat', '/dev/count'] } }));
    return Number(r.stdout);
  };
  const advances = async (vm: string): Promise<number> => {
    const a = await count(vm);
    await new Promise((r) => setTimeout(r, 400));
    const b = await count(vm);
    assert.ok(b > a, `the counter of ${vm} runs: ${a} -> ${b}`);
    return a;
  };
  const start = async (): Promise<string> => {
    const vm = ok(
      await cp!.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: 1, ram_mb: 128, startup_script: STARTUP } }),
      201,
    );
    await advances(vm.id);
    return vm.id as string;
  };
  const destroy = async (vm: string): Promise<void> => {
    ok(await cp!.request('DELETE', `/v1/vms/${vm}`, { as: 'acme' }));
    await cp!.service.runner.waitFor((await cp!.service.store.readStream(`vm-${vm}`)).at(-1)!.position, 30_000);
  };
  const standbyEvents = async (vmId: string): Promise<StandbyEvent[]> =>
    (await cp!.service.store.readStream(`vmstandby-${vmId}`)).map((r) => {
      const e = decodeStandbyEvent(r);
      assert.ok(e, `${r.type} parses back`);
      return e;
    });
  const standbyOn = async (i: number): Promise<string[]> =>
    (await agents[i]!.client.listCheckpoints()).map((c) => c.id).filter((id) => id.startsWith('standby-'));
  const moveStep = async (vmId: string): Promise<Record<string, string>> => {
    const events = await cp!.service.store.readStream(`vm-${vmId}`);
    const moves = events.filter((e) => e.type === 'VmMigrationStepCompleted' && (e.data as { step: string }).step === 'move');
    return (moves.at(-1)!.data as { detail: Record<string, string> }).detail;
  };

  it('two replicas tick at once: one checkpoint, kept on another host only; the next supersedes it and reuses the unchanged layer; not a snapshot of the tenant', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = await start();
    const [a, b] = await Promise.all([c.service.standby.tick(), second!.standby.tick()]);
    assert.deepEqual([...a, ...b], [vm], 'exactly one of the two replicas checkpointed the VM');
    let events = await standbyEvents(vm);
    assert.deepEqual(
      events.map((e) => e.type),
      ['StandbyCheckpointStarted', 'StandbyCheckpointTaken'],
    );
    const first = events[1] as Extract<StandbyEvent, { type: 'StandbyCheckpointTaken' }>;
    assert.equal(first.data.host_id, 'h1');
    assert.equal(first.data.standby_host_id, 'h2');
    assert.ok(first.data.moved_bytes > 16 * MIB, `the first copy moves everything: ${first.data.moved_bytes}`);
    assert.equal(first.data.reused_bytes, 0);
    assert.deepEqual(await standbyOn(1), [first.data.checkpoint_id], 'the copy is on the standby');
    assert.deepEqual(await standbyOn(0), [], "the VM's host keeps none");
    await advances(vm);

    await new Promise((r) => setTimeout(r, INTERVAL_MS + 100));
    assert.deepEqual(await second!.standby.tick(), [vm]);
    events = await standbyEvents(vm);
    const next = events.at(-1) as Extract<StandbyEvent, { type: 'StandbyCheckpointTaken' }>;
    assert.equal(next.type, 'StandbyCheckpointTaken');
    assert.equal(next.data.supersedes?.checkpoint_id, first.data.checkpoint_id);
    t.diagnostic(`standby tick 2: moved ${next.data.moved_bytes} B, reused ${next.data.reused_bytes} B, paused ${next.data.pause_ms} ms`);
    assert.ok(next.data.reused_bytes >= 15 * MIB, `the unchanged layer is taken from the previous copy: ${next.data.reused_bytes}`);
    assert.ok(next.data.moved_bytes < first.data.moved_bytes - 15 * MIB, `and not moved again: ${next.data.moved_bytes}`);
    assert.deepEqual(await standbyOn(1), [next.data.checkpoint_id], 'only the latest copy is kept');
    await advances(vm);

    // Not the tenant's snapshots, not its quota (SNAPSHOT_QUOTA_MAX_COUNT=1 here).
    assert.deepEqual(ok(await c.request('GET', '/v1/snapshots', { as: 'acme' })).snapshots ?? [], []);
    const snap = ok(await c.request('POST', `/v1/vms/${vm}/snapshots`, { as: 'acme', body: {} }), 201);
    ok(await c.request('DELETE', `/v1/snapshots/${snap.id}`, { as: 'acme' }));

    // Destroyed: the next tick records the copy dropped and removes it.
    await destroy(vm);
    await c.service.standby.tick();
    const dropped = (await standbyEvents(vm)).at(-1)!;
    assert.equal(dropped.type, 'StandbyCheckpointDropped');
    assert.equal(dropped.type === 'StandbyCheckpointDropped' && dropped.data.reason, 'vm_gone');
    for (const i of [0, 1, 2]) assert.deepEqual(await standbyOn(i), [], `no standby copy left on h${i + 1}`);
  });

  it('a live migrate with no target goes to the standby and moves only memory; the same move to a host without the copy moves the layer too', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const withCopy = await start();
    const without = await start();
    assert.deepEqual((await c.service.standby.tick()).sort(), [withCopy, without].sort());
    assert.equal((await c.service.standby.load(without)).current?.standby_host_id, 'h2');

    const m1 = ok(await c.request('POST', `/v1/vms/${withCopy}/migrate`, { as: 'acme', body: { live: true } }));
    assert.equal(m1.host_id, 'h2', 'no target given: the standby');
    const d1 = await moveStep(withCopy);
    const m2 = ok(await c.request('POST', `/v1/vms/${without}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h3' } }));
    assert.equal(m2.host_id, 'h3');
    const d2 = await moveStep(without);
    t.diagnostic(`with the standby copy: moved ${d1.moved_bytes} B, reused ${d1.reused_bytes} B, downtime ${m1.downtime_ms} ms`);
    t.diagnostic(`without: moved ${d2.moved_bytes} B, reused ${d2.reused_bytes} B, downtime ${m2.downtime_ms} ms`);
    assert.ok(d1.standby_checkpoint_id?.startsWith('standby-'));
    assert.equal(d2.standby_checkpoint_id, undefined);
    assert.equal(Number(d2.reused_bytes), 0);
    assert.ok(Number(d1.reused_bytes) >= 15 * MIB, `the layer came from the standby copy: ${d1.reused_bytes}`);
    assert.ok(
      Number(d1.moved_bytes) < Number(d2.moved_bytes) - 15 * MIB,
      `moved with the copy ${d1.moved_bytes} vs without ${d2.moved_bytes}`,
    );
    await advances(withCopy);
    await advances(without);

    // The copy on h2 now sits on the VM's own host: the next tick puts a new one elsewhere and removes it.
    await new Promise((r) => setTimeout(r, INTERVAL_MS + 100));
    await c.service.standby.tick();
    const s = await c.service.standby.load(withCopy);
    assert.ok(s.current && s.current.standby_host_id !== 'h2', `a new standby: ${s.current?.standby_host_id}`);
    assert.ok(!(await standbyOn(1)).some((id) => id.startsWith(`standby-${withCopy}-`)), 'the used copy is gone from h2');
    for (const vm of [withCopy, without]) await destroy(vm);
    await c.service.standby.tick();
    for (const i of [0, 1, 2]) assert.deepEqual(await standbyOn(i), [], `no standby copy left on h${i + 1}`);
  });
});
