import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { after, before, describe, it, type TestContext } from 'node:test';
import type { RunningAgent } from '../agent/harness.js';
import {
  problemOf,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * Pause and resume through the API, with a real agent whose CRIU comes from
 * CRIU_PATH (a missing CRIU fails under CI=true, skips elsewhere).
 */

const criu = process.env.CRIU_PATH;
const noCriu = !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0 ? 'a working CRIU at CRIU_PATH' : undefined;
if (noCriu && process.env.CI === 'true') it('CRIU is available in CI', () => assert.fail(`missing: ${noCriu}`));

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

const STARTUP =
  'echo 0 > /tmp/count; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 &\n' +
  '(while true; do echo -e "HTTP/1.0 200 OK\\r\\n\\r\\ncount $(cat /tmp/count)" | nc -l -p 8080; done) >/dev/null 2>&1 &\n';

describe('pause and resume through the API (a real agent with CRIU)', { timeout: 300_000 }, () => {
  let skip: string | undefined = noCriu;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  const agents: RunningAgent[] = [];
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    if (skip) return;
    const started = await startCheckedFleet(1);
    ({ fleet, skip } = started);
    agents.push(...started.agents);
    if (skip) return;
    cp = await startControlPlane({ env: { RECONCILER_ENABLED: 'false', EXEC_DEFAULT_TIMEOUT_MS: '20000' } });
    ok(await registerHost(cp, 'h1', agents[0]!), 201);
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  const count = async (vm: string): Promise<number> => {
    const r = ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['cat', '/tmp/count'] } }));
    return Number(r.stdout);
  };

  it('a counter keeps counting across pauses and resumes; the VM keeps its id and endpoint; the reservation is released while paused', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(
      await c.request('POST', '/v1/vms', {
        as: 'acme',
        body: { host_id: 'h1', cpus: 1, ram_mb: 256, startup_script: STARTUP, expose: [{ port: 8080, as: 'http' }] },
      }),
      201,
    );
    const url = (vm.endpoints as Array<{ url: string }>)[0]!.url;
    await new Promise((r) => setTimeout(r, 300));
    let last = await count(vm.id);
    for (let i = 0; i < 3; i++) {
      const paused = ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' }));
      assert.equal(paused.state, 'paused');
      assert.equal(ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' })).state, 'paused', 'a second pause is a no-op');
      const { state: host } = await c.service.hosts.load('h1');
      assert.ok(host.status !== 'unregistered' && !host.reservations.has(vm.id), 'no CPU or memory held while paused');
      const resumed = ok(await c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' }));
      assert.equal(resumed.state, 'running');
      assert.equal(resumed.id, vm.id);
      assert.equal(resumed.endpoints[0].url, url, 'the endpoint stays');
      const now = await count(vm.id);
      assert.ok(now >= last && now < last + 200, `counter continued: ${last} -> ${now}`);
      assert.match(await fetch(url, { signal: AbortSignal.timeout(5000) }).then((r) => r.text()), /^count \d+/);
      last = now;
    }
    const events = (await c.service.store.readStream(`vm-${vm.id}`)).map((e) => e.type);
    assert.equal(events.filter((e) => e === 'VmPaused').length, 3);
    assert.equal(events.filter((e) => e === 'VmResumed').length, 3);
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  it('concurrent resumes: exactly one restores, all answer running', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(
      await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: 1, ram_mb: 128, startup_script: STARTUP } }),
      201,
    );
    ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' }));
    const replies = await Promise.all([1, 2, 3].map(() => c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' })));
    for (const r of replies) assert.equal(ok(r).state, 'running');
    const events = (await c.service.store.readStream(`vm-${vm.id}`)).map((e) => e.type);
    assert.equal(events.filter((e) => e === 'VmResumed').length, 1);
    assert.ok((await count(vm.id)) > 0);
    // A VM that is not paused cannot be resumed into anything else, and a destroyed one cannot be paused.
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
    const r = await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' });
    assert.equal(r.status, 409, JSON.stringify(r.body));
    assert.equal(problemOf(r).code, 'VM_NOT_RUNNING');
  });

  it('a live snapshot leaves the VM running (kind live, pause window recorded); restore puts files and processes back to it', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(
      await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: 1, ram_mb: 128, startup_script: STARTUP } }),
      201,
    );
    await new Promise((r) => setTimeout(r, 300));
    const snap = ok(await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'acme', body: { live: true } }), 201);
    assert.equal(snap.kind, 'live', 'the agent wrote memory');
    const taken = (await c.service.store.readStream(`snapshot-${snap.id}`)).find((e) => e.type === 'SnapshotTaken')!;
    assert.ok(((taken.data as { pause_ms?: number }).pause_ms ?? 0) > 0, 'the pause window is in the event');
    const atSnapshot = await count(vm.id);
    ok(await c.request('POST', `/v1/vms/${vm.id}/exec`, { as: 'acme', body: { argv: ['sh', '-c', 'echo later > /root/later'] } }));
    await new Promise((r) => setTimeout(r, 500));
    const restored = ok(await c.request('POST', `/v1/vms/${vm.id}/restore`, { as: 'acme', body: { snapshot_id: snap.id } }));
    assert.equal(restored.state, 'running');
    const gone = ok(await c.request('POST', `/v1/vms/${vm.id}/exec`, { as: 'acme', body: { argv: ['cat', '/root/later'] } }));
    assert.notEqual(gone.exit_code, 0, 'a file written after the snapshot is gone');
    const now = await count(vm.id);
    assert.ok(now < atSnapshot + 100, `the counter went back to the snapshot (${atSnapshot}), got ${now}`);
    const diff = await c.request('POST', `/v1/vms/${vm.id}/snapshots`, { as: 'acme', body: { live: true, diff: true } });
    assert.equal(diff.status, 409, JSON.stringify(diff.body));
    assert.equal(problemOf(diff).code, 'MEMORY_DIFF_UNSUPPORTED');
    const bad = await c.request('POST', `/v1/vms/${vm.id}/restore`, { as: 'acme', body: { snapshot_id: 'snap-nope' } });
    assert.equal(bad.status, 404, JSON.stringify(bad.body));
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  it('a paused VM can be destroyed, and nothing of it stays on the host', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: 1, ram_mb: 128 } }), 201);
    ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' }));
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
    const left = await agents[0]!.client.listVms();
    assert.ok(!left.some((v) => v.name.endsWith(vm.id)), JSON.stringify(left));
    assert.ok(!(await agents[0]!.client.listCheckpoints()).some((cpt) => cpt.id === `pause-${vm.id}`));
  });
});
