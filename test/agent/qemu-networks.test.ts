import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { AppError } from '@fleet/agent-protocol';
import { buildQemuImage } from '../../packages/agent/src/backend/qemu/image.js';
import { startAgent, type RunningAgent } from './harness.js';

/**
 * Cluster networks on a qemu host (backend.go.txt CreateNetwork/Reserve):
 * each network's VMs share a bridge of their own, with addresses inside the
 * network's subnet. ONE cold boot under TCG (n1 on network x, serving HTTP);
 * the other VMs are forks of its live snapshot joined to x, to y, or to no
 * network. Under CI=true a missing prerequisite fails the file.
 */

const NET = { prefix: 'qnw', subnet: '10.251.27.0/24' };
const X = { id: 'net-x', subnet: '10.251.27.64/28' };
const Y = { id: 'net-y', subnet: '10.251.27.80/28' };

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
if (lack && process.env.CI === 'true') throw new Error(`qemu network tests need ${lack} under CI`);

const alive = (pid: number): boolean => {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return !/^[ZX]/.test(stat.slice(stat.lastIndexOf(')') + 2));
  } catch {
    return false;
  }
};

const inSubnet = (ip: string, cidr: string): boolean => {
  const toInt = (a: string): number => a.split('.').reduce((n, p) => ((n << 8) | Number(p)) >>> 0, 0);
  const [base, len] = cidr.split('/');
  const mask = len === '0' ? 0 : (~0 << (32 - Number(len))) >>> 0;
  return (toInt(ip) & mask) >>> 0 === (toInt(base!) & mask) >>> 0;
};

