import assert from 'node:assert/strict';
import { after, afterEach, before, describe, test } from 'node:test';
import { createTestDatabase, type TestDatabase } from '../support/postgres.js';
import {
  api,
  prepareTestImages,
  skipReason,
  spawnControlPlane,
  startTestAgent,
  tempDir,
  vmIdFor,
  waitFor,
  type ControlPlaneProcess,
  type TestAgent,
} from './harness.js';

/**
 * The control plane as a real process (`src/main.ts`, DATABASE_URL of a test
 * database, no local agent), SIGKILLed at the worst moments of a create and
 * a destroy, then restarted; one real host agent, itself SIGKILLed and
 * restarted; two replicas with the holder of the reconciler lease killed.
 * After each crash the fleet must converge within the grace for abandoned
 * work plus two reconcile cycles: no sandbox leaked, no capacity held for a
 * VM that is not there, every VM running or ended with a reason.
 */
const prereq = await skipReason();

const INTERVAL_MS = 1000;
const GRACE_MS = 3000;
const UNREACHABLE_AFTER = 2;
/** Start-up of a restarted process (tsx compile, migrations, projections catching up) — not the reconciler's time. */
const STARTUP_SLACK_MS = 8000;
const BOUND_MS = GRACE_MS + 2 * INTERVAL_MS + STARTUP_SLACK_MS;

const BASE_ENV = {
  RECONCILE_INTERVAL_MS: String(INTERVAL_MS),
  RECONCILE_GRACE_MS: String(GRACE_MS),
  HOST_UNREACHABLE_AFTER_CYCLES: String(UNREACHABLE_AFTER),
  RECONCILE_AGENT_TIMEOUT_MS: '3000',
  AGENT_CALL_TIMEOUT_MS: '10000',
  LEASE_POLL_MS: '300',
  LOG_LEVEL: process.env.FLEET_TEST_LOG ?? 'info',
};

