import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, it, type TestContext } from 'node:test';
import type { RunningAgent } from '../agent/harness.js';
import {
  prepareAgents,
  problemOf,
  registerHost,
  startCheckedAgent,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';
import { startTestInternet, type TestInternet } from '../support/test-internet.js';

/**
 * Egress through the API with a real agent and sandboxes and a test-owned
 * "internet" (test/support/test-internet.ts): the policy validated once at
 * the edge, carried in the VM's events and read model, sent to the agent;
 * proxy mode refused without a registry or with an unknown provider (never
 * booted direct); the resolved status with its proxy's health; a running
 * VM's policy replaced with PUT /v1/vms/:id/network.
 */

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

describe('egress through the API (real agent, test internet)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let agent: RunningAgent | undefined;
  let cp: ControlPlane | undefined;
  let bare: ControlPlane | undefined;
  let net: TestInternet | undefined;
  const proxyPort = 20_000 + (randomBytes(2).readUInt16BE() % 20_000);

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const exec = async (vm: string, cmd: string): Promise<{ exit_code: number; stdout: string }> =>
    ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['/bin/sh', '-c', cmd] } }));
  /** An HTTP GET by nc inside the VM, straight or as an absolute-form request to its proxy; true when the internet answered. */
  const reaches = async (vm: string, target: string, proxy?: string): Promise<boolean> => {
    const line = proxy ? `GET http://${target}/ HTTP/1.0` : 'GET / HTTP/1.0';
    const to = proxy ? proxy.replace(/^http:\/\//, '').replace(':', ' ') : `${target} 80`;
    const r = await exec(vm, `printf '${line}\\r\\nHost: ${target}\\r\\n\\r\\n' | nc -w 3 ${to}`);
    return /internet http/.test(r.stdout);
  };

  before(async () => {
    const prepared = await prepareAgents();
    if ('skip' in prepared) {
      skip = prepared.skip;
      return;
    }
    fleet = prepared;
    net = await startTestInternet(`x${randomBytes(2).toString('hex')}`, { 'allowed.example.test': 'ip1', 'denied.example.test': 'ip1' });
    const a = await startCheckedAgent(fleet, { env: { AGENT_EGRESS_DNS: net.dns, AGENT_EGRESS_PROXY_PORT: String(proxyPort) } });
    if ('skip' in a) {
      skip = a.skip;
      return;
    }
    agent = a;
    cp = await startControlPlane({ env: { RECONCILER_ENABLED: 'false', EGRESS_PROXIES: '{"fleet":{"kind":"agent"}}' } });
    ok(await registerHost(cp, 'h1', agent), 201);
    bare = await startControlPlane({ env: { RECONCILER_ENABLED: 'false' } });
    ok(await registerHost(bare, 'h1', agent), 201);
  });

  after(async () => {
    await cp?.close();
    await bare?.close();
    await fleet?.close();
    net?.remove();
  });

  it('bad policies are refused at the edge with stable codes, before anything is written', async (t) => {
    if (guard(t)) return;
    const create = (c: ControlPlane, egress: unknown) =>
      c.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 256, egress } });
    const cases: Array<[ControlPlane, unknown, string]> = [
      [bare!, { mode: 'proxy', provider: 'fleet' }, 'EGRESS_PROXY_NOT_CONFIGURED'],
      [cp!, { mode: 'proxy', provider: 'nosuch' }, 'EGRESS_PROVIDER_UNKNOWN'],
      [cp!, { mode: 'direct', allow_out: ['example.com'] }, 'EGRESS_DOMAIN_RULES_NEED_PROXY'],
      [cp!, { mode: 'direct', deny_out: ['10.0.0.1/8'] }, 'VALIDATION_FAILED'],
      [cp!, { mode: 'none', allow_out: ['1.2.3.4'] }, 'VALIDATION_FAILED'],
      [cp!, { mode: 'warp' }, 'VALIDATION_FAILED'],
    ];
    for (const [c, egress, code] of cases) {
      const r = await create(c, egress);
      assert.equal(r.status, 400, JSON.stringify(r.body));
      assert.equal(problemOf(r).code, code, JSON.stringify(egress));
    }
    for (const c of [cp!, bare!])
      assert.deepEqual(ok(await c.request('GET', '/v1/vms', { as: 'acme' })).vms, [], 'a refused create left a VM');
    assert.deepEqual(await agent!.client.listVms('fl-'), [], 'a refused create reached the agent');
  });

  it('direct by default: the VM reaches the internet, shows its policy, and PUT /network closes it', async (t) => {
    if (guard(t)) return;
    const vm = ok(await cp!.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 256 } }), 201);
    assert.deepEqual(vm.egress, { mode: 'direct' });
    assert.ok(await reaches(vm.id, net!.ip1), 'a default VM did not reach the internet');

    const changed = ok(await cp!.request('PUT', `/v1/vms/${vm.id}/network`, { as: 'acme', body: { egress: { mode: 'none' } } }));
    assert.equal(changed.egress.mode, 'none');
    assert.ok(!(await reaches(vm.id, net!.ip1)), 'none after PUT still reached the internet');
    const row = ok(await cp!.request('GET', `/v1/vms/${vm.id}?after=${changed.position}`, { as: 'acme' }));
    assert.equal(row.egress.mode, 'none');
    assert.deepEqual(row.spec.egress, { mode: 'none' });
    const audit = ok(await cp!.request('GET', `/v1/audit/streams/vm-${vm.id}`, { as: 'admin' }));
    assert.ok(JSON.stringify(audit).includes('VmEgressChanged'), 'no VmEgressChanged event');
    // Bad input on PUT: a 400, nothing applied.
    const bad = await cp!.request('PUT', `/v1/vms/${vm.id}/network`, {
      as: 'acme',
      body: { egress: { mode: 'direct', allow_out: ['x.test'] } },
    });
    assert.equal(problemOf(bad).code, 'EGRESS_DOMAIN_RULES_NEED_PROXY');
    assert.equal(
      (await cp!.request('PUT', `/v1/vms/${vm.id}/network`, { as: 'globex', body: { egress: { mode: 'direct' } } })).status,
      404,
    );
    assert.ok(!(await reaches(vm.id, net!.ip1)));
    ok(await cp!.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  it('proxy mode: provisioned on the host, the guest told where, domain rules enforced, health reported', async (t) => {
    if (guard(t)) return;
    const vm = ok(
      await cp!.request('POST', '/v1/vms', {
        as: 'acme',
        body: {
          cpus: 1,
          ram_mb: 256,
          egress: { mode: 'proxy', provider: 'fleet', allow_out: ['allowed.example.test'], deny_out: ['*.example.test'] },
        },
      }),
      201,
    );
    const got = ok(await cp!.request('GET', `/v1/vms/${vm.id}?after=${vm.position}`, { as: 'acme' }));
    assert.equal(got.egress.mode, 'proxy');
    assert.equal(got.egress.provider, 'fleet');
    assert.match(got.egress.endpoint, new RegExp(`^http://[\\d.]+:${proxyPort}$`));
    assert.equal(got.egress.health, 'healthy');
    const env = await exec(vm.id, 'echo $HTTPS_PROXY');
    assert.equal(env.stdout.trim(), got.egress.endpoint);
    assert.ok(await reaches(vm.id, 'allowed.example.test', got.egress.endpoint), 'an allowed name did not pass the proxy');
    assert.ok(!(await reaches(vm.id, 'denied.example.test', got.egress.endpoint)), 'a denied name passed the proxy');
    assert.ok(!(await reaches(vm.id, net!.ip1)), 'a proxy-mode VM reached the internet around its proxy');
    const status = ok(await cp!.request('GET', `/v1/vms/${vm.id}/network`, { as: 'acme' }));
    assert.equal(status.egress.health, 'healthy');
    // The reconciler probes it and counts it, by provider and state.
    const s = await cp!.service.reconciler.reconcileOnce();
    assert.equal(s.egress_checked, 1);
    assert.equal(s.egress_unhealthy, 0);
    const metrics = await cp!.request('GET', '/metrics', { as: 'none' });
    assert.match(String(metrics.body), /fleet_egress_endpoints\{provider="fleet",state="healthy"\} 1/);
    ok(await cp!.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });
});
