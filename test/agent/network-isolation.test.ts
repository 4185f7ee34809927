import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm, rmdir, writeFile } from 'node:fs/promises';
import { connect, createServer, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { ProcessBackend, type ProcessBackendOptions } from '../../packages/agent/src/backend/process/process-backend.js';
import { allocateBridge, allocateVeth, hash8, parseSubnet } from '../../packages/agent/src/backend/process/network.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { REPO_ROOT } from './harness.js';
import { collect, type Ran } from '../support/process.js';

/**
 * The sandbox network boundary attacked from a sandbox's own link, on real
 * sandboxes (in-process backend). Where an attack needs more than the guest
 * has (a route through the gateway, a second address, a crafted frame), the
 * test does it as host root inside the sandbox's network namespace only
 * (nsenter -n): that is what a guest holding CAP_NET_RAW can put on the
 * wire, so the rules must hold against it.
 *
 * Host-global changes (sysctls, a dummy link, nftables tables) are undone
 * in `after`, whatever failed.
 */

function missingFeature(): string | undefined {
  if (process.platform !== 'linux') return 'Linux';
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  for (const [tool, pkg] of [
    ['nft', 'nftables'],
    ['nsenter', 'util-linux'],
    ['ip', 'iproute2'],
  ] as const) {
    if (spawnSync('sh', ['-c', `command -v ${tool}`]).status !== 0) return `${tool} (${pkg})`;
  }
  if (!existsSync('/proc/sys/net/ipv6')) return 'IPv6 in the kernel (the router-advertisement attack needs it)';
  return undefined;
}

const skip = missingFeature();
if (skip) console.log(`# SKIP network isolation tests: host feature missing: ${skip}`);

const run = (cmd: string, args: string[]): { status: number | null; stdout: string; stderr: string } => {
  const r = spawnSync(cmd, args, { encoding: 'utf8', timeout: 20_000 });
  return { status: r.status, stdout: r.stdout ?? '', stderr: r.stderr ?? '' };
};
const must = (cmd: string, args: string[]): string => {
  const r = run(cmd, args);
  assert.equal(r.status, 0, `${cmd} ${args.join(' ')}: ${r.stderr}`);
  return r.stdout;
};
/** As root inside only the network namespace of a sandbox's init. */
const inNetns = (pid: number, args: string[]) => run('nsenter', ['-t', String(pid), '-n', '--', ...args]);

const sh = async (b: ProcessBackend, name: string, script: string): Promise<Ran> =>
  collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }));
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('network isolation: pure parts', () => {
  test('bridge names come from a per-agent allocation, not a hash: tenants never share one', () => {
    assert.equal(allocateBridge('fb', 'a', false, []), 'fbb0');
    assert.equal(allocateBridge('fb', 'b', false, [{ tenant: 'a', bridge: 'fbb0' }]), 'fbb1');
    assert.equal(allocateBridge('fb', 'a', false, [{ tenant: 'a', bridge: 'fbb1' }]), 'fbb1', 'a tenant joins its own bridge');
    // State written by an older agent: a hash name is kept for its tenant, unless two tenants collided on it.
    assert.equal(allocateBridge('fb', 'a', false, [{ tenant: 'a', bridge: 'fbbdeadbeef' }]), 'fbbdeadbeef');
    const collided = [
      { tenant: 'a', bridge: 'fbbdeadbeef' },
      { tenant: 'b', bridge: 'fbbdeadbeef' },
    ];
    assert.equal(allocateBridge('fb', 'a', false, collided), 'fbb0', 'a bridge two tenants share is joined by neither');
    assert.equal(allocateBridge('fb', 'a', true, collided), 'fbbshared');
    assert.equal(allocateBridge('abcde', 'x', false, []).length <= 15, true);
    assert.equal(allocateVeth('fb', ['fbv0', 'fbv2']), 'fbv1');
  });
});

