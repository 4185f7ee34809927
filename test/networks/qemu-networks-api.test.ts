import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { buildQemuImage } from '../../packages/agent/src/backend/qemu/image.js';
import { startAgent, type RunningAgent } from '../agent/harness.js';
import { registerHost, startControlPlane, type ControlPlane, type Reply } from '../support/control-plane.js';

/**
 * Tenant networks (`network_id`) on a qemu host through the API: three real
 * VMs under TCG (two members of one network, one of another), booted at
 * once. Under CI=true a missing prerequisite fails the file.
 */

const Q = { prefix: 'qna', subnet: '10.251.37.0/24' };

function missing(): string | undefined {
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/dev/net/tun')) return '/dev/net/tun';
  for (const tool of ['qemu-system-x86_64', 'qemu-img', 'gcc', 'mke2fs', 'cpio', 'nft']) {
    if (spawnSync('sh', ['-c', `command -v ${tool}`]).status !== 0) return tool;
  }
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  if (!spawnSync('sh', ['-c', 'ls /boot/vmlinuz-*']).stdout.length) return 'linux-image-amd64';
  return undefined;
}
const lack = missing();
if (lack && process.env.CI === 'true') throw new Error(`qemu network API tests need ${lack} under CI`);

const alive = (pid: number): boolean => {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return !/^[ZX]/.test(stat.slice(stat.lastIndexOf(')') + 2));
  } catch {
    return false;
  }
};

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

const SERVE = (who: string): string => `echo ${who} > /root/who; setsid httpd -p 8080 -h /root </dev/null >/dev/null 2>&1 & echo started`;

describe('tenant networks on a qemu host, through the API', { skip: lack ? `missing ${lack}` : false, timeout: 600_000 }, () => {
  let root: string | undefined;
  let agent: RunningAgent | undefined;
  let cp: ControlPlane | undefined;

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'fleet-qemu-netapi-'));
    const imageDir = join(root, 'images');
    await buildQemuImage(imageDir, 'base');
    agent = await startAgent(
      {
        dataDir: join(root, 'data'),
        imageDir,
        subnet: Q.subnet,
        bridgePrefix: Q.prefix,
        env: { AGENT_BACKEND: 'qemu', AGENT_QEMU_ACCEL: 'tcg', AGENT_LOG_LEVEL: 'warn' },
      },
      60_000,
    );
    cp = await startControlPlane({
      env: {
        NETWORK_POOL: '10.251.37.128/25',
        NETWORK_PREFIX_LEN: '28',
        EXEC_DEFAULT_TIMEOUT_MS: '30000',
        AGENT_CALL_TIMEOUT_MS: '300000',
        CPU_OVERCOMMIT_RATIO: '16',
      },
    });
    ok(await registerHost(cp, 'q1', agent, { backend: 'qemu' }), 201);
  });

  after(async () => {
    await cp?.close();
    if (agent) {
      for (const v of await agent.client.listVms().catch(() => []))
        await agent.client.destroyVm(v.name, { force: true }).catch(() => undefined);
      await agent.client.prune().catch(() => undefined);
      await agent.stop();
    }
    const vms = join(root ?? '/nonexistent', 'data', 'qemu/vms');
    for (const name of spawnSync('ls', [vms], { encoding: 'utf8' }).stdout.split('\n').filter(Boolean)) {
      const pid = Number(spawnSync('cat', [join(vms, name, 'qemu.pid')], { encoding: 'utf8' }).stdout.trim());
      if (pid > 0 && alive(pid)) process.kill(pid, 'SIGKILL');
    }
    const links = spawnSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const m of links.matchAll(/^\d+: (qnav[tb]\w+)[:@]/gm)) spawnSync('ip', ['link', 'del', m[1]!], { stdio: 'ignore' });
    for (const fam of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', fam, 'fleet_qnav'], { stdio: 'ignore' });
    if (root) await rm(root, { recursive: true, force: true });
  });

  it('members of one network reach each other; a member of another network does not', async (t) => {
    const c = cp!;
    const netA = ok(await c.request('POST', '/v1/networks', { as: 'acme', body: { name: 'qa' } }), 201);
    const netB = ok(await c.request('POST', '/v1/networks', { as: 'acme', body: { name: 'qb' } }), 201);
    const started = Date.now();
    const create = async (network_id: string): Promise<{ id: string; ip: string }> =>
      ok(
        await c.request('POST', '/v1/vms', {
          as: 'acme',
          body: { host_id: 'q1', cpus: 1, ram_mb: 192, egress: { mode: 'none' }, network_id },
        }),
        201,
      );
    const [a1, a2, b1] = await Promise.all([create(netA.id), create(netA.id), create(netB.id)]);
    t.diagnostic(`three VMs booted at once under TCG: ${Date.now() - started} ms`);
    const exec = async (vm: string, cmd: string): Promise<string> =>
      ok(await c.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['sh', '-c', cmd], timeout_ms: 20_000 } })).stdout;
    const ipOf = async (vm: string): Promise<string> => (await exec(vm, 'ip -o -4 addr show dev eth0')).match(/inet ([\d.]+)\//)![1]!;
    const inside = (ip: string, subnet: string): boolean => {
      const [base, len] = subnet.split('/');
      const n = (a: string): number => a.split('.').reduce((x, p) => ((x << 8) | Number(p)) >>> 0, 0);
      const mask = (~0 << (32 - Number(len))) >>> 0;
      return (n(ip) & mask) >>> 0 === (n(base!) & mask) >>> 0;
    };
    const ips = { a1: await ipOf(a1.id), a2: await ipOf(a2.id), b1: await ipOf(b1.id) };
    assert.ok(inside(ips.a1, netA.subnet) && inside(ips.a2, netA.subnet), `${JSON.stringify(ips)} in ${netA.subnet}`);
    assert.ok(inside(ips.b1, netB.subnet), `${ips.b1} in ${netB.subnet}`);
    for (const [vm, who] of [
      [a1.id, 'a1'],
      [b1.id, 'b1'],
    ] as const)
      assert.equal((await exec(vm, SERVE(who))).trim(), 'started');
    const get = (from: string, ip: string): Promise<string> =>
      exec(from, `printf 'GET /who HTTP/1.0\\r\\n\\r\\n' | nc -w 3 ${ip} 8080; true`);
    assert.match(await get(a2.id, ips.a1), /a1/, 'a member reaches another of its network');
    assert.doesNotMatch(await get(b1.id, ips.a1), /a1/, 'a member of another network does not');
    assert.doesNotMatch(await get(a2.id, ips.b1), /b1/, 'nor the other way');
    for (const vm of [a1, a2, b1]) ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
    assert.equal((await agent!.client.listVms()).length, 0);
  });
});
