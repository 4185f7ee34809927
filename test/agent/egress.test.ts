import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdtemp, rm, rmdir } from 'node:fs/promises';
import { createServer, type Server } from 'node:net';
import { networkInterfaces, tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { domainMatches, egressSpecProblems, egressSpecSchema, parseEgressRule } from '@fleet/agent-protocol';
import { ProcessBackend } from '../../packages/agent/src/backend/process/process-backend.js';
import { decide, type EgressHostConfig, type SandboxEgress } from '../../packages/agent/src/backend/process/egress.js';
import { serverName } from '../../packages/agent/src/backend/process/egress-proxy.js';
import { parseSubnet } from '../../packages/agent/src/backend/process/network.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { REPO_ROOT } from './harness.js';
import { collect, type Ran } from '../support/process.js';
import { startTestInternet, type TestInternet } from '../support/test-internet.js';

/**
 * Egress attacked from real sandboxes (in-process backend) towards a test
 * "internet" (a namespace the test makes, test/support/test-internet.ts):
 * direct NAT, none, allow/deny by CIDR, the agent's proxy with domain rules
 * by HTTP Host and TLS SNI, and what no mode may reach: the host's own
 * addresses and services, another tenant, 169.254.169.254, private
 * networks by default. Every object made here carries the test's prefix and
 * is removed in `after`, whatever failed.
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
  return undefined;
}
const skip = missingFeature();
if (skip) console.log(`# SKIP egress tests: host feature missing: ${skip}`);

const cfg: EgressHostConfig = { subnet: '10.213.0.0/16', gateway: '10.213.0.1', proxyPort: 3128, allowPrivate: ['10.99.0.0/16'] };
const policy = (p: Partial<SandboxEgress>): SandboxEgress => ({ mode: 'proxy', allow_out: [], deny_out: [], ...p });
const judge = (e: SandboxEgress, ip: string, name?: string) => decide(e, cfg, new Set(['192.0.2.7']), { ip, name }, domainMatches).allow;

describe('egress: pure parts', () => {
  test('rules: IPv4, CIDR and domain names; anything else refused with a reason', () => {
    assert.deepEqual(parseEgressRule('10.0.0.0/8'), { kind: 'cidr', network: 0x0a000000, prefixLen: 8 });
    assert.deepEqual(parseEgressRule('1.2.3.4'), { kind: 'cidr', network: 0x01020304, prefixLen: 32 });
    assert.deepEqual(parseEgressRule('*.Example.com'), { kind: 'domain', pattern: '*.example.com' });
    for (const bad of ['10.0.0.1/8', '300.1.1.1', '1.2.3.4/33', 'fe80::1', 'localhost', '*.', 'a..b', '01.2.3.4'])
      assert.equal(typeof parseEgressRule(bad), 'string', bad);
    assert.ok(domainMatches('*.example.com', 'a.b.example.com'));
    assert.ok(!domainMatches('*.example.com', 'example.com'), 'a wildcard does not cover the apex');
    assert.ok(!domainMatches('example.com', 'badexample.com'));
    assert.ok(!domainMatches('*.example.com', 'example.com.evil.net'));
  });

  test('policies: domain rules need a proxy, none takes no rules, proxy needs a provider', () => {
    const codes = (input: unknown) => egressSpecProblems(egressSpecSchema.parse(input)).map((p) => p.code);
    assert.deepEqual(codes({}), []);
    assert.deepEqual(codes({ mode: 'direct', allow_out: ['1.2.3.4'], deny_out: ['0.0.0.0/0'] }), []);
    assert.deepEqual(codes({ mode: 'direct', allow_out: ['example.com'] }), ['EGRESS_DOMAIN_RULES_NEED_PROXY']);
    assert.deepEqual(codes({ mode: 'none', deny_out: ['1.2.3.4'] }), ['VALIDATION_FAILED']);
    assert.deepEqual(codes({ mode: 'proxy' }), ['VALIDATION_FAILED']);
    assert.deepEqual(codes({ mode: 'direct', provider: 'x' }), ['VALIDATION_FAILED']);
    assert.equal(egressSpecSchema.safeParse({ mode: 'direct', allow_out: ['not a rule!'] }).success, false);
    assert.equal(egressSpecSchema.safeParse({ mode: 'direct', extra: 1 }).success, false);
  });

  test('the proxy decision: allow wins, a domain never opens a private or host address, the host and metadata never', () => {
    const open = policy({});
    assert.ok(judge(open, '198.51.100.5'));
    assert.ok(!judge(open, '10.1.2.3'), 'private by default');
    assert.ok(judge(open, '10.99.1.1'), 'the operator opened 10.99/16');
    assert.ok(!judge(open, '10.213.0.5'), 'the sandbox subnet');
    assert.ok(!judge(open, '192.0.2.7'), 'a host address');
    assert.ok(!judge(open, '127.0.0.1'));
    assert.ok(!judge(policy({ allow_out: ['169.254.0.0/16'] }), '169.254.169.254'), 'metadata is never opened');
    assert.ok(!judge(policy({ allow_out: ['0.0.0.0/0'] }), '192.0.2.7'), 'no allow opens the host');
    const list = policy({ allow_out: ['good.example.com', '198.51.100.9'], deny_out: ['0.0.0.0/0', '*.example.com'] });
    assert.ok(judge(list, '198.51.100.5', 'good.example.com'), 'a domain allow beats a CIDR deny');
    assert.ok(!judge(list, '198.51.100.5', 'bad.example.com'));
    assert.ok(!judge(list, '198.51.100.5'));
    assert.ok(judge(list, '198.51.100.9', 'bad.example.com'), 'an address allow beats a domain deny');
    assert.ok(!judge(list, '10.1.1.1', 'good.example.com'), 'a domain allow does not open a private address');
    assert.ok(judge(policy({ allow_out: ['10.1.0.0/16'] }), '10.1.1.1'), 'an address allow does');
  });

  test('the SNI of a real ClientHello is read; anything else has none', async () => {
    const { connect } = await import('node:tls');
    const { Duplex } = await import('node:stream');
    const hello = await new Promise<Buffer>((resolve) => {
      const fake = new Duplex({ read() {}, write: (chunk: Buffer) => resolve(chunk) });
      connect({ socket: fake, servername: 'Some.Example.test' }).on('error', () => undefined);
    });
    assert.equal(serverName(hello), 'some.example.test');
    assert.equal(serverName(Buffer.from('GET / HTTP/1.1\r\n\r\n')), undefined);
    assert.equal(serverName(Buffer.from([0x16, 3, 1, 0, 200, 1, 0])), undefined, 'a truncated hello');
  });
});

describe('egress: real sandboxes and a test internet', { skip, timeout: 600_000 }, () => {
  let root: string;
  let b: ProcessBackend;
  let prefix: string;
  let net: TestInternet;
  let gateway: string;
  let proxyPort: number;
  /** A service on every host address (what the agent, control plane and Postgres are to a sandbox). */
  let hostService: Server;
  let hostPort: number;
  const heard: string[] = [];

  const sh = async (name: string, script: string, timeoutMs = 20_000): Promise<Ran> =>
    collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }), timeoutMs);
  /**
   * An HTTP GET with nc (the base image's busybox wget crashes resolving), straight to `ip`, or through the
   * proxy as an absolute-form request; true when the test internet answered.
   */
  const get = async (name: string, target: string, opts: { proxy?: boolean; host?: string } = {}): Promise<boolean> => {
    const host = opts.host ?? target;
    const line = opts.proxy ? `GET http://${target}/ HTTP/1.0` : 'GET / HTTP/1.0';
    const to = opts.proxy ? `${gateway} ${proxyPort}` : `${target} 80`;
    const r = await sh(name, `printf '${line}\\r\\nHost: ${host}\\r\\n\\r\\n' | nc -w 3 ${to}`);
    lastOut = r.stdout;
    return /internet http/.test(r.stdout);
  };
  let lastOut = '';
  /**
   * An HTTPS request through the proxy, from inside the sandbox's network namespace (node is not in the image).
   * Asynchronous: the proxy runs in this process.
   */
  const viaConnect = async (name: string, target: string, sni: string): Promise<string> => {
    const pid = (await b.get(name)).init_pid;
    const child = spawn(
      'nsenter',
      [
        '-t',
        String(pid),
        '-n',
        '--',
        process.execPath,
        join(REPO_ROOT, 'test/agent/fixtures/egress-client.mjs'),
        `${gateway}:${proxyPort}`,
        target,
        sni,
      ],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let out = '';
    child.stdout.on('data', (d: Buffer) => (out += d.toString()));
    child.stderr.on('data', (d: Buffer) => (out += d.toString()));
    await new Promise((r) => child.once('close', r));
    return out.trim();
  };
  const hostAddrs = (): string[] =>
    Object.values(networkInterfaces())
      .flatMap((l) => l ?? [])
      .filter((a) => a.family === 'IPv4' && !a.internal)
      .map((a) => a.address)
      .slice(0, 4);

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'egress-'));
    const imageDir = join(root, 'images');
    await buildImage(imageDir, 'base');
    prefix = `e${randomBytes(2).toString('hex')}`;
    net = await startTestInternet(prefix, {
      'allowed.example.test': 'ip1',
      'denied.example.test': 'ip1',
      'other.test': 'ip2',
      'sneaky.example.test': 'private',
    });
    const subnet = `10.${240 + (randomBytes(1)[0]! % 9)}.${randomBytes(1)[0]!}.0/24`;
    gateway = parseSubnet(subnet).gateway;
    proxyPort = 20_000 + (randomBytes(2).readUInt16BE() % 20_000);
    hostService = createServer((s) => {
      heard.push(String(s.remoteAddress));
      s.end('host service\n');
    });
    await new Promise<void>((r) => hostService.listen(0, '0.0.0.0', r));
    hostPort = (hostService.address() as { port: number }).port;
    b = await ProcessBackend.open({
      dataDir: join(root, 'data'),
      imageDir,
      subnet,
      bridgePrefix: prefix,
      maxSandboxes: 16,
      egressProxyPort: proxyPort,
      egressDnsServers: [net.dns],
    });
  });

  after(async () => {
    const backend = b as ProcessBackend | undefined;
    for (const s of (await backend?.list().catch(() => [])) ?? []) await backend?.destroy(s.name).catch(() => undefined);
    await backend?.prune().catch(() => undefined);
    await backend?.close().catch(() => undefined);
    (hostService as Server | undefined)?.close();
    (net as TestInternet | undefined)?.remove();
    for (const family of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', family, `fleet_${prefix}`]);
    const links = spawnSync('ip', ['-j', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const l of (JSON.parse(links || '[]') as Array<{ ifname: string }>).map((x) => x.ifname.split('@')[0]!)) {
      if (prefix && l.startsWith(prefix)) spawnSync('ip', ['link', 'del', l]);
    }
    for (const c of ['', 'cpu', 'memory', 'pids', 'freezer'])
      await rmdir(join('/sys/fs/cgroup', c, `fleet-${prefix}`)).catch(() => undefined);
    if (root) await rm(root, { recursive: true, force: true });
  });

  test('direct reaches the internet through NAT; none reaches nothing', async () => {
    await b.create({ name: 'dir-1', cpus: 1, ram_mb: 64, tenant: 'acme', egress: { mode: 'direct', allow_out: [], deny_out: [] } });
    await b.create({ name: 'none-1', cpus: 1, ram_mb: 64, tenant: 'acme', egress: { mode: 'none', allow_out: [], deny_out: [] } });
    try {
      assert.ok(await get('dir-1', net.ip1), 'direct did not reach the internet');
      assert.match(lastOut, new RegExp(`internet http .* from=${net.hostIp.replaceAll('.', '\\.')}`), 'masqueraded to the host');
      assert.equal((await b.get('dir-1')).egress?.mode, 'direct');
      assert.ok(!(await get('none-1', net.ip1)), `none reached the internet: ${lastOut}`);
    } finally {
      await b.destroy('dir-1');
      await b.destroy('none-1');
    }
  });

  test('direct: deny_out and allow_out by address and CIDR, allow winning', async () => {
    await b.create({ name: 'deny-1', cpus: 1, ram_mb: 64, tenant: 'acme', egress: { mode: 'direct', deny_out: [`${net.ip1}/32`] } });
    await b.create({
      name: 'only-1',
      cpus: 1,
      ram_mb: 64,
      tenant: 'acme',
      egress: { mode: 'direct', allow_out: [net.ip1], deny_out: ['0.0.0.0/0'] },
    });
    try {
      assert.ok(!(await get('deny-1', net.ip1)), 'deny_out did not stop ip1');
      assert.ok(await get('deny-1', net.ip2), 'deny_out of ip1 stopped ip2');
      assert.ok(await get('only-1', net.ip1), 'allow_out did not win over deny 0.0.0.0/0');
      assert.ok(!(await get('only-1', net.ip2)), 'deny 0.0.0.0/0 let ip2 through');
    } finally {
      await b.destroy('deny-1');
      await b.destroy('only-1');
    }
  });

  test('direct: private networks are closed by default and opened by allow_out; metadata never', async () => {
    await b.create({ name: 'priv-0', cpus: 1, ram_mb: 64, tenant: 'acme', egress: { mode: 'direct' } });
    await b.create({
      name: 'priv-1',
      cpus: 1,
      ram_mb: 64,
      tenant: 'acme',
      egress: { mode: 'direct', allow_out: [`${net.privateIp}/32`, '169.254.0.0/16'] },
    });
    try {
      assert.ok(!(await get('priv-0', net.privateIp)), 'a private address was open by default');
      assert.ok(await get('priv-1', net.privateIp), 'allow_out did not open the private address (so the block above may be mere absence)');
      assert.ok(!(await get('priv-1', net.metadataIp)), 'allow_out opened 169.254.169.254');
    } finally {
      await b.destroy('priv-0');
      await b.destroy('priv-1');
    }
  });

  test('in every mode: not the host (any address, any service), not another tenant, not 169.254.169.254', async () => {
    // The rival allows everything out too: its replies would come back if anything let the first packet across.
    const other = await b.create({
      name: 'other-t',
      cpus: 1,
      ram_mb: 64,
      tenant: 'rival',
      egress: { mode: 'direct', allow_out: ['0.0.0.0/0'] },
    });
    const listener = await b.spawn('other-t', { argv: ['/bin/sh', '-c', 'nc -l -p 7000'], stdin: false });
    const otherHeard = collect(listener, 180_000);
    const modes: Array<[string, Parameters<ProcessBackend['create']>[0]['egress']]> = [
      ['m-direct', { mode: 'direct', allow_out: ['0.0.0.0/0'] }],
      ['m-none', { mode: 'none' }],
      ['m-proxy', { mode: 'proxy', allow_out: ['0.0.0.0/0'] }],
    ];
    for (const [name, egress] of modes) {
      const info = await b.create({ name, cpus: 1, ram_mb: 64, tenant: 'acme', egress, net_raw: true });
      // What a guest can do in its own namespace: send the rival's address to the gateway instead of ARPing for it.
      const r = spawnSync('nsenter', ['-t', String(info.init_pid), '-n', '--', 'ip', 'route', 'add', `${other.ip}/32`, 'via', gateway], {
        encoding: 'utf8',
      });
      assert.equal(r.status, 0, r.stderr);
      // And the rival answers through the gateway too: a first packet let across would complete a connection.
      const back = spawnSync('nsenter', ['-t', String(other.init_pid), '-n', '--', 'ip', 'route', 'add', `${info.ip}/32`, 'via', gateway], {
        encoding: 'utf8',
      });
      assert.equal(back.status, 0, back.stderr);
    }
    try {
      const targets = [...new Set([gateway, net.hostIp, ...hostAddrs()])];
      for (const [name] of modes) {
        for (const ip of targets) {
          const r = await sh(name, `echo hi | nc -w 1 ${ip} ${hostPort}`);
          assert.doesNotMatch(r.stdout, /host service/, `${name} reached the host service on ${ip}`);
        }
        const t = await sh(name, `echo across-${name} | nc -w 2 ${other.ip} 7000`);
        assert.notEqual(t.exitCode, 0, `${name} connected to another tenant`);
        assert.ok(!(await get(name, net.metadataIp)), `${name} reached 169.254.169.254`);
      }
      assert.deepEqual(heard, [], 'the host service heard a sandbox');
      // Through the proxy too: it judges the address it would connect to.
      for (const target of [
        `${net.hostIp}:${hostPort}`,
        `127.0.0.1:${hostPort}`,
        `${gateway}:${hostPort}`,
        `${net.metadataIp}:80`,
        `${other.ip}:7000`,
      ]) {
        const r = await viaConnect('m-proxy', target, '-');
        assert.match(r, /^REFUSED HTTP\/1\.1 403/, `the proxy let m-proxy reach ${target}: ${r}`);
      }
      assert.deepEqual(heard, [], 'the host service heard the proxy');
      // The control: the rival's own peer is heard, so the silence above is the rules, not a dead listener.
      await b.create({ name: 'other-p', cpus: 1, ram_mb: 64, tenant: 'rival', egress: { mode: 'none' } });
      await sh('other-p', `echo control | nc -w 2 ${other.ip} 7000`);
      const out = (await otherHeard).stdout;
      assert.match(out, /control/, 'the listener heard nothing at all');
      assert.doesNotMatch(out, /across/, 'another tenant heard a sandbox');
    } finally {
      listener.kill('SIGKILL');
      for (const name of [...modes.map(([n]) => n), 'other-t', 'other-p']) await b.destroy(name).catch(() => undefined);
    }
  });

  test('proxy: the sandbox reaches only the proxy; domain rules by HTTP Host and TLS SNI', async () => {
    const info = await b.create({
      name: 'prx-1',
      cpus: 1,
      ram_mb: 64,
      tenant: 'acme',
      egress: {
        mode: 'proxy',
        provider: 'fleet',
        allow_out: ['allowed.example.test', 'sneaky.example.test'],
        deny_out: ['*.example.test'],
      },
    });
    try {
      const eg = info.egress;
      assert.ok(eg);
      assert.equal(eg.endpoint, `http://${gateway}:${proxyPort}`);
      assert.deepEqual(eg.no_proxy, ['127.0.0.1', info.ip, gateway]);
      const env = await sh('prx-1', 'echo $HTTP_PROXY $https_proxy $NO_PROXY');
      assert.equal(env.stdout.trim(), `http://${gateway}:${proxyPort} http://${gateway}:${proxyPort} 127.0.0.1,${info.ip},${gateway}`);
      assert.equal((await b.egressStatus('prx-1')).health, 'healthy');

      // Around the proxy: nothing.
      assert.ok(!(await get('prx-1', net.ip1)), 'reached the internet around the proxy');
      // HTTP through it, judged by the request's host.
      assert.ok(await get('prx-1', 'allowed.example.test', { proxy: true }), lastOut);
      assert.match(lastOut, /internet http host=allowed\.example\.test/);
      assert.ok(!(await get('prx-1', 'denied.example.test', { proxy: true })), 'a denied name passed');
      assert.match(lastOut, /^HTTP\/1\.1 403/);
      assert.ok(!(await get('prx-1', 'sneaky.example.test', { proxy: true })), 'an allowed name opened a private address');
      const lie = await sh(
        'prx-1',
        `printf 'GET http://allowed.example.test/ HTTP/1.1\\r\\nHost: denied.example.test\\r\\n\\r\\n' | nc -w 3 ${gateway} ${proxyPort}`,
      );
      assert.match(lie.stdout, /^HTTP\/1\.1 400/, `a Host header disagreeing with the target passed: ${lie.stdout}`);

      // CONNECT, judged by the target name, which the TLS SNI must match.
      assert.match(
        await viaConnect('prx-1', 'allowed.example.test:443', 'allowed.example.test'),
        /internet https .*sni=allowed\.example\.test/,
      );
      assert.match(await viaConnect('prx-1', 'denied.example.test:443', 'denied.example.test'), /^REFUSED HTTP\/1\.1 403/);
      assert.match(
        await viaConnect('prx-1', 'allowed.example.test:443', 'denied.example.test'),
        /^CLOSED/,
        'SNI differing from the CONNECT name',
      );
      assert.match(await viaConnect('prx-1', `${net.ip1}:443`, 'denied.example.test'), /^CLOSED/, 'a denied SNI to an address literal');
      // What a domain rule does not cover: a tunnel to an address literal with no name in it (address rules only).
      assert.match(await viaConnect('prx-1', `${net.ip1}:443`, '-'), /internet https/);

      // The proxy gone: reported unhealthy, and the sandbox has no egress at all (never direct).
      const host = (b as unknown as { egress: { close(): Promise<void>; ensureProxy(): Promise<void> } }).egress;
      await host.close();
      try {
        assert.equal((await b.egressStatus('prx-1')).health, 'unhealthy');
        assert.ok(!(await get('prx-1', net.ip1)), 'with its proxy down, a proxy-mode sandbox reached the internet');
      } finally {
        await host.ensureProxy();
      }
    } finally {
      await b.destroy('prx-1');
    }
  });

  test('a running sandbox changes policy: none, then direct, then none again', async () => {
    await b.create({ name: 'chg-1', cpus: 1, ram_mb: 64, tenant: 'acme', egress: { mode: 'none' } });
    try {
      assert.ok(!(await get('chg-1', net.ip1)));
      const info = await b.setEgress('chg-1', { mode: 'direct', allow_out: [], deny_out: [] });
      assert.equal(info.egress?.mode, 'direct');
      assert.ok(await get('chg-1', net.ip1), 'direct after the change did not reach the internet');
      await b.setEgress('chg-1', { mode: 'proxy', allow_out: [], deny_out: [] });
      assert.equal((await sh('chg-1', 'echo $HTTP_PROXY')).stdout.trim(), `http://${gateway}:${proxyPort}`);
      assert.ok(!(await get('chg-1', net.ip1)), 'proxy mode reached the internet around the proxy');
      await b.setEgress('chg-1', { mode: 'none', allow_out: [], deny_out: [] });
      assert.equal((await sh('chg-1', 'echo "[$HTTP_PROXY]"')).stdout.trim(), '[]', 'the proxy variables outlived proxy mode');
      assert.ok(!(await get('chg-1', net.ip1)), 'none after the change still reached the internet');
    } finally {
      await b.destroy('chg-1');
    }
  });
});
