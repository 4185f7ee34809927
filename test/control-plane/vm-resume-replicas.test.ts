import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { after, before, describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import { apiKeysFrom, startService, type Service } from '../../src/adapters/service.js';
import type { RunningAgent } from '../agent/harness.js';
import {
  ADMIN_KEY,
  keyOf,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  TENANT_KEYS,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * Exactly one resume across two control-plane processes sharing one event
 * store: concurrent POST /v1/vms/:id/resume sent to both, with two real
 * agents with CRIU (CRIU_PATH). The VM's origin has room for it and nothing
 * more, so a replica that does not see the other's resume finds its origin
 * "full" and restores a second copy elsewhere.
 */

const criu = process.env.CRIU_PATH;
const noCriu = !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0 ? 'a working CRIU at CRIU_PATH' : undefined;
if (noCriu && process.env.CI === 'true') it('CRIU is available in CI', () => assert.fail(`missing: ${noCriu}`));

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

const STARTUP =
  'echo 0 > /tmp/count; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 &\n';

describe('exactly one resume across two control-plane processes (real agents with CRIU)', { timeout: 400_000 }, () => {
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
    const started = await startCheckedFleet(2);
    ({ fleet, skip } = started);
    agents.push(...started.agents);
    if (skip) return;
    cp = await startControlPlane({ env: { RECONCILER_ENABLED: 'false', EXEC_DEFAULT_TIMEOUT_MS: '20000' } });
    for (const [i, a] of agents.entries()) ok(await registerHost(cp, `h${i + 1}`, a), 201);
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

  /** The same request to the second process (its own handlers, placement view and agent clients). */
  const viaSecond = async (method: 'GET' | 'POST', url: string): Promise<Reply> => {
    const raw = await second!.app.inject({ method, url, headers: { authorization: `Bearer ${keyOf('acme')}` } });
    return { status: raw.statusCode, headers: raw.headers, body: raw.json(), raw };
  };
  const count = async (vm: string): Promise<number> => {
    const r = ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['cat', '/tmp/count'] } }));
    return Number(r.stdout);
  };

  it('concurrent resumes sent to two processes: one restore, on the origin; both callers see it running; five rounds', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const { state: h1 } = await c.service.hosts.load('h1');
    assert.ok(h1.status !== 'unregistered');
    const all = Math.floor(h1.capacity.cpus * h1.cpu_overcommit_ratio);
    const vm = ok(
      await c.request('POST', '/v1/vms', { as: 'acme', body: { host_id: 'h1', cpus: all, ram_mb: 128, startup_script: STARTUP } }),
      201,
    );
    await new Promise((r) => setTimeout(r, 300));
    let last = await count(vm.id);
    for (let round = 0; round < 5; round++) {
      ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' }));
      const stream = `vm-${vm.id}`;
      const before = (await c.service.store.readStream(stream)).length;
      const replies = await Promise.all([
        c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' }),
        viaSecond('POST', `/v1/vms/${vm.id}/resume`),
        c.request('POST', `/v1/vms/${vm.id}/resume`, { as: 'acme' }),
        viaSecond('POST', `/v1/vms/${vm.id}/resume`),
      ]);
      for (const r of replies) {
        const body = ok(r);
        assert.equal(body.state, 'running');
        assert.equal(body.host_id, 'h1', `round ${round}: every caller sees it on its origin`);
      }
      const after = (await c.service.store.readStream(stream)).slice(before).map((e) => e.type);
      assert.deepEqual(
        after.filter((e) => e === 'VmResumed' || e === 'VmMigrated'),
        ['VmResumed'],
        `round ${round}: one resume: ${after.join(', ')}`,
      );
      const elsewhere = (await agents[1]!.client.listVms()).filter((v) => v.name.endsWith(vm.id));
      assert.deepEqual(elsewhere, [], `round ${round}: no second copy restored on h2`);
      const { state: h2 } = await c.service.hosts.load('h2');
      assert.ok(h2.status !== 'unregistered' && !h2.reservations.has(vm.id), `round ${round}: nothing reserved for it on h2`);
      const { state: h1now } = await c.service.hosts.load('h1');
      assert.ok(h1now.status !== 'unregistered' && h1now.reservations.has(vm.id), `round ${round}: its reservation on h1 stands`);
      const now = await count(vm.id);
      assert.ok(now >= last, `round ${round}: the counter continued: ${last} -> ${now}`);
      last = now;
    }
    t.diagnostic(`counter after five concurrent resumes: ${last}`);
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });
});