describe('qemu backend: cluster networks', { skip: lack ? `missing ${lack}` : false, timeout: 600_000 }, () => {
  let root: string | undefined;
  let agent: RunningAgent | undefined;
  const ips = { n1: '', n2: '', n3: '', n4: '' };

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'fleet-qemu-net-'));
    const imageDir = join(root, 'images');
    await buildQemuImage(imageDir, 'base');
    agent = await startAgent(
      {
        dataDir: join(root, 'data'),
        imageDir,
        subnet: NET.subnet,
        bridgePrefix: NET.prefix,
        env: { AGENT_BACKEND: 'qemu', AGENT_QEMU_ACCEL: 'tcg', AGENT_LOG_LEVEL: 'warn' },
      },
      60_000,
    );
  });

  after(async () => {
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
    for (const m of links.matchAll(/^\d+: (qnwv[tb]\w+)[:@]/gm)) spawnSync('ip', ['link', 'del', m[1]!], { stdio: 'ignore' });
    for (const fam of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', fam, 'fleet_qnwv'], { stdio: 'ignore' });
    if (root) await rm(root, { recursive: true, force: true });
  });

  const base = { cpus: 1, ram_mb: 192, tenant: 't1', egress: { mode: 'none' as const } };
  /** An HTTP GET from `from` to `ip`:8080 through the guest's own nc: the answer's text, empty when nothing answered. */
  const fetchFrom = async (from: string, ip: string): Promise<string> =>
    (
      await agent!.client.exec(from, {
        argv: ['sh', '-c', `printf 'GET /who HTTP/1.0\\r\\n\\r\\n' | nc -w 3 ${ip} 8080; true`],
        timeout_ms: 20_000,
      })
    ).stdout;

  it('a member gets an address of its network and a bridge of its own; bad network input is refused before QEMU', async () => {
    const a = agent!;
    await assert.rejects(
      a.client.createVm({ ...base, name: 'qnw-bad', network: { id: 'net-z', subnet: '10.99.0.0/28' } }),
      (e: AppError) => e.code === 'INVALID_SANDBOX_SPEC' && /inside this host's sandbox subnet/.test(e.message),
    );
    await assert.rejects(
      a.client.createVm({ ...base, name: 'qnw-bad', network: X, ip_hint: '10.251.27.90' }),
      (e: AppError) => e.code === 'INVALID_SANDBOX_SPEC' && /ip_hint/.test(e.message),
    );
    assert.equal((await a.client.listVms()).length, 0, 'nothing half-made');

    const started = Date.now();
    const n1 = await a.client.createVm({ ...base, name: 'qnw-n1', network: X, ip_hint: '10.251.27.70' }, { timeoutMs: 300_000 });
    console.log(`# boot to first exec: ${Date.now() - started} ms`);
    assert.equal(n1.ip, '10.251.27.70', 'the hint, free in the network');
    ips.n1 = n1.ip!;
    const r = await a.client.exec('qnw-n1', {
      argv: ['sh', '-c', 'echo n1 > /root/who; setsid httpd -p 8080 -h /root </dev/null >/dev/null 2>&1 & echo started'],
    });
    assert.equal(r.stdout.trim(), 'started');
  });

  it('forks join x, y or no network: x members reach each other, y and the tenant bridge reach nothing of x', async () => {
    const a = agent!;
    await a.client.checkpoint('qnw-n1', { live: true, id: 'qnw-cp' }, { timeoutMs: 180_000 });
    const fork = async (name: string, network?: typeof X): Promise<string> => {
      const f = await a.client.createVm(
        { ...base, name, checkpoint_id: 'qnw-cp', resume: true, ...(network ? { network } : {}) },
        { timeoutMs: 300_000 },
      );
      assert.equal(f.state, 'running');
      return f.ip!;
    };
    ips.n2 = await fork('qnw-n2', X);
    ips.n3 = await fork('qnw-n3', Y);
    ips.n4 = await fork('qnw-n4');
    assert.ok(inSubnet(ips.n2, X.subnet), `n2 ${ips.n2} in ${X.subnet}`);
    assert.ok(inSubnet(ips.n3, Y.subnet), `n3 ${ips.n3} in ${Y.subnet}`);
    assert.ok(!inSubnet(ips.n4, X.subnet) && !inSubnet(ips.n4, Y.subnet), `n4 ${ips.n4} in no network's range`);
    const addr = (await a.client.exec('qnw-n2', { argv: ['sh', '-c', 'ip -o -4 addr show dev eth0'] })).stdout;
    assert.match(addr, new RegExp(`inet ${ips.n2.replace(/\./g, '\\.')}/`), 'the guest took its new address');

    assert.match(await fetchFrom('qnw-n2', ips.n1), /n1/, 'a member of x reaches another');
    assert.match(await fetchFrom('qnw-n1', ips.n2), /n1/, 'both ways (the fork serves the same files)');
    assert.doesNotMatch(await fetchFrom('qnw-n3', ips.n1), /n1/, 'a member of y does not reach x');
    assert.doesNotMatch(await fetchFrom('qnw-n4', ips.n1), /n1/, 'the tenant bridge does not reach x');
    assert.doesNotMatch(await fetchFrom('qnw-n1', ips.n3), /n1/, 'nor x reach y');

    const bridgeOf = (name: string): string =>
      (JSON.parse(readFileSync(join(root!, 'data', 'qemu/vms', name, 'state.json'), 'utf8')) as { bridge: string }).bridge;
    assert.equal(bridgeOf('qnw-n1'), bridgeOf('qnw-n2'), 'one bridge per network');
    assert.equal(new Set(['qnw-n1', 'qnw-n3', 'qnw-n4'].map(bridgeOf)).size, 3, 'x, y and the tenant each on its own');
  });

  it('destroying the members removes their bridges', async () => {
    const a = agent!;
    for (const n of ['qnw-n1', 'qnw-n2', 'qnw-n3', 'qnw-n4']) await a.client.destroyVm(n, { force: true });
    await a.client.deleteCheckpoint('qnw-cp');
    const links = spawnSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' }).stdout;
    assert.doesNotMatch(links, /^\d+: qnwv[tb]/m, 'no tap or bridge left');
  });
});
