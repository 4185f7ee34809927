import assert from 'node:assert/strict';
import { after, before, describe, it, type TestContext } from 'node:test';
import type { RunningAgent } from '../agent/harness.js';
import {
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * Cold migration of VMs that publish ports, with two real host-agent
 * processes: the target boots with the same `expose` (and the in-guest
 * agent's), so its ports are published there and the endpoints follow.
 */

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

describe('cold migrate of a VM with expose (two real agents)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  const agents: RunningAgent[] = [];

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const exec = async (vm: string, cmd: string): Promise<{ exit_code: number; stdout: string; stderr: string }> =>
    ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['/bin/sh', '-c', cmd] } }));

  before(async () => {
    const started = await startCheckedFleet(2);
    ({ fleet, skip } = started);
    agents.push(...started.agents);
    if (skip) {
      process.stderr.write(`migrate-expose tests skipped: ${skip}\n`);
      return;
    }
    cp = await startControlPlane({
      env: { ARTIFACT_PULL_TIMEOUT_MS: '60000', RECONCILER_ENABLED: 'false', EXEC_DEFAULT_TIMEOUT_MS: '20000' },
    });
    ok(await registerHost(cp, 'h1', agents[0]!), 201);
    ok(await registerHost(cp, 'h2', agents[1]!), 201);
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  it('a VM with expose moves to the other host: running there, its port published on the target and reachable', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(
      await c.request('POST', '/v1/vms', {
        as: 'acme',
        body: { host_id: 'h1', cpus: 1, ram_mb: 256, expose: [{ port: 8080, as: 'http' }] },
      }),
      201,
    );
    assert.equal(vm.endpoints.length, 1);
    assert.equal((await exec(vm.id, 'mkdir -p /www && echo served-after-move > /www/index.html && sync')).exit_code, 0);

    const m = ok(await c.request('POST', `/v1/vms/${vm.id}/migrate`, { as: 'acme', body: {} }));
    assert.equal(m.id, vm.id);
    assert.equal(m.state, 'running');
    assert.equal(m.host_id, 'h2');
    assert.equal(m.from_host_id, 'h1');
    const row = ok(await c.request('GET', `/v1/vms/${vm.id}?after=${m.position}`, { as: 'acme' }));
    assert.equal(row.host_id, 'h2');
    assert.deepEqual(
      row.endpoints.map((e: any) => [e.as, e.port, e.protocol]),
      [['http', 8080, 'tcp']],
    );
    const onTarget = (await agents[1]!.client.listVms('')).find((v) => v.name === `fl-${vm.id}`);
    assert.ok(onTarget, 'the sandbox runs on the target');
    assert.deepEqual(
      onTarget.endpoints.map((e) => e.port),
      [8080],
      'the target published the port',
    );
    assert.equal(row.endpoints[0].url, onTarget.endpoints[0]!.url, 'the VM names the target endpoint');

    assert.equal((await exec(vm.id, 'httpd -p 8080 -h /www')).exit_code, 0);
    const res = await fetch(`${row.endpoints[0].url}/index.html`, { signal: AbortSignal.timeout(5000) });
    assert.equal(await res.text(), 'served-after-move\n');
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });

  it('a VM whose in-guest agent exposes a port migrates too, the agent started again on the target', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const body = { host_id: 'h1', cpus: 1, ram_mb: 256, agent: { command: 'sleep 3600', expose: [{ port: 9090, as: 'agent' }] } };
    const vm = ok(await c.request('POST', '/v1/vms', { as: 'acme', body }), 201);
    assert.deepEqual(
      vm.endpoints.map((e: any) => e.as),
      ['agent'],
    );
    const m = ok(await c.request('POST', `/v1/vms/${vm.id}/migrate`, { as: 'acme', body: {} }));
    assert.equal(m.state, 'running');
    assert.equal(m.host_id, 'h2');
    const row = ok(await c.request('GET', `/v1/vms/${vm.id}?after=${m.position}`, { as: 'acme' }));
    assert.deepEqual(
      row.endpoints.map((e: any) => [e.as, e.port]),
      [['agent', 9090]],
    );
    const onTarget = (await agents[1]!.client.listVms('')).find((v) => v.name === `fl-${vm.id}`);
    assert.deepEqual(
      onTarget?.endpoints.map((e) => e.port),
      [9090],
    );
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });
});
