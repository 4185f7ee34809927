import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { after, before, describe, it, type TestContext } from 'node:test';
import type { RunningAgent } from '../agent/harness.js';
import {
  eventually,
  prepareAgents,
  problemOf,
  registerHost,
  startCheckedAgent,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * Fork ×N and live migration through the API, with real agents: h1 and h2
 * have CRIU (CRIU_PATH), h3 has none. A missing CRIU fails under CI=true,
 * skips elsewhere.
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

describe('fork ×N and live migration through the API (real agents with CRIU)', { timeout: 400_000 }, () => {
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
    const f = await prepareAgents();
    if ('skip' in f) {
      skip = f.skip;
      return;
    }
    fleet = f;
    const envs: Array<Record<string, string>> = [{}, {}, { CRIU_PATH: '/nonexistent/criu' }];
    for (const env of envs) {
      const a = await startCheckedAgent(f, { env });
      if ('skip' in a) {
        skip = a.skip;
        return;
      }
      agents.push(a);
    }
    cp = await startControlPlane({ env: { RECONCILER_ENABLED: 'false', EXEC_DEFAULT_TIMEOUT_MS: '20000', ACTIVITY_COALESCE_MS: '100' } });
    for (const [i, a] of agents.entries()) ok(await registerHost(cp, `h${i + 1}`, a), 201);
    const { state: h3 } = await cp.service.hosts.load('h3');
    assert.ok(h3.status !== 'unregistered' && h3.capacity.live_snapshot !== true, 'h3 has no CRIU');
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  const count = async (vm: string): Promise<number> => {
    const r = ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['cat', '/tmp/count'] } }));
    return Number(r.stdout);
  };
  const advances = async (vm: string): Promise<number> => {
    const a = await count(vm);
    await new Promise((r) => setTimeout(r, 400));
    const b = await count(vm);
    assert.ok(b > a, `the counter of ${vm} runs: ${a} -> ${b}`);
    return a;
  };
  const answers = async (url: string): Promise<void> => {
    assert.match(await fetch(url, { signal: AbortSignal.timeout(5000) }).then((r) => r.text()), /^count \d+/);
  };
  const start = async (): Promise<{ id: string; url: string }> => {
    const vm = ok(
      await cp!.request('POST', '/v1/vms', {
        as: 'acme',
        body: { host_id: 'h1', cpus: 1, ram_mb: 128, startup_script: STARTUP, expose: [{ port: 8080, as: 'http' }] },
      }),
      201,
    );
    await new Promise((r) => setTimeout(r, 300));
    return { id: vm.id, url: (vm.endpoints as Array<{ url: string }>)[0]!.url };
  };

  it('fork ×3: one live capture, three new VMs continuing its processes independently, each serving; none on the host without CRIU', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const src = await start();
    const before = await count(src.id);
    const r = await c.request('POST', `/v1/vms/${src.id}/fork`, { as: 'acme', body: { count: 3 } });
    const body = ok(r, 201);
    assert.equal(body.kind, 'live');
    assert.equal(body.forks.length, 3);
    const forks = (body.forks as Array<{ vm: { id: string; host_id: string; state: string; endpoints: Array<{ url: string }> } }>).map(
      (f) => f.vm,
    );
    assert.equal(new Set([src.id, ...forks.map((f) => f.id)]).size, 4, 'fresh ids');
    const source = ok(await c.request('GET', `/v1/vms/${src.id}`, { as: 'acme' }));
    const atCapture: number[] = [];
    for (const f of forks) {
      assert.equal(f.state, 'running');
      assert.notEqual(f.host_id, 'h3', 'a live capture is never restored on a host without CRIU');
      const from = await advances(f.id);
      assert.ok(from >= before, `fork ${f.id} continued from the capture (>= ${before}), not from 0: ${from}`);
      atCapture.push(from);
      await answers(f.endpoints[0]!.url);
    }
    assert.equal(new Set(forks.map((f) => f.endpoints[0]!.url)).size, 3, 'each fork has its own endpoint');
    // Independent: stopping the counter in one fork leaves the others (and the source) counting.
    ok(
      await c.request('POST', `/v1/vms/${forks[0]!.id}/exec`, {
        as: 'acme',
        body: { argv: ['sh', '-c', 'kill -STOP -1 2>/dev/null; true'] },
      }),
    );
    for (const f of forks.slice(1)) await advances(f.id);
    await advances(src.id);
    await answers(source.endpoints[0].url);
    for (const f of forks) ok(await c.request('DELETE', `/v1/vms/${f.id}`, { as: 'acme' }));
    // reuse_snapshot_id takes the live capture again: one more fork from the same instant.
    const again = ok(
      await c.request('POST', `/v1/vms/${src.id}/fork`, { as: 'acme', body: { count: 1, reuse_snapshot_id: body.seed_snapshot_id } }),
      201,
    );
    assert.equal(again.kind, 'live');
    const from = await advances(again.forks[0].vm.id);
    assert.ok(from >= before && from < Math.max(...atCapture) + 200, `the reused capture resumes the same instant: ${from}`);
    ok(await c.request('DELETE', `/v1/vms/${again.forks[0].vm.id}`, { as: 'acme' }));
    ok(await c.request('DELETE', `/v1/vms/${src.id}`, { as: 'acme' }));

    const bad = await c.request('POST', `/v1/vms/${src.id}/fork`, { as: 'acme', body: { count: 101 } });
    assert.equal(bad.status, 400, JSON.stringify(bad.body));
  });

  it('live migrate h1 -> h2: the counter keeps counting, same id, served again, downtime recorded; refused to a host without CRIU before anything freezes', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = await start();
    const before = await count(vm.id);
    const m = ok(await c.request('POST', `/v1/vms/${vm.id}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h2' } }));
    assert.equal(m.id, vm.id);
    assert.equal(m.host_id, 'h2');
    assert.equal(m.from_host_id, 'h1');
    assert.equal(typeof m.downtime_ms, 'number');
    assert.equal(typeof m.readdressed, 'boolean');
    t.diagnostic(`live migrate downtime ${m.downtime_ms} ms, readdressed ${m.readdressed}`);
    const from = await advances(vm.id);
    assert.ok(from >= before && from < before + 400, `counter continued across the move: ${before} -> ${from}`);
    await answers(m.endpoints[0].url);
    const events = await c.service.store.readStream(`vm-${vm.id}`);
    for (const e of events.filter((x) => x.type.startsWith('VmMigration'))) t.diagnostic(`${e.type} ${JSON.stringify(e.data)}`);
    const boot = events.find((e) => e.type === 'VmMigrationStepCompleted' && (e.data as { step: string }).step === 'boot');
    assert.ok(boot && typeof (boot.data as { downtime_ms?: number }).downtime_ms === 'number', 'downtime on the boot step');
    assert.ok(events.some((e) => e.type === 'VmMigrated'));
    assert.ok(!(await c.service.hosts.load('h1').then(({ state }) => state.status !== 'unregistered' && state.reservations.has(vm.id))));

    const n = events.length;
    const refused = await c.request('POST', `/v1/vms/${vm.id}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h3' } });
    assert.equal(refused.status, 409, JSON.stringify(refused.body));
    assert.equal(problemOf(refused).code, 'LIVE_MIGRATION_TARGET_UNSUPPORTED');
    assert.equal((await c.service.store.readStream(`vm-${vm.id}`)).length, n, 'nothing recorded: no migration started');
    const still = ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' }));
    assert.equal(still.host_id, 'h2');
    await advances(vm.id);
    // And back: h2 -> (placement) h1, the only other host that can restore it.
    const back = ok(await c.request('POST', `/v1/vms/${vm.id}/migrate`, { as: 'acme', body: { live: true } }));
    assert.equal(back.host_id, 'h1');
    await advances(vm.id);
    await answers(back.endpoints[0].url);
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  it('resume when the origin is full: the checkpoint moves and the VM resumes on another host; of concurrent resumes exactly one restores', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = await start();
    ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' }));
    const paused = await count(vm.id).catch(() => undefined);
    assert.equal(paused, undefined, 'a paused VM runs nothing');
    // Fill h1's CPUs with another VM: the paused one no longer fits on its origin.
    const { state: h1 } = await c.service.hosts.load('h1');
    assert.ok(h1.status !== 'unregistered');
    let used = 0;
    for (const r of h1.reservations.values()) used += r.cpus;
    const free = Math.floor(h1.capacity.cpus * h1.cpu_overcommit_ratio) - used;
    const filler = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: free, ram_mb: 128 } }), 201);
    const replies = await Promise.all([1, 2, 3].map(() => c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' })));
    for (const r of replies) assert.equal(ok(r).state, 'running');
    const resumed = ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' }));
    assert.equal(resumed.host_id, 'h2', 'the only other host that can restore memory');
    const events = (await c.service.store.readStream(`vm-${vm.id}`)).map((e) => e.type);
    assert.equal(events.filter((e) => e === 'VmResumed').length, 1, 'exactly one resume');
    await advances(vm.id);
    await answers(resumed.endpoints[0].url);
    assert.ok(!(await agents[0]!.client.listVms()).some((v) => v.name.endsWith(vm.id)), 'nothing of it left on the origin');
    ok(await c.request('DELETE', `/v1/vms/${filler.id}`, { as: 'acme' }));
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  it('on_idle: pause: an idle VM is paused by the reconciler (not destroyed) and resumes where it stopped; never placed where it could not be paused', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const bad = await c.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 128, on_idle: 'sleep' } });
    assert.equal(bad.status, 400, JSON.stringify(bad.body));
    const vm = ok(
      await c.request('POST', '/v1/vms', {
        as: 'acme',
        body: { cpus: 1, ram_mb: 128, idle_timeout_s: 1, on_idle: 'pause', startup_script: STARTUP },
      }),
      201,
    );
    assert.notEqual(vm.host_id, 'h3', 'placed only on a host that can checkpoint memory');
    const before = await count(vm.id);
    await eventually(
      async () => {
        await c.service.reconciler.reconcileOnce();
        const now = ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' }));
        return now.state === 'paused' ? now : undefined;
      },
      30_000,
      'the idle VM paused',
    );
    const memory = ok(await c.request('GET', `/v1/vms/${vm.id}/memory`, { as: 'acme' }));
    assert.equal(memory.done, true);
    ok(await c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' }));
    const from = await advances(vm.id);
    assert.ok(from >= before, `resumed where it stopped: ${before} -> ${from}`);
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  // Last: it kills h2's agent.
  it('a failure after the freeze resumes the source; with keep_paused the source stays paused and the caller resumes it', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = await start();
    await agents[1]!.kill();
    const before = await count(vm.id);
    const r = await c.request('POST', `/v1/vms/${vm.id}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h2' } });
    assert.ok(r.status >= 500, JSON.stringify(r.body));
    assert.equal(problemOf(r).code, 'MIGRATION_FAILED');
    assert.equal((r.body as { details?: { source?: string } }).details?.source, 'running');
    const events = (await c.service.store.readStream(`vm-${vm.id}`)).filter((e) => e.type.startsWith('VmMigration'));
    assert.ok(
      events.some((e) => e.type === 'VmMigrationStepCompleted' && (e.data as { step: string }).step === 'snapshot'),
      'it failed after the freeze',
    );
    assert.ok(events.some((e) => e.type === 'VmMigrationFailed'));
    const back = ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' }));
    assert.equal(back.state, 'running');
    assert.equal(back.host_id, 'h1');
    const from = await advances(vm.id);
    assert.ok(from >= before, `the source resumed where it froze: ${before} -> ${from}`);
    await answers(back.endpoints[0].url);

    const kept = await c.request('POST', `/v1/vms/${vm.id}/migrate`, {
      as: 'acme',
      body: { live: true, target_host_id: 'h2', keep_paused: true },
    });
    assert.equal(problemOf(kept).code, 'MIGRATION_FAILED');
    assert.equal((kept.body as { details?: { source?: string } }).details?.source, 'paused');
    // The read model follows the VmPaused event.
    await eventually(
      async () => ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' })).state === 'paused',
      10_000,
      'left paused for the caller',
    );
    const { state: h1 } = await c.service.hosts.load('h1');
    assert.ok(h1.status !== 'unregistered' && !h1.reservations.has(vm.id), 'no CPU or memory held while paused');
    const resumed = ok(await c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' }));
    assert.equal(resumed.host_id, 'h1');
    await advances(vm.id);
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });
});