describe(
  'reconciler: crashes of the control plane and of an agent',
  {
    skip: prereq,
    timeout: 420_000,
  },
  () => {
    let images: { imageDir: string } | { skip: string };
    let agent: TestAgent | undefined;
    let db: TestDatabase | undefined;
    let dataDir: { path: string; remove(): Promise<void> } | undefined;
    const procs = new Set<ControlPlaneProcess>();
    const healthy: string[] = [];

    const start = async (env: Record<string, string> = {}): Promise<ControlPlaneProcess> => {
      const cp = await spawnControlPlane({ databaseUrl: db!.url, dataDir: dataDir!.path, env: { ...BASE_ENV, ...env } });
      procs.add(cp);
      return cp;
    };
    const kill = async (cp: ControlPlaneProcess): Promise<void> => {
      await cp.kill();
      procs.delete(cp);
    };
    const vm = async (cp: ControlPlaneProcess, id: string) => (await api(cp.url, 'GET', `/v1/vms/${id}`)).body;
    const sandboxes = async (): Promise<string[]> => (await agent!.client.listVms('fl-', { timeoutMs: 10_000 })).map((v) => v.name).sort();

    /** The invariants after a crash, all at once (undefined while they do not hold yet). */
    const converged = async (cp: ControlPlaneProcess, ids: string[]): Promise<Record<string, string> | undefined> => {
      const states: Record<string, string> = {};
      const listed = new Set(await sandboxes());
      let running = 0;
      // Every VM the fleet knows, not only the ones this step made.
      const all = (await api(cp.url, 'GET', '/v1/vms?limit=500')).body.vms as Array<{ id: string }>;
      for (const id of new Set([...ids, ...all.map((v) => v.id)])) {
        const v = await vm(cp, id);
        if (v.state === 'running') {
          if (!listed.has(`fl-${id}`)) return undefined;
          running++;
        } else if (v.state === 'failed' || v.state === 'destroyed') {
          if (!v.reason || listed.has(`fl-${id}`)) return undefined;
        } else return undefined;
        states[id] = `${v.state}${v.reason ? `:${v.reason}` : ''}`;
      }
      if (listed.size !== running) return undefined;
      const host = (await api(cp.url, 'GET', '/v1/hosts/h1')).body;
      if (host.allocated?.vm_count !== running) return undefined;
      return states;
    };

    const createAndForget = (cp: ControlPlaneProcess, key: string, body: Record<string, unknown>): string => {
      void api(cp.url, 'POST', '/v1/vms', body, { headers: { 'idempotency-key': key }, timeoutMs: 120_000 }).catch(() => undefined);
      return vmIdFor('admin', key);
    };

    before(async () => {
      images = await prepareTestImages();
      if ('skip' in images) return;
      agent = await startTestAgent(images.imageDir);
      db = await createTestDatabase('rec_crash');
      dataDir = await tempDir('rec-cp-');
    });

    // A test that fails midway must not leave its control planes running (a leftover holds the reconciler lease).
    afterEach(async () => {
      for (const cp of procs) await kill(cp);
    });

    after(async () => {
      for (const cp of procs) await cp.kill();
      await agent?.dispose();
      await db?.drop();
      await dataDir?.remove();
    });

    test('SIGKILL between reservation and boot (booting, no sandbox yet): rolled back after restart', async (t) => {
      if ('skip' in images) return t.skip(images.skip);
      // TEST HOOK: the agent create waits 60 s, so the VM sits in `booting` with its capacity reserved and no sandbox.
      const cp = await start({ FLEET_TEST_HOOK_AGENT_DELAY_MS: 'createVm=60000' });
      const reg = await api(cp.url, 'POST', '/v1/hosts', { id: 'h1', url: agent!.url, token: agent!.token, backend: 'process' });
      assert.equal(reg.status, 201, JSON.stringify(reg.body));
      const id = createAndForget(cp, 'crash-before-boot', { cpus: 1, ram_mb: 128 });
      await waitFor('vm booting', 60_000, async () => (await vm(cp, id)).state === 'booting');
      const host = (await api(cp.url, 'GET', '/v1/hosts/h1')).body;
      assert.equal(host.allocated.vm_count, 1, 'capacity reserved before the crash');
      await kill(cp);

      const cp2 = await start();
      const t0 = Date.now();
      const states = await waitFor('converged after the crash', BOUND_MS, () => converged(cp2, [id]), 200);
      t.diagnostic(`converged ${Date.now() - t0} ms after restart: ${JSON.stringify(states)}`);
      const v = await vm(cp2, id);
      assert.equal(v.state, 'failed');
      assert.equal(v.reason, 'orphaned');
      assert.equal(v.error_code, 'INTERRUPTED');
      assert.match(v.error, /booting/);

      // A healthy VM created now stays running through every later crash.
      const ok = await api(cp2.url, 'POST', '/v1/vms', { cpus: 1, ram_mb: 128 }, { headers: { 'idempotency-key': 'healthy-1' } });
      assert.equal(ok.status, 201, JSON.stringify(ok.body));
      healthy.push(ok.body.id);
      await kill(cp2);
    });

    test('SIGKILL between boot and the running event (sandbox created, startup script running): sandbox destroyed, capacity released', async (t) => {
      if ('skip' in images) return t.skip(images.skip);
      const cp = await start();
      const id = createAndForget(cp, 'crash-during-boot', {
        cpus: 1,
        ram_mb: 128,
        startup_script: 'sleep 40',
        startup_script_timeout_s: 45,
      });
      await waitFor(
        'sandbox created, vm booting',
        30_000,
        async () => (await sandboxes()).includes(`fl-${id}`) && (await vm(cp, id)).state === 'booting',
      );
      await kill(cp);

      const cp2 = await start();
      const t0 = Date.now();
      const states = await waitFor('converged after the crash', BOUND_MS, () => converged(cp2, [id, ...healthy]), 200);
      t.diagnostic(`converged ${Date.now() - t0} ms after restart: ${JSON.stringify(states)}`);
      const v = await vm(cp2, id);
      assert.equal(v.state, 'failed');
      assert.equal(v.error_code, 'INTERRUPTED');
      assert.equal(states[healthy[0]!], 'running');
      await kill(cp2);
    });

    test('SIGKILL during a destroy: the destroy is completed after restart', async (t) => {
      if ('skip' in images) return t.skip(images.skip);
      const cp0 = await start();
      const made = await api(cp0.url, 'POST', '/v1/vms', { cpus: 1, ram_mb: 128 }, { headers: { 'idempotency-key': 'to-destroy' } });
      assert.equal(made.status, 201, JSON.stringify(made.body));
      const id = made.body.id as string;
      await kill(cp0);

      // TEST HOOK: the agent destroy waits 60 s, so the VM sits in `destroying` with its sandbox and reservation.
      const cp = await start({ FLEET_TEST_HOOK_AGENT_DELAY_MS: 'destroyVm=60000' });
      void api(cp.url, 'DELETE', `/v1/vms/${id}`, undefined, { timeoutMs: 120_000 }).catch(() => undefined);
      await waitFor('vm destroying', 30_000, async () => (await vm(cp, id)).state === 'destroying');
      assert.ok((await sandboxes()).includes(`fl-${id}`));
      await kill(cp);

      const cp2 = await start();
      const t0 = Date.now();
      const states = await waitFor('converged after the crash', BOUND_MS, () => converged(cp2, [id, ...healthy]), 200);
      t.diagnostic(`converged ${Date.now() - t0} ms after restart: ${JSON.stringify(states)}`);
      assert.equal(states[id], 'destroyed:admin');
      assert.equal(states[healthy[0]!], 'running');
      // The destroy is completed by the first of the new leader's cycles that finds it past the grace (the first one
      // when the restart took longer than the grace, a later one otherwise); the counters move when that cycle ends.
      const summary = await waitFor('the first cycle summary', 30_000, async () => {
        const s = (await api(cp2.url, 'GET', '/v1/reconciler')).body;
        return s.last_summary ? s : undefined;
      });
      assert.equal(summary.leader, true);
      assert.ok(summary.last_summary.cycle >= 1);
      const metrics = await waitFor('the completing cycle counted', 30_000, async () => {
        const text = await (await fetch(`${cp2.url}/metrics`)).text();
        return /fleet_reconcile_actions_total\{kind="half_done_completed"\} [1-9]/.test(text) ? text : undefined;
      });
      assert.match(metrics, /fleet_reconcile_actions_total\{kind="half_done_completed"\} 1/);
      assert.match(metrics, /fleet_reconciler_leader 1/);
      await kill(cp2);
    });

    test('SIGKILL of the host agent while a VM runs: host unreachable, then reachable again on restart; the fleet converges', async (t) => {
      if ('skip' in images) return t.skip(images.skip);
      const cp = await start();
      await agent!.kill();
      const hostState = async () => (await api(cp.url, 'GET', '/v1/hosts/h1')).body.state as string;
      const t0 = Date.now();
      await waitFor(
        'host marked unreachable',
        (UNREACHABLE_AFTER + 2) * (INTERVAL_MS + 3 * 3000) + 5000,
        async () => (await hostState()) === 'unreachable',
      );
      t.diagnostic(`host unreachable ${Date.now() - t0} ms after the agent died`);
      const refused = await api(cp.url, 'POST', '/v1/vms', { cpus: 1, ram_mb: 128 });
      assert.notEqual(refused.status, 201, 'placement skips the unreachable host');

      agent = await agent!.restart();
      const t1 = Date.now();
      await waitFor('host reachable again', 5 * INTERVAL_MS + 10_000, async () => (await hostState()) === 'active');
      t.diagnostic(`host active ${Date.now() - t1} ms after the agent restarted`);
      const states = await waitFor('converged after the agent restart', BOUND_MS, () => converged(cp, healthy), 200);
      t.diagnostic(`fleet: ${JSON.stringify(states)}`);
      const st = states[healthy[0]!]!;
      assert.ok(st === 'running' || st === 'failed:host_lost', st);
      if (st === 'running') {
        const ex = await api(cp.url, 'POST', `/v1/vms/${healthy[0]}/exec`, { argv: ['echo', 'alive'] });
        assert.equal(ex.body.stdout?.trim(), 'alive', JSON.stringify(ex.body));
      }
      await kill(cp);
    });

    test('two replicas: exactly one holds the reconciler lease; SIGKILL it and the other takes over within seconds', async (t) => {
      if ('skip' in images) return t.skip(images.skip);
      const a = await start();
      const b = await start();
      const leaderOf = async (cp: ControlPlaneProcess) =>
        (await api(cp.url, 'GET', '/v1/reconciler')).body as { leader: boolean; last_summary: { cycle: number } | null };
      const [la, lb] = await waitFor('one leader', 30_000, async () => {
        const x = await leaderOf(a);
        const y = await leaderOf(b);
        return x.leader !== y.leader ? [x, y] : undefined;
      });
      const [holder, standby] = la.leader ? [a, b] : [b, a];
      assert.ok(!lb.leader || !la.leader);
      await kill(holder);
      const t0 = Date.now();
      await waitFor(
        'standby takes over and completes a cycle',
        10_000,
        async () => {
          const s = await leaderOf(standby);
          return s.leader && (s.last_summary?.cycle ?? 0) >= 1;
        },
        100,
      );
      const took = Date.now() - t0;
      t.diagnostic(`lease moved in ${took} ms`);
      assert.ok(took < 10_000);

      // The new holder reconciles: an orphan dropped on the host now is destroyed by it.
      await agent!.client.createVm({ name: 'fl-stray0000000000000001', image: 'base' });
      await waitFor(
        'orphan destroyed by the new holder',
        3 * INTERVAL_MS + 5000,
        async () => !(await sandboxes()).includes('fl-stray0000000000000001'),
      );
      await kill(standby);
    });
  },
);