describe('network isolation: real sandboxes', { skip, timeout: 300_000 }, () => {
  let root: string;
  let b: ProcessBackend;
  let opts: ProcessBackendOptions;
  let prefix: string;
  let gateway: string;
  /** The compiled router-advertisement sender; undefined without a C compiler. */
  let raSend: string | undefined;
  const sysctls = new Map<string, string>();
  const dummy = `n${randomBytes(2).toString('hex')}md`;

  /** Writes a sysctl, remembering the first value seen so `after` (and the test's own finally) put it back. */
  async function setSysctl(path: string, value: string): Promise<void> {
    if (!sysctls.has(path)) sysctls.set(path, (await readFile(path, 'utf8')).trim());
    await writeFile(path, value);
  }
  async function restoreSysctls(): Promise<void> {
    // ip_forward first: writing it resets every interface's forwarding, which the per-link values then override.
    const entries = [...sysctls.entries()].sort(([a], [b]) => Number(b.endsWith('/ip_forward')) - Number(a.endsWith('/ip_forward')));
    for (const [path, value] of entries) await writeFile(path, value).catch(() => undefined);
    sysctls.clear();
  }

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'netiso-'));
    const imageDir = join(root, 'images');
    await buildImage(imageDir, 'base');
    prefix = `n${randomBytes(2).toString('hex')}`;
    opts = {
      dataDir: join(root, 'data'),
      imageDir,
      subnet: `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`,
      bridgePrefix: prefix,
      maxSandboxes: 16,
    };
    gateway = parseSubnet(opts.subnet!).gateway;
    b = await ProcessBackend.open(opts);
    if (run('sh', ['-c', 'command -v gcc']).status === 0) {
      raSend = join(root, 'ra-send');
      must('gcc', ['-O1', '-o', raSend, join(REPO_ROOT, 'test/agent/fixtures/ra-send.c')]);
    }
  });

  after(async () => {
    await restoreSysctls();
    for (const s of (await b?.list().catch(() => [])) ?? []) await b.destroy(s.name).catch(() => undefined);
    await b?.prune().catch(() => undefined);
    await b?.close().catch(() => undefined);
    for (const family of ['inet', 'bridge']) run('nft', ['delete', 'table', family, `fleet_${prefix}`]);
    const links = run('ip', ['-j', 'link', 'show']).stdout;
    for (const l of (JSON.parse(links || '[]') as Array<{ ifname: string }>).map((x) => x.ifname.split('@')[0]!)) {
      if (l.startsWith(prefix) || l === dummy) run('ip', ['link', 'del', l]);
    }
    for (const c of ['', 'cpu', 'memory', 'pids', 'freezer'])
      await rmdir(join('/sys/fs/cgroup', c, `fleet-${prefix}`)).catch(() => undefined);
    if (root) await rm(root, { recursive: true, force: true });
  });

  // Every sandbox here holds CAP_NET_RAW (net_raw: true): the boundary must hold against raw sockets,
  // and a ping that fails for want of one would make each "cannot reach" below pass for the wrong reason.
  test('tenants whose ids collide in a 32-bit hash get bridges of their own and cannot reach each other', async () => {
    // The old scheme named a tenant's bridge <prefix>b<hash8(tenant)>: a birthday search finds two tenants sharing one.
    const seen = new Map<string, string>();
    let pair: [string, string] | undefined;
    for (let i = 0; !pair; i++) {
      const tenant = `t${i}`;
      const h = hash8(tenant);
      const other = seen.get(h);
      if (other) pair = [other, tenant];
      else seen.set(h, tenant);
    }
    const [t1, t2] = pair;
    assert.equal(hash8(t1), hash8(t2));
    const one = await b.create({ name: 'coll-1', cpus: 1, ram_mb: 64, net_raw: true, tenant: t1 });
    const two = await b.create({ name: 'coll-2', cpus: 1, ram_mb: 64, net_raw: true, tenant: t2 });
    const peer = await b.create({ name: 'coll-3', cpus: 1, ram_mb: 64, net_raw: true, tenant: t1 });
    try {
      assert.notEqual(b.networkOf('coll-1').bridge, b.networkOf('coll-2').bridge, `tenants ${t1} and ${t2} share a bridge`);
      assert.equal(b.networkOf('coll-1').bridge, b.networkOf('coll-3').bridge, 'one tenant, one bridge');
      assert.equal((await sh(b, 'coll-1', `ping -c 1 -W 1 ${peer.ip}`)).exitCode, 0, 'same tenant reaches its peer');
      assert.notEqual((await sh(b, 'coll-1', `ping -c 1 -W 1 ${two.ip}`)).exitCode, 0, `${t1} reached ${t2}`);
      assert.notEqual((await sh(b, 'coll-2', `ping -c 1 -W 1 ${one.ip}`)).exitCode, 0, `${t2} reached ${t1}`);
    } finally {
      for (const n of ['coll-1', 'coll-2', 'coll-3']) await b.destroy(n);
    }
  });

  test('with ip_forward=1, forwarding on every bridge and routes through the gateway, one tenant still cannot reach another', async () => {
    const a1 = await b.create({ name: 'fwd-a', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'alpha' });
    const b1 = await b.create({ name: 'fwd-b', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'beta' });
    const listener = await b.spawn('fwd-b', { argv: ['/bin/sh', '-c', 'nc -l -p 7000'], stdin: false });
    const heard = collect(listener, 30_000);
    try {
      // What a guest with raw sockets can do anyway: hand the gateway a packet for the other tenant.
      assert.equal(inNetns(a1.init_pid, ['ip', 'route', 'add', `${b1.ip}/32`, 'via', gateway]).status, 0);
      assert.equal(inNetns(b1.init_pid, ['ip', 'route', 'add', `${a1.ip}/32`, 'via', gateway]).status, 0);
      await setSysctl('/proc/sys/net/ipv4/ip_forward', '1');
      for (const n of ['fwd-a', 'fwd-b']) await setSysctl(`/proc/sys/net/ipv4/conf/${b.networkOf(n).bridge}/forwarding`, '1');
      assert.equal((await readFile(`/proc/sys/net/ipv4/conf/${b.networkOf('fwd-a').bridge}/forwarding`, 'utf8')).trim(), '1');

      const ping = await sh(b, 'fwd-a', `ping -c 2 -W 1 ${b1.ip}`);
      assert.notEqual(ping.exitCode, 0, `tenant alpha pinged tenant beta through the host:\n${ping.stdout}`);
      const tcp = await sh(b, 'fwd-a', `echo across | nc -w 2 ${b1.ip} 7000`);
      assert.notEqual(tcp.exitCode, 0, 'tenant alpha opened a TCP connection to tenant beta');
      const back = await sh(b, 'fwd-b', `ping -c 1 -W 1 ${a1.ip}`);
      assert.notEqual(back.exitCode, 0, 'tenant beta pinged tenant alpha through the host');

      // The reassert finds the flipped bridges and turns them off again.
      const report = await b.reassertNetwork();
      for (const n of ['fwd-a', 'fwd-b']) {
        const br = b.networkOf(n).bridge;
        assert.ok(
          report.repairs.some((r) => r.includes(`ipv4.conf.${br}.forwarding was 1`)),
          JSON.stringify(report),
        );
        assert.equal((await readFile(`/proc/sys/net/ipv4/conf/${br}/forwarding`, 'utf8')).trim(), '0');
      }
    } finally {
      await restoreSysctls();
      listener.kill('SIGKILL');
      assert.doesNotMatch((await heard).stdout, /across/, 'the listener of tenant beta heard tenant alpha');
      for (const n of ['fwd-a', 'fwd-b']) await b.destroy(n);
    }
  });

  test('a sandbox reaches no host address (gateway, another host address, 169.254.169.254), while the host still reaches it', async () => {
    // A link-local "metadata" address and a second host address, on a link of the test's own.
    must('ip', ['link', 'add', dummy, 'type', 'bridge']); // a bridge, not a dummy: some kernels lack the dummy driver
    must('ip', ['addr', 'add', '169.254.169.254/32', 'dev', dummy]);
    must('ip', ['addr', 'add', '192.0.2.10/32', 'dev', dummy]);
    must('ip', ['link', 'set', dummy, 'up']);
    const accepted: Socket[] = [];
    const server = createServer((s) => {
      accepted.push(s);
      s.end('host-service\n');
    });
    await new Promise<void>((r) => server.listen(0, '0.0.0.0', r));
    const port = (server.address() as { port: number }).port;
    const s = await b.create({ name: 'host-probe', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'gamma' });
    try {
      for (const addr of [gateway, '192.0.2.10', '169.254.169.254']) {
        const r = await sh(b, 'host-probe', `nc -w 2 ${addr} ${port} </dev/null`);
        assert.notEqual(r.exitCode, 0, `the sandbox reached ${addr}:${port} on the host: ${r.stdout}`);
      }
      assert.notEqual((await sh(b, 'host-probe', `ping -c 1 -W 1 ${gateway}`)).exitCode, 0, 'the sandbox pinged the gateway');
      assert.equal(accepted.length, 0, 'the host service accepted a connection from a sandbox');

      // Host → sandbox (the endpoint proxies, in-guest agents) is untouched.
      const guest = await b.spawn('host-probe', { argv: ['/bin/sh', '-c', 'echo from-guest | nc -l -p 7001'], stdin: false });
      const guestDone = collect(guest);
      let got = '';
      for (let i = 0; i < 50 && !got; i++) {
        got = await new Promise<string>((resolve) => {
          const c = connect(7001, s.ip);
          let buf = '';
          c.on('data', (d) => (buf += d.toString()));
          c.on('close', () => resolve(buf));
          c.on('error', () => resolve(''));
        });
        if (!got) await sleep(100);
      }
      assert.equal(got, 'from-guest\n');
      await guestDone;
    } finally {
      server.close();
      for (const c of accepted) c.destroy();
      run('ip', ['link', 'del', dummy]);
      await b.destroy('host-probe');
    }
  });

  test('a router advertisement sent on a sandbox link installs no route, on the host or in a peer sandbox; IPv6 is off on the bridge and veth', async (t) => {
    if (!raSend) {
      t.skip('no C compiler to build the router-advertisement sender (apt-get install gcc libc6-dev)');
      return;
    }
    const s = await b.create({ name: 'ra', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'delta' });
    const peer = await b.create({ name: 'ra-peer', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'delta' });
    try {
      const { bridge, veth } = b.networkOf('ra');
      const sysctl = async (link: string, key: string) => (await readFile(`/proc/sys/net/ipv6/conf/${link}/${key}`, 'utf8')).trim();
      assert.equal(await sysctl(bridge, 'disable_ipv6'), '1');
      assert.equal(await sysctl(bridge, 'accept_ra'), '0');
      assert.equal(await sysctl(veth, 'disable_ipv6'), '1');
      assert.equal(await sysctl(veth, 'accept_ra'), '0');
      const n = randomBytes(2).readUInt16BE(0) | 0x100;
      const prefixHex = `20010db8ff00${n.toString(16).padStart(4, '0')}`;
      const prefix6 = `2001:db8:ff00:${n.toString(16)}::`;
      const hostRoutesBefore = must('ip', ['-6', 'route', 'show']);
      assert.doesNotMatch(hostRoutesBefore, new RegExp(prefix6));

      const sent = inNetns(s.init_pid, [raSend, 'eth0', prefixHex]);
      assert.equal(sent.status, 0, `the advertisement was not sent: ${sent.stderr}`);
      await sleep(1000);

      const hostRoutes = must('ip', ['-6', 'route', 'show']);
      assert.doesNotMatch(hostRoutes, new RegExp(prefix6), 'the host installed the advertised prefix');
      for (const link of [bridge, veth])
        assert.doesNotMatch(hostRoutes, new RegExp(`dev ${link}\\b`), `the host has an IPv6 route through ${link}`);
      assert.doesNotMatch(must('ip', ['-6', 'addr', 'show', 'dev', bridge]), /inet6/, 'the bridge has an IPv6 address');
      const peerRoutes = inNetns(peer.init_pid, ['ip', '-6', 'route', 'show']).stdout;
      assert.doesNotMatch(peerRoutes, new RegExp(prefix6), 'a peer sandbox accepted the advertisement');
      assert.doesNotMatch(peerRoutes, /^default/m, 'a peer sandbox took the sender as its IPv6 router');
    } finally {
      await b.destroy('ra');
      await b.destroy('ra-peer');
    }
  });

  test('a sandbox cannot speak with an address or MAC that is not its own', async () => {
    const a = await b.create({ name: 'spoof-a', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'epsilon' });
    const v = await b.create({ name: 'spoof-v', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'epsilon' });
    try {
      assert.equal(inNetns(a.init_pid, ['/bin/busybox', 'ping', '-c', '1', '-W', '1', v.ip]).status, 0, 'its own address works');
      const forged = gateway.replace(/\.1$/, '.233');
      assert.equal(inNetns(a.init_pid, ['ip', 'addr', 'add', `${forged}/32`, 'dev', 'eth0']).status, 0);
      const r = inNetns(a.init_pid, ['/bin/busybox', 'ping', '-c', '2', '-W', '1', '-I', forged, v.ip]);
      assert.notEqual(r.status, 0, `a ping from the forged address ${forged} was answered:\n${r.stdout}`);
      // Another MAC: the frames never reach the peer, so its ARP entry for the sandbox cannot be replaced.
      assert.equal(inNetns(a.init_pid, ['ip', 'addr', 'del', `${forged}/32`, 'dev', 'eth0']).status, 0);
      assert.equal(inNetns(a.init_pid, ['ip', 'link', 'set', 'eth0', 'address', '02:de:ad:be:ef:01']).status, 0);
      // The peer must learn the sandbox's MAC afresh (from frames the port now drops).
      assert.equal(inNetns(v.init_pid, ['ip', 'neigh', 'flush', 'dev', 'eth0']).status, 0);
      assert.notEqual(
        inNetns(a.init_pid, ['/bin/busybox', 'ping', '-c', '2', '-W', '1', v.ip]).status,
        0,
        'frames from a forged MAC got through',
      );
    } finally {
      await b.destroy('spoof-a');
      await b.destroy('spoof-v');
    }
  });

  test('reassert puts back a deleted or edited table and a flipped sysctl, and counts each; a clean state reports nothing', async () => {
    await b.create({ name: 'reassert', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'zeta' });
    try {
      const { bridge } = b.networkOf('reassert');
      assert.equal((await b.reassertNetwork()).repaired, 0, 'nothing drifted yet');

      must('nft', ['delete', 'table', 'inet', `fleet_${prefix}`]);
      let r = await b.reassertNetwork();
      assert.deepEqual(r.repairs, [`nftables table inet fleet_${prefix} missing`]);
      assert.equal(r.repaired, 1);
      assert.equal(run('nft', ['list', 'table', 'inet', `fleet_${prefix}`]).status, 0, 'the table is back');

      must('nft', ['delete', 'table', 'bridge', `fleet_${prefix}`]);
      r = await b.reassertNetwork();
      assert.deepEqual(r.repairs, [`nftables table bridge fleet_${prefix} missing`]);

      must('nft', ['flush', 'chain', 'inet', `fleet_${prefix}`, 'forward']);
      r = await b.reassertNetwork();
      assert.equal(r.repaired, 1);
      assert.match(r.repairs[0]!, /changed/);
      assert.match(must('nft', ['list', 'chain', 'inet', `fleet_${prefix}`, 'forward']), /oifname @bridges drop/);

      await setSysctl(`/proc/sys/net/ipv6/conf/${bridge}/disable_ipv6`, '0');
      r = await b.reassertNetwork();
      assert.deepEqual(r.repairs, [`sysctl net.ipv6.conf.${bridge}.disable_ipv6 was 0, set to 1`]);
      sysctls.delete(`/proc/sys/net/ipv6/conf/${bridge}/disable_ipv6`);

      assert.equal((await b.reassertNetwork()).repaired, 0);
    } finally {
      await b.destroy('reassert');
    }
  });

  test('with no sandbox left, the tables, bridges and veths are gone, and prune finds nothing more', async () => {
    await b.create({ name: 'last', cpus: 1, ram_mb: 64, net_raw: true, tenant: 'eta' });
    assert.equal(run('nft', ['list', 'table', 'inet', `fleet_${prefix}`]).status, 0);
    await b.destroy('last');
    for (const family of ['inet', 'bridge'])
      assert.notEqual(run('nft', ['list', 'table', family, `fleet_${prefix}`]).status, 0, `table ${family} fleet_${prefix} left behind`);
    const links = (JSON.parse(must('ip', ['-j', 'link', 'show'])) as Array<{ ifname: string }>).map((l) => l.ifname);
    assert.deepEqual(
      links.filter((l) => l.startsWith(prefix)),
      [],
    );
    const report = await b.prune();
    assert.deepEqual([report.bridges, report.veths, report.errors], [[], [], []]);
    assert.equal((await b.reassertNetwork()).repaired, 0, 'no sandbox, no table: nothing to repair');
  });
});
