import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import { createServer, request as httpRequest, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { buildQemuImage } from '../../packages/agent/src/backend/qemu/image.js';
import { qmp } from '../../packages/agent/src/backend/qemu/qmp.js';
import { nameHash } from '../../packages/agent/src/backend/qemu/vm-state.js';
import { startAgent, type RunningAgent } from '../agent/harness.js';
import {
  eventually,
  prepareAgents,
  problemOf,
  registerHost,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';
import { startFaultProxy, type FaultProxy } from './fault-proxy.js';

/**
 * `POST /v1/vms/:id/migrate {"live": true}` for a VM on a qemu host, driven
 * by the control plane through the agents' native migration (QEMU's own
 * stream in TLS under a key the target mints). Real VMs under TCG, ONE boot:
 * h1 and h2 are qemu agents (h2 behind a fault proxy, to fail one step after
 * the guest was sent), h3 a process agent. Under CI=true a missing
 * prerequisite fails the file instead of skipping it.
 *
 * Then `{"live": true, "lazy": true}` (QEMU post-copy) on the same VM:
 * refusals before anything moves, a lazy move h2 -> h1 whose counter runs
 * on, and a lazy move h1 -> h2 whose source QEMU is SIGKILLed while the
 * post-copy stream is still running (made long by the source's
 * max-postcopy-bandwidth and a guest with 64 MB of random memory): the VM
 * ends failed and nothing of it is left on either host.
 */

const Q1 = { prefix: 'qcpa', subnet: '10.251.17.0/24' };
const Q2 = { prefix: 'qcpb', subnet: '10.251.18.0/24' };

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
if (lack && process.env.CI === 'true') throw new Error(`qemu control-plane tests need ${lack} under CI`);

/** The host's agent seen through a proxy that reports no post-copy (capacity lazy_pages false): a qemu host without userfaultfd. */
async function withoutLazyPages(target: string): Promise<{ url: string; server: Server }> {
  const up = new URL(target);
  const server = createServer((req, res) => {
    const out = httpRequest({ host: up.hostname, port: up.port, method: req.method, path: req.url, headers: req.headers }, (r) => {
      if (!(req.url ?? '').split('?')[0]!.endsWith('/capacity') || r.statusCode !== 200) {
        res.writeHead(r.statusCode ?? 502, r.headers);
        r.pipe(res);
        return;
      }
      const chunks: Buffer[] = [];
      r.on('data', (c: Buffer) => chunks.push(c));
      r.on('end', () => {
        const body = JSON.stringify({ ...(JSON.parse(Buffer.concat(chunks).toString()) as object), lazy_pages: false });
        res.writeHead(200, { 'content-type': 'application/json' });
        res.end(body);
      });
    });
    out.on('error', () => res.destroy());
    req.pipe(out);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, server };
}

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

/** A counter and a web server, each in its own session (an exec's process group ends with its connection). */
const COUNTER =
  "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.2; done' </dev/null >/dev/null 2>&1 & " +
  'setsid httpd -p 8080 -h /root </dev/null >/dev/null 2>&1 & echo started';

describe('qemu live migration driven by the control plane', { skip: lack ? `missing ${lack}` : false, timeout: 900_000 }, () => {
  let root: string | undefined;
  let q1: RunningAgent | undefined;
  let q2: RunningAgent | undefined;
  let proxy: FaultProxy | undefined;
  let noLazy: { url: string; server: Server } | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let vmId = '';
  let skip: string | undefined;
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'fleet-qemu-cp-'));
    const imageDir = join(root, 'images');
    await buildQemuImage(imageDir, 'base');
    const start = (dir: string, net: typeof Q1): Promise<RunningAgent> =>
      startAgent(
        {
          dataDir: join(root!, dir),
          imageDir,
          subnet: net.subnet,
          bridgePrefix: net.prefix,
          env: { AGENT_BACKEND: 'qemu', AGENT_QEMU_ACCEL: 'tcg', AGENT_LOG_LEVEL: 'warn' },
        },
        60_000,
      );
    [q1, q2] = await Promise.all([start('data-1', Q1), start('data-2', Q2)]);
    proxy = await startFaultProxy(q2.url);
    const f = await prepareAgents();
    if ('skip' in f) {
      skip = f.skip;
      return;
    }
    fleet = f;
    const p3 = await f.start();
    cp = await startControlPlane({
      env: { RECONCILER_ENABLED: 'false', EXEC_DEFAULT_TIMEOUT_MS: '30000', AGENT_CALL_TIMEOUT_MS: '300000' },
    });
    ok(await registerHost(cp, 'h1', q1, { backend: 'qemu' }), 201);
    ok(await registerHost(cp, 'h2', { url: proxy.url, token: q2.token }, { backend: 'qemu' }), 201);
    ok(await registerHost(cp, 'h3', p3), 201);
  });

  after(async () => {
    await cp?.close();
    for (const agent of [q1, q2]) {
      if (!agent) continue;
      for (const v of await agent.client.listVms().catch(() => []))
        await agent.client.destroyVm(v.name, { force: true }).catch(() => undefined);
      await agent.client.prune().catch(() => undefined);
      await agent.stop();
    }
    await proxy?.close();
    if (noLazy) {
      noLazy.server.closeAllConnections();
      await new Promise((r) => noLazy!.server.close(r));
    }
    await fleet?.close();
    // A failed run still leaves no QEMU, tap, bridge or table of ours behind.
    for (const dir of ['data-1', 'data-2']) {
      const vms = join(root ?? '/nonexistent', dir, 'qemu/vms');
      for (const name of spawnSync('ls', [vms], { encoding: 'utf8' }).stdout.split('\n').filter(Boolean)) {
        const pid = Number(spawnSync('cat', [join(vms, name, 'qemu.pid')], { encoding: 'utf8' }).stdout.trim());
        if (pid > 0 && alive(pid)) process.kill(pid, 'SIGKILL');
      }
    }
    const links = spawnSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const m of links.matchAll(/^\d+: ((?:qcpa|qcpb)v[tb]\w+)[:@]/gm)) spawnSync('ip', ['link', 'del', m[1]!], { stdio: 'ignore' });
    for (const t of ['fleet_qcpav', 'fleet_qcpbv'])
      for (const fam of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', fam, t], { stdio: 'ignore' });
    if (root) await rm(root, { recursive: true, force: true });
  });

  const exec = async (argv: string[]): Promise<{ stdout: string; exit_code: number }> =>
    ok(await cp!.request('POST', `/v1/vms/${vmId}/exec`, { as: 'acme', body: { argv } }));
  const count = async (): Promise<number> => Number((await exec(['cat', '/root/count'])).stdout.trim());
  const advances = async (): Promise<number> => {
    const a = await count();
    await new Promise((r) => setTimeout(r, 1200));
    const b = await count();
    assert.ok(b > a, `the counter runs: ${a} -> ${b}`);
    return a;
  };
  const served = async (vm: { endpoints: Array<{ as: string; url: string }> }): Promise<string> => {
    const ep = vm.endpoints.find((e) => e.as === 'http');
    assert.ok(ep, JSON.stringify(vm.endpoints));
    return (await fetch(`${ep.url}/count`, { signal: AbortSignal.timeout(10_000) })).text();
  };
  const events = async (): Promise<Array<{ type: string; data: any }>> => cp!.service.store.readStream(`vm-${vmId}`);
  const onAgent = async (agent: RunningAgent): Promise<string[]> =>
    (await agent.client.listVms()).map((v) => v.name).filter((n) => n.endsWith(vmId));

  it('boots one VM on a qemu host; a live migrate to a host of another backend is refused before anything moves', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const started = Date.now();
    const vm = ok(
      await c.request('POST', '/v1/vms', {
        as: 'acme',
        body: { host_id: 'h1', cpus: 1, ram_mb: 192, egress: { mode: 'none' }, expose: [{ port: 8080, as: 'http' }] },
      }),
      201,
    );
    vmId = vm.id;
    t.diagnostic(`create to running under TCG: ${Date.now() - started} ms`);
    assert.equal(vm.host_id, 'h1');
    assert.equal((await exec(['sh', '-c', COUNTER])).stdout.trim(), 'started');
    await advances();

    const n = (await events()).length;
    const refused = await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h3' } });
    assert.equal(refused.status, 409, JSON.stringify(refused.body));
    assert.equal(problemOf(refused).code, 'LIVE_MIGRATION_TARGET_UNSUPPORTED');
    assert.equal((await events()).length, n, 'nothing recorded: no migration started');
    assert.deepEqual(await onAgent(q2!), [], 'nothing prepared on the other qemu host');
    const still = ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' }));
    assert.equal(still.host_id, 'h1');
    assert.equal(still.state, 'running');
    await advances();
  });

  it('a failure after the guest was sent thaws the source where it stopped; with keep_paused it stays paused until resumed', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    proxy!.rule = (method, path) => (method === 'POST' && path.endsWith('/migration/complete') ? 500 : undefined);
    try {
      const before = await count();
      const r = await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h2' } });
      assert.ok(r.status >= 500, JSON.stringify(r.body));
      assert.equal(problemOf(r).code, 'MIGRATION_FAILED');
      assert.equal((r.body as { details?: { source?: string; step?: string } }).details?.source, 'running');
      assert.equal((r.body as { details?: { step?: string } }).details?.step, 'boot', 'it failed after the send');
      assert.equal(proxy!.injected.length, 1, 'the stream was sent and the completion refused');
      const failed = (await events()).filter((e) => e.type === 'VmMigrationFailed');
      assert.equal(failed.at(-1)?.data.step, 'boot');
      const back = ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' }));
      assert.equal(back.state, 'running');
      assert.equal(back.host_id, 'h1');
      const from = await advances();
      assert.ok(from >= before, `the source went on from where it stopped: ${before} -> ${from}`);
      assert.match(await served(back), /^\d+/);
      assert.deepEqual(await onAgent(q2!), [], 'nothing of it left on the target');
      // Not landed, the prepared VM is not listed: its directory (QEMU, tap, listener) must be gone too, not left to its ttl.
      assert.ok(!existsSync(join(root!, 'data-2/qemu/vms', `fl-${vmId}`)), 'what the target prepared was removed');
      const { state: h2 } = await c.service.hosts.load('h2');
      assert.ok(h2.status !== 'unregistered' && !h2.reservations.has(vmId), 'the target reservation released');

      const kept = await c.request('POST', `/v1/vms/${vmId}/migrate`, {
        as: 'acme',
        body: { live: true, target_host_id: 'h2', keep_paused: true },
      });
      assert.equal(problemOf(kept).code, 'MIGRATION_FAILED', JSON.stringify(kept.body));
      assert.equal((kept.body as { details?: { source?: string } }).details?.source, 'paused');
      await eventually(
        async () => ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' })).state === 'paused',
        10_000,
        'left paused for the caller',
      );
      const stopped = await c.request('POST', `/v1/vms/${vmId}/exec`, { as: 'acme', body: { argv: ['true'] } });
      assert.ok(stopped.status >= 400, `a paused VM runs nothing: ${JSON.stringify(stopped.body)}`);
      const at = Number((await q1!.client.getVm(`fl-${vmId}`)).state === 'paused');
      assert.equal(at, 1, 'the source agent holds it stopped');
    } finally {
      proxy!.rule = undefined;
    }
    const resumed = ok(await c.request('POST', `/v1/vms/${vmId}/resume`, { as: 'acme' }));
    assert.equal(resumed.state, 'running');
    assert.equal(resumed.host_id, 'h1');
    await advances();
  });

  it('live-migrates h1 -> h2: same id, the process runs on, exec and the endpoint work there, downtime recorded, nothing left on h1', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    await exec(['sh', '-c', 'echo before-move > /root/mark']);
    const before = await count();
    const t0 = Date.now();
    const m = ok(await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true } }));
    t.diagnostic(`live migrate under TCG: ${Date.now() - t0} ms in all, downtime ${m.downtime_ms} ms, readdressed ${m.readdressed}`);
    assert.equal(m.id, vmId);
    assert.equal(m.host_id, 'h2', 'placement: the only other qemu host');
    assert.equal(m.from_host_id, 'h1');
    assert.equal(m.state, 'running');
    assert.equal(typeof m.downtime_ms, 'number');
    assert.equal(m.readdressed, true, "h2's subnet is another: the guest was told its new address");

    const from = await advances();
    assert.ok(from >= before, `the counter went on across the move: ${before} -> ${from}`);
    assert.equal((await exec(['cat', '/root/mark'])).stdout, 'before-move\n', 'the disk came with it');
    const addr = (await exec(['sh', '-c', 'ip -o -4 addr show dev eth0'])).stdout;
    assert.match(addr, /inet 10\.251\.18\.\d+\//);
    assert.match(await served(m), /^\d+/);

    const evs = await events();
    for (const e of evs.filter((x) => x.type.startsWith('VmMigration') || x.type === 'VmMigrated').slice(-7))
      t.diagnostic(`${e.type} ${JSON.stringify(e.data)}`);
    const started = evs.findLastIndex((e) => e.type === 'VmMigrationStarted');
    const tail = evs.slice(started);
    assert.equal(tail[0]!.data.live, true);
    const steps = tail.filter((e) => e.type === 'VmMigrationStepCompleted').map((e) => e.data.step);
    assert.deepEqual(steps, ['place', 'move', 'boot', 'destroy_source', 'cleanup']);
    const boot = tail.find((e) => e.type === 'VmMigrationStepCompleted' && e.data.step === 'boot');
    assert.equal(boot!.data.downtime_ms, m.downtime_ms, 'downtime on the boot step');
    assert.ok(tail.some((e) => e.type === 'VmMigrated' && e.data.host_id === 'h2'));
    assert.doesNotMatch(JSON.stringify(tail.map((e) => e.data)), /[0-9a-f]{64}/, 'the key is in no event');

    assert.deepEqual(await onAgent(q1!), [], 'the source agent has no VM left');
    const { state: h1 } = await c.service.hosts.load('h1');
    assert.ok(h1.status !== 'unregistered' && !h1.reservations.has(vmId), 'the source reservation released');
  });

  const lazyOk = existsSync('/proc/sys/vm/unprivileged_userfaultfd');
  const reserved = async (hostId: string): Promise<boolean> => {
    const { state } = await cp!.service.hosts.load(hostId);
    return state.status !== 'unregistered' && state.reservations.has(vmId);
  };
  const qemuPid = (dir: string): number => Number(readFileSync(join(root!, dir, 'qemu/vms', `fl-${vmId}`, 'qemu.pid'), 'utf8').trim());

  it('lazy: refused before anything moves without a qemu target with lazy_pages; keep_paused with lazy is a 400', async (t) => {
    if (guard(t)) return;
    if (!lazyOk) return t.skip('no userfaultfd on this kernel');
    const c = cp!;
    noLazy = await withoutLazyPages(q1!.url);
    ok(await registerHost(c, 'h4', { url: noLazy.url, token: q1!.token }, { backend: 'qemu' }), 201);
    const { state: h4 } = await c.service.hosts.load('h4');
    assert.ok(h4.status !== 'unregistered' && h4.capacity.live_snapshot === true && h4.capacity.lazy_pages === false);
    const n = (await events()).length;
    const other = await c.request('POST', `/v1/vms/${vmId}/migrate`, {
      as: 'acme',
      body: { live: true, lazy: true, target_host_id: 'h3' },
    });
    assert.equal(other.status, 409, JSON.stringify(other.body));
    assert.equal(problemOf(other).code, 'LAZY_MIGRATION_TARGET_UNSUPPORTED');
    const noUffd = await c.request('POST', `/v1/vms/${vmId}/migrate`, {
      as: 'acme',
      body: { live: true, lazy: true, target_host_id: 'h4' },
    });
    assert.equal(noUffd.status, 409, JSON.stringify(noUffd.body));
    assert.equal(problemOf(noUffd).code, 'LAZY_MIGRATION_TARGET_UNSUPPORTED');
    assert.match(problemOf(noUffd).detail, /lazy_pages/);
    const paused = await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true, lazy: true, keep_paused: true } });
    assert.equal(paused.status, 400, JSON.stringify(paused.body));
    assert.equal((await events()).length, n, 'nothing recorded: no migration started');
    assert.deepEqual(await onAgent(q1!), [], 'nothing prepared on h1 (h4 is its agent)');
    const still = ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' }));
    assert.equal(still.host_id, 'h2');
    assert.equal(still.state, 'running');
    assert.deepEqual(ok(await c.request('GET', `/v1/vms/${vmId}/memory`, { as: 'acme' })), {
      resident_chunks: 0,
      total_chunks: 0,
      done: true,
    });
  });

  it('lazy h2 -> h1 (QEMU post-copy): the VM runs on h1 at the switch, its counter goes on, the source goes once the stream completed', async (t) => {
    if (guard(t)) return;
    if (!lazyOk) return t.skip('no userfaultfd on this kernel');
    const c = cp!;
    const before = await count();
    const t0 = Date.now();
    const m = ok(
      await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true, lazy: true, target_host_id: 'h1' } }),
    );
    const answeredAt = Date.now();
    assert.equal(m.id, vmId);
    assert.equal(m.host_id, 'h1');
    assert.equal(m.from_host_id, 'h2');
    assert.equal(m.state, 'running');
    assert.match(m.snapshot_id, /^qemu-lazy-/, 'the answer says the move was lazy');
    const done = await eventually(
      async () => {
        const s = ok(await c.request('GET', `/v1/vms/${vmId}/memory`, { as: 'acme' }));
        return s.done === true ? s : undefined;
      },
      120_000,
      'the post-copy stream completed',
    );
    assert.deepEqual(done, { resident_chunks: 1, total_chunks: 1, done: true });
    t.diagnostic(
      `lazy migrate under TCG: answered (running on h1) after ${answeredAt - t0} ms, downtime ${m.downtime_ms} ms, memory all on h1 ${Date.now() - t0} ms after the request`,
    );
    const from = await advances();
    assert.ok(from >= before, `the counter went on across the lazy move: ${before} -> ${from}`);
    assert.equal((await exec(['cat', '/root/mark'])).stdout, 'before-move\n', 'the disk came with it');
    assert.match(await served(m), /^\d+/);

    await eventually(async () => (await onAgent(q2!)).length === 0, 60_000, 'the source destroyed');
    await eventually(async () => !(await reserved('h2')), 10_000, 'the source reservation released');
    const evs = await events();
    const tail = evs.slice(evs.findLastIndex((e) => e.type === 'VmMigrationStarted'));
    for (const e of tail.filter((x) => x.type.startsWith('VmMigration') || x.type === 'VmMigrated'))
      t.diagnostic(`${e.type} ${JSON.stringify(e.data)}`);
    assert.equal(tail[0]!.data.live, true);
    assert.equal(tail[0]!.data.lazy, true);
    await eventually(async () => (await events()).at(-1)?.data.step === 'cleanup', 10_000, 'the migration recorded its end');
    const steps = (await events())
      .slice(evs.findLastIndex((e) => e.type === 'VmMigrationStarted'))
      .filter((e) => e.type === 'VmMigrationStepCompleted');
    assert.deepEqual(
      steps.map((e) => e.data.step),
      ['place', 'move', 'boot', 'destroy_source', 'cleanup'],
    );
    const boot = steps.find((e) => e.data.step === 'boot')!;
    assert.equal(boot.data.detail.lazy, 'true');
    assert.equal(boot.data.downtime_ms, m.downtime_ms, 'downtime on the boot step');
    assert.match(steps.find((e) => e.data.step === 'destroy_source')!.data.detail.paged_ms, /^\d+$/);
    assert.doesNotMatch(JSON.stringify(tail.map((e) => e.data)), /[0-9a-f]{64}/, 'the key is in no event');
  });

  it('lazy h1 -> h2, the control plane restarted mid-stream (its successor adopts the watch), then the source QEMU SIGKILLed: the VM ends failed (LAZY_SOURCE_LOST), nothing left on either host', async (t) => {
    if (guard(t)) return;
    if (!lazyOk) return t.skip('no userfaultfd on this kernel');
    const c = cp!;
    // 64 MB of random memory in the guest (tmpfs), and a source that sends the rest at 1 MiB/s once switched: a minute of post-copy.
    const t0 = Date.now();
    // TCG writes it in 10-30 s here: past the control plane's default exec timeout under load.
    const filled = ok(
      await c.request('POST', `/v1/vms/${vmId}/exec`, {
        as: 'acme',
        body: { argv: ['sh', '-c', 'head -c 67108864 /dev/urandom > /tmp/ballast && echo filled'], timeout_ms: 180_000 },
      }),
    );
    const filledAt = Date.now();
    assert.equal(filled.stdout.trim(), 'filled');
    const sourcePid = qemuPid('data-1');
    await qmp(join(root!, 'data-1/qemu/run', `${nameHash(`fl-${vmId}`)}.qmp`), 'migrate-set-parameters', {
      'max-postcopy-bandwidth': 1024 * 1024,
    });
    const m = ok(
      await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true, lazy: true, target_host_id: 'h2' } }),
    );
    assert.equal(m.host_id, 'h2');
    const targetPid = qemuPid('data-2');
    const mem = ok(await c.request('GET', `/v1/vms/${vmId}/memory`, { as: 'acme' }));
    assert.deepEqual(mem, { resident_chunks: 0, total_chunks: 1, done: false }, 'the rest of its memory is still coming');
    const again = await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h1' } });
    assert.equal(problemOf(again).code, 'MIGRATION_IN_PROGRESS', JSON.stringify(again.body));
    assert.ok(await reserved('h1'), 'the source keeps its reservation while it serves pages');
    // A control plane restarted mid-stream (its watch stopped) with a 1 ms grace: only an adopted watch keeps the source.
    await c.restart({ RECONCILE_GRACE_MS: '1' });
    await eventually(async () => ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' })).host_id === 'h2', 10_000, 'read model');
    const swept = await c.service.reconciler.reconcileOnce();
    t.diagnostic(`reconcile after the restart: ${JSON.stringify({ orphans: swept.orphans_destroyed, errors: swept.errors })}`);
    assert.ok(await reserved('h1'), 'the source keeps its reservation after the restart: the next control plane watches the stream');
    assert.ok(alive(sourcePid), 'the source QEMU still serves pages');

    const killedAt = Date.now();
    process.kill(sourcePid, 'SIGKILL');
    const failed = await eventually(
      async () => {
        const v = ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' }));
        return v.state === 'failed' ? v : undefined;
      },
      90_000,
      'the VM recorded lost',
    );
    t.diagnostic(
      `guest memory filled in ${filledAt - t0} ms; lazy migrate answered after ${killedAt - filledAt} ms (downtime ${m.downtime_ms} ms); ` +
        `the VM recorded failed ${Date.now() - killedAt} ms after the SIGKILL: ${failed.error}`,
    );
    const all = await events();
    for (const e of all.slice(all.findLastIndex((x) => x.type === 'VmMigrationStarted')).filter((x) => x.type.startsWith('VmMigration')))
      t.diagnostic(`${e.type} ${JSON.stringify(e.data)}`);
    const ended = all.findLast((e) => e.type === 'VmFailed');
    assert.equal(ended?.data.reason, 'host_lost');
    assert.equal(ended?.data.error_code, 'LAZY_SOURCE_LOST');
    assert.match(ended?.data.error, /post-copy/);
    assert.equal((await events()).findLast((e) => e.type === 'VmMigrationFailed')?.data.error_code, 'LAZY_SOURCE_LOST');
    await eventually(() => Promise.resolve(!alive(targetPid)), 30_000, 'the target QEMU ended');
    await eventually(async () => (await onAgent(q2!)).length === 0 && (await onAgent(q1!)).length === 0, 30_000, 'no sandbox left');
    await eventually(async () => !(await reserved('h1')) && !(await reserved('h2')), 10_000, 'both reservations released');
    ok(await c.request('DELETE', `/v1/vms/${vmId}`, { as: 'acme' }));
    assert.deepEqual(await onAgent(q2!), []);
  });
});
