import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { createServer, type Server } from 'node:net';
import { after, before, describe, it, type TestContext } from 'node:test';
import { metricsProjection } from '../../src/projections/metrics/metrics.projection.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import {
  prepareAgents,
  registerHost,
  startCheckedAgent,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * An egress provider that cannot provision is an event (VmEgressFailed) and
 * is counted from it: a real agent whose proxy port is taken (a listener on
 * every address, held by the test) cannot start its egress proxy, so a
 * proxy-mode VM fails with EGRESS_PROVISION_FAILED, the failure is in the
 * VM's events and fleet_egress_failures_total{provider,op="provision"}, and
 * a rebuild of the metrics read model from the log counts the same.
 */

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

describe('egress failures are events that feed fleet_egress_failures_total (real agent)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let blocker: Server | undefined;
  const proxyPort = 20_000 + (randomBytes(2).readUInt16BE() % 20_000);
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    const prepared = await prepareAgents();
    if ('skip' in prepared) {
      skip = prepared.skip;
      return;
    }
    fleet = prepared;
    // The agent's proxy binds the gateway address on this port: a wildcard listener makes that EADDRINUSE.
    blocker = createServer();
    await new Promise<void>((resolve, reject) => blocker!.once('error', reject).listen(proxyPort, '0.0.0.0', resolve));
    const a = await startCheckedAgent(fleet, { env: { AGENT_EGRESS_PROXY_PORT: String(proxyPort) } });
    if ('skip' in a) {
      skip = a.skip;
      return;
    }
    cp = await startControlPlane({ env: { RECONCILER_ENABLED: 'false', EGRESS_PROXIES: '{"corp":{"kind":"agent"}}' } });
    ok(await registerHost(cp, 'h1', a), 201);
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
    blocker?.close();
  });

  const failures = async (): Promise<string[]> =>
    String((await cp!.request('GET', '/metrics', { as: 'none' })).body)
      .split('\n')
      .filter((l) => l.startsWith('fleet_egress_failures_total{'));

  it('a proxy that cannot start fails the VM with EGRESS_PROVISION_FAILED and is counted from its event, replay-stably', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    assert.deepEqual(await failures(), [], 'nothing counted before a failure');
    const created = await c.request('POST', '/v1/vms', {
      as: 'acme',
      body: { cpus: 1, ram_mb: 128, egress: { mode: 'proxy', provider: 'corp' } },
    });
    assert.ok(created.status >= 500, JSON.stringify(created.body));
    const direct = ok(await c.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 128 } }), 201);
    const head = await c.service.store.headPosition();
    if (head) await c.service.runner.waitFor(head, 15_000);

    const failed = (await c.request('GET', '/v1/vms?reason=error', { as: 'acme' })).body.vms;
    assert.equal(failed.length, 1, JSON.stringify(failed));
    assert.deepEqual([failed[0].state, failed[0].error_code], ['failed', 'EGRESS_PROVISION_FAILED']);
    const events = (await c.request('GET', `/v1/audit/streams/vm-${failed[0].id}`, { as: 'acme' })).body.events as Array<{
      type: string;
      data: { provider?: string; op?: string; error?: string };
    }>;
    const egress = events.filter((e) => e.type === 'VmEgressFailed');
    assert.equal(egress.length, 1, JSON.stringify(events.map((e) => e.type)));
    assert.deepEqual([egress[0]!.data.provider, egress[0]!.data.op], ['corp', 'provision']);
    assert.match(egress[0]!.data.error!, /egress proxy could not start/);
    assert.ok(events.findIndex((e) => e.type === 'VmEgressFailed') < events.findIndex((e) => e.type === 'VmFailed'));

    assert.deepEqual(await failures(), ['fleet_egress_failures_total{op="provision",provider="corp"} 1']);
    const report = await rebuildProjection(c.service.store, c.db.pool, metricsProjection, { verify: true });
    for (const d of report.drift) assert.deepEqual([d.table, d.onlyLive, d.onlyRebuilt], [d.table, 0, 0]);
    assert.deepEqual(await failures(), ['fleet_egress_failures_total{op="provision",provider="corp"} 1']);

    // A direct VM on the same host never needed the proxy: it runs, and counts nothing.
    assert.equal((await c.request('GET', `/v1/vms/${direct.id}`, { as: 'acme' })).body.state, 'running');

    // Switching it to the proxy that cannot start fails, is counted, and leaves the sandbox on its old policy, not half the new.
    const put = await c.request('PUT', `/v1/vms/${direct.id}/network`, {
      as: 'acme',
      body: { egress: { mode: 'proxy', provider: 'corp' } },
    });
    assert.ok(put.status >= 500, JSON.stringify(put.body));
    assert.equal((put.body as { code?: string }).code, 'EGRESS_PROVISION_FAILED', JSON.stringify(put.body));
    // Health is `unhealthy` when the host applies another mode than the VM's recorded one.
    const live = ok(await c.request('GET', `/v1/vms/${direct.id}/network`, { as: 'acme' })).egress as { mode: string; health?: string };
    assert.equal(live.mode, 'direct');
    assert.notEqual(live.health, 'unhealthy', `the host still applies the VM's old policy: ${JSON.stringify(live)}`);
    assert.equal((await c.request('GET', `/v1/vms/${direct.id}`, { as: 'acme' })).body.egress.mode, 'direct');
    ok(await c.request('DELETE', `/v1/vms/${direct.id}`, { as: 'acme' }));
  });
});
