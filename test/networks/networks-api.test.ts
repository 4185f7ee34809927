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

/**
 * Tenant networks end to end: a control plane, two real agents (process
 * backend) and real sandboxes. h1's subnet holds the network pool; h2 is the
 * emptier host that spread placement would pick without the network's pin.
 * Agents use the bridge prefix `n2<hex>`, so cleanup (fleet.close: destroy,
 * prune) touches only this file's bridges, veths, routes and tables.
 */

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

const LISTEN = (tag: string): string => `(while true; do echo "hello-from-${tag}" | nc -l -p 7000; done) >/dev/null 2>&1 &\n`;

describe('tenant networks (real agents and sandboxes)', { timeout: 600_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  const agents: RunningAgent[] = [];
  const b = randomBytes(2);
  // A /22 outside the harness's 10.200-249 range; its upper /23 is the network pool.
  const third = ((b[0] ?? 0) % 64) * 4;
  const h1Subnet = `10.25${(b[1] ?? 0) % 5}.${third}.0/22`;
  const pool = `10.25${(b[1] ?? 0) % 5}.${third + 2}.0/23`;
  const poolTop = (len: number): string => `10.25${(b[1] ?? 0) % 5}.${third + 3}.${len === 25 ? 128 : 192}/${len}`;
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    const f = await prepareAgents();
    if ('skip' in f) {
      skip = f.skip;
      return;
    }
    fleet = f;
    for (const env of [{ AGENT_SUBNET: h1Subnet }, {}] as Array<Record<string, string>>) {
      const a = await startCheckedAgent(fleet, { env: { AGENT_BRIDGE_PREFIX: `n2${randomBytes(2).toString('hex').slice(0, 3)}`, ...env } });
      if ('skip' in a) {
        skip = a.skip;
        return;
      }
      agents.push(a);
    }
    cp = await startControlPlane({
      env: { NETWORK_POOL: pool, NETWORK_PREFIX_LEN: '26', EXEC_DEFAULT_TIMEOUT_MS: '20000', CPU_OVERCOMMIT_RATIO: '16' },
    });
    ok(await registerHost(cp, 'h1', agents[0]!), 201);
    ok(await registerHost(cp, 'h2', agents[1]!), 201);
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  const sh = async (vm: string, script: string): Promise<{ exit_code: number; stdout: string }> =>
    ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['/bin/sh', '-c', script], timeout_ms: 15_000 } }));
  const reach = async (from: string, ip: string): Promise<string> => (await sh(from, `echo | nc -w 2 ${ip} 7000 2>&1; true`)).stdout.trim();
  const vm = async (body: Record<string, unknown>, as: 'acme' | 'globex' = 'acme'): Promise<any> =>
    ok(await cp!.request('POST', '/v1/vms', { as, body: { cpus: 1, ram_mb: 128, ...body } }), 201);

  it('members reach each other by address; another network, no network and another tenant do not; ip_hint, pin, delete', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const netA = ok(await c.request('POST', '/v1/networks', { as: 'acme', body: { name: 'cluster-a' } }), 201);
    const netB = ok(await c.request('POST', '/v1/networks', { as: 'acme', body: { name: 'cluster-b' } }), 201);
    assert.match(netA.subnet, /\/26$/);
    assert.notEqual(netA.subnet, netB.subnet);
    const base: number[] = (netA.subnet as string).split('/')[0]!.split('.').map(Number);
    const hint = `${base[0]!}.${base[1]!}.${base[2]!}.${base[3]! + 40}`;

    const a1 = await vm({ host_id: 'h1', network_id: netA.id, startup_script: LISTEN('a1') });
    // No host named: spread would pick the empty h2; the network's pin keeps it with a1.
    const a2 = await vm({ network_id: netA.id, ip_hint: hint, startup_script: LISTEN('a2') });
    assert.equal(a2.host_id, 'h1', 'the second member is placed on the first member’s host');
    const loose = await vm({ startup_script: LISTEN('loose') });
    assert.equal(loose.host_id, 'h2', 'without a network the same request goes to the emptier host');
    const b1 = await vm({ host_id: 'h1', network_id: netB.id, startup_script: LISTEN('b1') });
    const none = await vm({ host_id: 'h1', startup_script: LISTEN('none') });

    const shown = ok(await c.request('GET', `/v1/networks/${netA.id}?after=${a2.position}`, { as: 'acme' }));
    const ipOf = (id: string): string => shown.members.find((m: { vm_id: string }) => m.vm_id === id).ip;
    assert.equal(ipOf(a2.id), hint, 'ip_hint honoured');
    const a1ip = ipOf(a1.id);
    const b1ip = ok(await c.request('GET', `/v1/networks/${netB.id}?after=${b1.position}`, { as: 'acme' })).members[0].ip;
    const noneIp = String(none.url).replace(/^http:\/\//, '');

    await new Promise((r) => setTimeout(r, 500));
    assert.equal(await reach(a2.id, a1ip), 'hello-from-a1', 'a member reaches another by address');
    assert.equal(await reach(a1.id, hint), 'hello-from-a2', 'and back');
    assert.doesNotMatch(await reach(b1.id, a1ip), /hello-from/, 'a member of another network of the same tenant does not');
    assert.doesNotMatch(await reach(none.id, a1ip), /hello-from/, 'a VM on no network does not');
    assert.doesNotMatch(await reach(a1.id, b1ip), /hello-from/, 'a member does not reach another network');
    assert.doesNotMatch(await reach(a1.id, noneIp), /hello-from/, 'nor a VM of its tenant on no network');

    // A hint already held: the lowest free address instead (Reserve).
    const a3 = await vm({ host_id: 'h1', network_id: netA.id, ip_hint: hint });
    const again = ok(await c.request('GET', `/v1/networks/${netA.id}?after=${a3.position}`, { as: 'acme' }));
    const a3ip = again.members.find((m: { vm_id: string }) => m.vm_id === a3.id).ip;
    assert.notEqual(a3ip, hint);
    assert.notEqual(a3ip, a1ip);
    // Outside the subnet: a 400 before anything is written.
    const outside = await c.request('POST', '/v1/vms', {
      as: 'acme',
      body: { cpus: 1, ram_mb: 128, network_id: netA.id, ip_hint: '192.0.2.7' },
    });
    assert.equal(outside.status, 400, JSON.stringify(outside.body));
    assert.equal(problemOf(outside).code, 'IP_HINT_OUTSIDE_SUBNET');

    // Another tenant: cannot see, list, join or delete it.
    assert.equal(problemOf(await c.request('GET', `/v1/networks/${netA.id}`, { as: 'globex' })).code, 'NETWORK_NOT_FOUND');
    assert.deepEqual(ok(await c.request('GET', '/v1/networks', { as: 'globex' })).networks, []);
    const join = await c.request('POST', '/v1/vms', { as: 'globex', body: { cpus: 1, ram_mb: 128, host_id: 'h1', network_id: netA.id } });
    assert.equal(join.status, 404, JSON.stringify(join.body));
    assert.equal(problemOf(join).code, 'NETWORK_NOT_FOUND');
    assert.equal(problemOf(await c.request('DELETE', `/v1/networks/${netA.id}`, { as: 'globex' })).code, 'NETWORK_NOT_FOUND');
    const listed = ok(await c.request('GET', '/v1/networks', { as: 'acme' })).networks.map((n: { id: string }) => n.id);
    assert.deepEqual(listed.sort(), [netA.id, netB.id].sort());

    // A network spans one host: a member cannot be moved off it (it would land on its tenant's bridge, out of its network).
    const moved = await c.request('POST', `/v1/vms/${a1.id}/migrate`, { as: 'acme', body: { live: false, target_host_id: 'h2' } });
    assert.equal(moved.status, 409, JSON.stringify(moved.body));
    assert.equal(problemOf(moved).code, 'NETWORK_MEMBER_PINNED');
    assert.equal(ok(await c.request('GET', `/v1/vms/${a1.id}`, { as: 'acme' })).host_id, 'h1', 'still on its host');

    // Delete with live members: refused; once they are gone: deleted.
    const refused = await c.request('DELETE', `/v1/networks/${netA.id}`, { as: 'acme' });
    assert.equal(refused.status, 409, JSON.stringify(refused.body));
    assert.equal(problemOf(refused).code, 'NETWORK_HAS_MEMBERS');
    for (const v of [a1, a2, a3, b1, none, loose]) ok(await c.request('DELETE', `/v1/vms/${v.id}`, { as: 'acme' }));
    const deleted = ok(await c.request('DELETE', `/v1/networks/${netA.id}`, { as: 'acme' }));
    assert.equal(deleted.deleted, true);
    ok(await c.request('DELETE', `/v1/networks/${netA.id}`, { as: 'acme' }));
    assert.equal((await c.request('GET', `/v1/networks/${netA.id}?after=${deleted.position}`, { as: 'acme' })).status, 404);
    ok(await c.request('DELETE', `/v1/networks/${netB.id}`, { as: 'acme' }));
  });

  it('a subnet outside the pool or overlapping another network is refused with a code', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const out = await c.request('POST', '/v1/networks', { as: 'acme', body: { name: 'x', subnet: '192.168.0.0/24' } });
    assert.equal(out.status, 400, JSON.stringify(out.body));
    assert.equal(problemOf(out).code, 'SUBNET_OUTSIDE_POOL');
    const first = ok(await c.request('POST', '/v1/networks', { as: 'acme', body: { name: 'y', subnet: poolTop(25) } }), 201);
    const clash = await c.request('POST', '/v1/networks', { as: 'globex', body: { name: 'z', subnet: poolTop(26) } });
    assert.equal(clash.status, 409, JSON.stringify(clash.body));
    assert.equal(problemOf(clash).code, 'SUBNET_IN_USE');
    const bad = await c.request('POST', '/v1/networks', { as: 'acme', body: { name: '', extra: 1 } });
    assert.equal(bad.status, 400, JSON.stringify(bad.body));
    ok(await c.request('DELETE', `/v1/networks/${first.id}`, { as: 'acme' }));
  });
});
