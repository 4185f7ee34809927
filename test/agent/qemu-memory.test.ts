import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { appendFile, cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { createConnection, createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { z } from 'zod';
import {
  abortedMigrationSchema,
  AppError,
  errorBodySchema,
  incomingMigrationSchema,
  migrationOfferSchema,
  migrationReportSchema,
  vmInfoSchema,
} from '@fleet/agent-protocol';
import { buildQemuImage } from '../../packages/agent/src/backend/qemu/image.js';
import { qmp } from '../../packages/agent/src/backend/qemu/qmp.js';
import { nameHash } from '../../packages/agent/src/backend/qemu/vm-state.js';
import { generateMac } from '../../packages/agent/src/backend/process/network.js';
import { startAgent, type RunningAgent } from './harness.js';

/**
 * Memory state of qemu VMs through QEMU itself (TCG here), with real VMs
 * behind real agent processes. ONE cold boot: VM `a` runs a counter; the
 * live snapshot, pause/resume, restore in place, fork (a second VM on the
 * same tenant bridge, re-addressed) and a move to a second agent are all
 * loads of captured state, not boots. Under CI=true a missing prerequisite
 * fails the file instead of skipping it.
 */

const A = { prefix: 'qmm', subnet: '10.251.7.0/24' };
const B = { prefix: 'qmn', subnet: '10.251.8.0/24' };

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
if (lack && process.env.CI === 'true') throw new Error(`qemu memory tests need ${lack} under CI`);

const alive = (pid: number): boolean => {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return !/^[ZX]/.test(stat.slice(stat.lastIndexOf(')') + 2));
  } catch {
    return false;
  }
};

/** A counter in its own session (an exec's process group dies with its connection), replaced by rename so a read never sees it empty. */
const COUNTER =
  "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.2; done' </dev/null >/dev/null 2>&1 & " +
  'setsid httpd -p 8080 -h /root </dev/null >/dev/null 2>&1 & echo started';

/** One frame of the in-guest agent's protocol (guest/fleet-guest-agent.c). */
function frame(type: string, payload: string): Buffer {
  const b = Buffer.from(payload);
  const h = Buffer.alloc(5);
  h.write(type, 0, 'latin1');
  h.writeUInt32BE(b.length, 1);
  return Buffer.concat([h, b]);
}

/** Runs `touch <marker>` through the in-guest agent at `ip` with `token`; answers the bytes the guest sent back. */
function rawExec(ip: string, token: string, marker: string): Promise<Buffer> {
  const req = ['3', 'sh', '-c', `touch ${marker}`, '0', '/', '0', '0', '0', '0'].map((f) => `${f}\0`).join('');
  return new Promise<Buffer>((resolve, reject) => {
    const s = createConnection({ host: ip, port: 7071 });
    const got: Buffer[] = [];
    s.setTimeout(15_000, () => s.destroy());
    s.on('data', (d: Buffer) => got.push(d));
    s.on('error', (err: NodeJS.ErrnoException) => (err.code === 'ECONNRESET' ? undefined : reject(err)));
    s.on('close', () => resolve(Buffer.concat(got)));
    s.on('connect', () => s.write(Buffer.concat([frame('A', token), frame('X', req), frame('E', '')])));
  });
}

const memorySchema = z.object({ resident_chunks: z.number(), total_chunks: z.number(), done: z.boolean(), error: z.string().optional() });

/** The migration routes called raw, their answers checked against the protocol's schemas. */
async function api<S extends z.ZodType>(
  agent: RunningAgent,
  method: string,
  path: string,
  body: unknown,
  schema: S,
): Promise<{ status: number; body: z.infer<S> }> {
  const res = await fetch(`${agent.url}/v1${path}`, {
    method,
    headers: { authorization: `Bearer ${agent.token}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
    ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    signal: AbortSignal.timeout(600_000),
  });
  const json: unknown = await res.json();
  return { status: res.status, body: (res.ok ? schema : errorBodySchema).parse(json) as z.infer<S> };
}

describe('qemu backend: memory state through QEMU', { skip: lack ? `missing ${lack}` : false, timeout: 900_000 }, () => {
  let root: string;
  let imageDir: string;
  let a: RunningAgent;
  let b: RunningAgent;
  const agents: RunningAgent[] = [];
  const vm = 'qmm-a';
  const fork = 'qmm-f';
  let snapshotId = '';
  let countAtSnapshot = 0;

  const count = async (agent: RunningAgent, name: string): Promise<number> =>
    Number((await agent.client.exec(name, { argv: ['cat', '/root/count'] })).stdout.trim());
  const dataDirOf = (agent: RunningAgent): string => (agent === a ? join(root, 'data-a') : join(root, 'data-b'));
  const start = (dataDir: string, net: typeof A): Promise<RunningAgent> =>
    startAgent(
      {
        dataDir,
        imageDir,
        subnet: net.subnet,
        bridgePrefix: net.prefix,
        env: { AGENT_BACKEND: 'qemu', AGENT_QEMU_ACCEL: 'tcg', AGENT_LOG_LEVEL: 'warn' },
      },
      60_000,
    );

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'fleet-qemu-mem-'));
    imageDir = join(root, 'images');
    await buildQemuImage(imageDir, 'base');
    [a, b] = await Promise.all([start(join(root, 'data-a'), A), start(join(root, 'data-b'), B)]);
    agents.push(a, b);
  });

  after(async () => {
    for (const agent of agents) {
      for (const v of await agent.client.listVms().catch(() => []))
        await agent.client.destroyVm(v.name, { force: true }).catch(() => undefined);
      await agent.client.prune().catch(() => undefined);
      await agent.stop();
    }
    // A failed run still leaves no QEMU, tap, bridge or table of ours behind.
    for (const dir of ['data-a', 'data-b']) {
      const vms = join(root ?? '/nonexistent', dir, 'qemu/vms');
      for (const name of spawnSync('ls', [vms], { encoding: 'utf8' }).stdout.split('\n').filter(Boolean)) {
        const pid = Number(spawnSync('cat', [join(vms, name, 'qemu.pid')], { encoding: 'utf8' }).stdout.trim());
        if (pid > 0 && alive(pid)) process.kill(pid, 'SIGKILL');
      }
    }
    const links = spawnSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const m of links.matchAll(/^\d+: ((?:qmm|qmn)v[tb]\w+)[:@]/gm)) spawnSync('ip', ['link', 'del', m[1]!], { stdio: 'ignore' });
    for (const t of ['fleet_qmmv', 'fleet_qmnv'])
      for (const fam of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', fam, t], { stdio: 'ignore' });
    if (root) await rm(root, { recursive: true, force: true });
  });

  it('reports live snapshots (QEMU writes its own state), lazy pages where userfaultfd exists, no memory diffs', async () => {
    const cap = await a.client.capacity();
    assert.equal(cap.live_snapshot, true);
    assert.equal(cap.lazy_pages, existsSync('/proc/sys/vm/unprivileged_userfaultfd'));
    assert.equal(cap.memory_diff, false);
  });

  it('takes a live snapshot of a running VM: QEMU wrote its state, the guest was stopped briefly and runs on', async () => {
    const started = Date.now();
    await a.client.createVm(
      { name: vm, cpus: 1, ram_mb: 192, tenant: 't1', expose: [{ port: 8080, as: 'http' }], egress: { mode: 'none' } },
      { timeoutMs: 300_000 },
    );
    console.log(`# boot to first exec: ${Date.now() - started} ms`);
    assert.equal((await a.client.exec(vm, { argv: ['sh', '-c', COUNTER] })).stdout.trim(), 'started');
    await a.client.exec(vm, { argv: ['sh', '-c', 'echo before-snapshot > /root/mark'] });
    await new Promise((r) => setTimeout(r, 1500));
    const c0 = await count(a, vm);
    assert.ok(c0 > 0);

    const cp = await a.client.checkpoint(vm, { live: true, id: 'qmm-live-1', comment: 'live' }, { timeoutMs: 180_000 });
    console.log(`# live snapshot: pause ${cp.pause_ms} ms, rootfs.tar ${cp.size_bytes} B`);
    assert.equal(cp.kind, 'live');
    assert.deepEqual(Object.keys(cp.files).sort(), ['qemu-fleet.json', 'qemu-vmstate']);
    assert.ok(typeof cp.pause_ms === 'number' && cp.pause_ms >= 0);
    const dir = join(dataDirOf(a), 'checkpoints', cp.id);
    // QEMU's own migration stream: the file starts with its magic "QEVM".
    assert.equal((await readFile(join(dir, 'qemu-vmstate'))).subarray(0, 4).toString('latin1'), 'QEVM');
    snapshotId = cp.id;
    // Read just before the capture: the state holds this count or a later one.
    countAtSnapshot = c0;

    const c1 = await count(a, vm);
    await new Promise((r) => setTimeout(r, 1000));
    assert.ok((await count(a, vm)) > c1, 'the counter runs on after the snapshot');
    // Written after the snapshot: a restore of it must not have this.
    await a.client.exec(vm, { argv: ['sh', '-c', 'echo after-snapshot > /root/mark'] });
    const disk = await a.client.checkpoint(vm, { live: false, id: 'qmm-disk-1' }, { timeoutMs: 180_000 });
    assert.equal(disk.kind, 'disk', 'a disk checkpoint holds no memory');
    assert.deepEqual(disk.files, {});
  });

  it('pauses (state written, QEMU gone) and resumes: the counter carries on where it stopped', async () => {
    const pid = Number((await readFile(join(dataDirOf(a), 'qemu/vms', vm, 'qemu.pid'), 'utf8')).trim());
    const before = await count(a, vm);
    const paused = await a.client.pauseVm(vm, { id: 'qmm-pause' }, { timeoutMs: 180_000 });
    assert.equal(paused.vm.state, 'paused');
    assert.equal(paused.checkpoint.kind, 'live');
    assert.ok(!alive(pid), 'QEMU ended: its CPU and memory are free');
    await assert.rejects(a.client.exec(vm, { argv: ['true'] }), (e: AppError) => e.code === 'SANDBOX_NOT_RUNNING');
    assert.equal((await a.client.pauseVm(vm)).checkpoint.id, 'qmm-pause', 'a second pause answers the first');
    await new Promise((r) => setTimeout(r, 2000));

    const t0 = Date.now();
    const resumed = await a.client.resumeVm(vm, { timeoutMs: 180_000 });
    console.log(`# resume: ${Date.now() - t0} ms`);
    assert.equal(resumed.state, 'running');
    assert.equal(resumed.ip, '10.251.7.2');
    const after = await count(a, vm);
    // Nothing ran while paused: it goes on from where it was (a few ticks for the capture and the checks), not from 0.
    assert.ok(after >= before && after < before + 40, `counter ${before} before the pause, ${after} after the resume`);
    await new Promise((r) => setTimeout(r, 1000));
    assert.ok((await count(a, vm)) > after, 'and keeps counting');
    assert.equal((await a.client.exec(vm, { argv: ['cat', '/root/mark'] })).stdout, 'after-snapshot\n');
    assert.equal((await a.client.listCheckpoints()).filter((c) => c.id === 'qmm-pause').length, 0, 'the pause checkpoint is gone');
    const ep = resumed.endpoints.find((e) => e.as === 'http');
    assert.equal(await (await fetch(`${ep!.url}/mark`)).text(), 'after-snapshot\n', 'the endpoint reaches the resumed guest');
  });

  it('forks the live snapshot into a new VM: new address, MAC, name and token, the counter goes on from the snapshot', async () => {
    const t0 = Date.now();
    const f = await a.client.createVm(
      { name: fork, checkpoint_id: snapshotId, resume: true, cpus: 1, ram_mb: 192, tenant: 't1', egress: { mode: 'none' } },
      { timeoutMs: 300_000 },
    );
    console.log(`# fork: ${Date.now() - t0} ms`);
    assert.equal(f.state, 'running');
    assert.equal(f.ip, '10.251.7.3');
    assert.equal(f.mac, generateMac(fork));
    const r = await a.client.exec(fork, {
      argv: ['sh', '-c', 'hostname; ip -o -4 addr show dev eth0; cat /sys/class/net/eth0/address; cat /root/mark; cat /root/count'],
    });
    const [host, addr, mac, mark, c] = r.stdout.trim().split('\n');
    assert.equal(host, fork);
    assert.match(addr!, /inet 10\.251\.7\.3\/24/);
    assert.doesNotMatch(r.stdout, /10\.251\.7\.2\//, 'the old address is gone');
    assert.equal(mac, generateMac(fork));
    assert.equal(mark, 'before-snapshot', 'the disk as it was at the snapshot');
    assert.ok(Number(c) >= countAtSnapshot, `the fork's counter (${c}) goes on from the snapshot's (${countAtSnapshot})`);
    await new Promise((res) => setTimeout(res, 1000));
    assert.ok((await count(a, fork)) > Number(c), "the fork's counter runs");

    // Two VMs of one tenant share its bridge: the fork reaches the original's server by its address.
    const reach = await a.client.exec(fork, {
      argv: ['sh', '-c', "printf 'GET /mark HTTP/1.0\\r\\n\\r\\n' | nc -w 3 10.251.7.2 8080"],
      timeout_ms: 20_000,
    });
    assert.match(reach.stdout, /after-snapshot/);

    // The fork has its own token: the parent's (which its guest could read) runs nothing there.
    const parentToken = (JSON.parse(await readFile(join(dataDirOf(a), 'qemu/vms', vm, 'state.json'), 'utf8')) as { token: string }).token;
    const forkToken = (JSON.parse(await readFile(join(dataDirOf(a), 'qemu/vms', fork, 'state.json'), 'utf8')) as { token: string }).token;
    assert.notEqual(parentToken, forkToken);
    assert.equal((await rawExec(f.ip, parentToken, '/root/pwned')).length, 0, 'no answer to the parent token');
    assert.equal((await a.client.exec(fork, { argv: ['sh', '-c', 'test -e /root/pwned && echo yes || echo no'] })).stdout.trim(), 'no');
    assert.ok((await rawExec(f.ip, forkToken, '/root/ok')).length > 0, 'the same request with the fork token is answered');
    await a.client.destroyVm(fork, { force: true });
  });

  it('restores the VM in place to the live snapshot: its counter and disk go back, it runs on', async () => {
    const now = await count(a, vm);
    assert.ok(now > countAtSnapshot);
    const restored = await a.client.restoreVm(vm, { checkpoint_id: snapshotId }, { timeoutMs: 180_000 });
    assert.equal(restored.state, 'running');
    assert.equal(restored.ip, '10.251.7.2');
    const c = await count(a, vm);
    assert.ok(c >= countAtSnapshot && c < now, `back to the snapshot's count (${countAtSnapshot}): ${c}, was ${now}`);
    assert.equal((await a.client.exec(vm, { argv: ['cat', '/root/mark'] })).stdout, 'before-snapshot\n');
    await new Promise((res) => setTimeout(res, 1000));
    assert.ok((await count(a, vm)) > c);
  });

  it('refuses a state whose bytes do not match their sha256, and a machine of another size, before QEMU sees them', async () => {
    const src = join(dataDirOf(a), 'checkpoints', snapshotId);
    const copy = join(dataDirOf(a), 'checkpoints', 'qmm-tampered');
    await cp(src, copy, { recursive: true });
    const manifest = JSON.parse(await readFile(join(copy, 'manifest.json'), 'utf8')) as { id: string };
    manifest.id = 'qmm-tampered';
    await writeFile(join(copy, 'manifest.json'), JSON.stringify(manifest));
    await appendFile(join(copy, 'qemu-vmstate'), Buffer.from('tampered'));
    await assert.rejects(
      a.client.createVm({
        name: 'qmm-t',
        checkpoint_id: 'qmm-tampered',
        resume: true,
        cpus: 1,
        ram_mb: 192,
        tenant: 't1',
        egress: { mode: 'none' },
      }),
      // A 5xx of the agent reaches the client as AGENT_ERROR, the agent's code in its message.
      (e: AppError) => /CHECKPOINT_CORRUPT: checkpoint "qmm-tampered": qemu-vmstate does not match/.test(e.message),
    );
    await assert.rejects(
      a.client.createVm({
        name: 'qmm-t',
        checkpoint_id: snapshotId,
        resume: true,
        cpus: 1,
        ram_mb: 256,
        tenant: 't1',
        egress: { mode: 'none' },
      }),
      (e: AppError) => e.code === 'INVALID_SANDBOX_SPEC' && /ram_mb/.test(e.message),
    );
    await assert.rejects(
      a.client.createVm({
        name: 'qmm-t',
        checkpoint_id: 'qmm-disk-1',
        resume: true,
        cpus: 1,
        ram_mb: 192,
        tenant: 't1',
        egress: { mode: 'none' },
      }),
      (e: AppError) => e.code === 'CHECKPOINT_NOT_LIVE',
    );
    assert.equal((await a.client.listVms()).filter((v) => v.name === 'qmm-t').length, 0, 'nothing half-made is left');
    await a.client.deleteCheckpoint('qmm-tampered');
  });

  it('moves a paused VM to another agent: the checkpoint travels under a grant and resumes there, counter and all', async () => {
    const before = await count(a, vm);
    const paused = await a.client.pauseVm(vm, { id: 'qmm-move' }, { timeoutMs: 180_000 });
    const grant = await a.client.grantArtifact('qmm-move', 60);
    const moved = await b.client.pullArtifact({
      snapshot_id: 'qmm-move',
      digest: paused.checkpoint.digest,
      files: paused.checkpoint.files,
      from: { url: a.url, grant: grant.grant },
    });
    assert.equal(moved.kind, 'live');
    const there = await b.client.createVm(
      {
        name: vm,
        checkpoint_id: 'qmm-move',
        resume: true,
        cpus: 1,
        ram_mb: 192,
        tenant: 't1',
        expose: [{ port: 8080, as: 'http' }],
        egress: { mode: 'none' },
      },
      { timeoutMs: 300_000 },
    );
    assert.equal(there.ip, '10.251.8.2', "an address of the target's subnet");
    const after = await count(b, vm);
    assert.ok(after >= before && after < before + 40, `counter ${before} on the source, ${after} on the target`);
    const ep = there.endpoints.find((e) => e.as === 'http');
    assert.equal(await (await fetch(`${ep!.url}/mark`)).text(), 'before-snapshot\n');
    await a.client.destroyVm(vm);
    assert.equal(
      (await a.client.listCheckpoints()).filter((c) => c.id === 'qmm-move').length,
      0,
      "the source's pause checkpoint went with it",
    );
  });

  const spec = { name: vm, cpus: 1, ram_mb: 192, tenant: 't1', expose: [{ port: 8080, as: 'http' }], egress: { mode: 'none' } };

  it('never streams a guest to a listener that lacks the key the target minted: the send fails and the VM runs on', async () => {
    const got: Buffer[] = [];
    const rogue = createServer((c) => {
      c.on('data', (d: Buffer) => got.push(d));
      c.on('error', () => undefined);
      setTimeout(() => c.destroy(), 1500);
    });
    await new Promise<void>((res) => rogue.listen(0, '127.0.0.1', res));
    try {
      const port = (rogue.address() as AddressInfo).port;
      const res = await api(
        b,
        'POST',
        `/vms/${vm}/migration/send`,
        { to: { uri: `tcp:127.0.0.1:${port}`, psk: 'ab'.repeat(32) } },
        // Either answer parses, so a send that "succeeded" fails on its status, not on its shape.
        errorBodySchema.or(migrationReportSchema),
      );
      assert.equal(res.status, 424);
      assert.ok('code' in res.body && res.body.code === 'MIGRATION_FAILED');
    } finally {
      rogue.close();
    }
    const bytes = Buffer.concat(got);
    assert.ok(bytes.length > 0, 'the source did connect');
    assert.equal(bytes.indexOf('QEVM'), -1, 'no migration stream in the clear');
    assert.equal(bytes[0], 0x16, 'a TLS handshake record, nothing else');
    const c = await count(b, vm);
    await new Promise((r) => setTimeout(r, 1000));
    assert.ok((await count(b, vm)) > c, 'the source VM runs on');
  });

  it('live-migrates between two agents over a TLS stream the target keyed: memory and disk arrive, keep_paused holds it', async () => {
    const offer = await api(b, 'GET', `/vms/${vm}/migration/offer`, undefined, migrationOfferSchema);
    assert.equal(offer.status, 200);
    const incoming = await api(a, 'POST', '/migrations/incoming', { vm: spec, machine: offer.body.machine }, incomingMigrationSchema);
    assert.equal(incoming.status, 201, JSON.stringify(incoming.body));
    assert.match(incoming.body.uri, /^tcp:127\.0\.0\.1:\d+$/);
    // A sender without the key: its stream (here a forged header) is never read as a migration; the target waits on.
    const [host, port] = incoming.body.uri.slice('tcp:'.length).split(':');
    await new Promise<void>((resolve) => {
      const c = createConnection({ host: host!, port: Number(port) }, () =>
        c.end(Buffer.concat([Buffer.from('QEVM'), Buffer.alloc(4096)])),
      );
      c.on('error', () => resolve());
      c.on('close', () => resolve());
    });
    await b.client.exec(vm, { argv: ['sh', '-c', 'echo migrated-disk > /root/mark2'] });
    const before = await count(b, vm);
    const t0 = Date.now();
    const sent = await api(
      b,
      'POST',
      `/vms/${vm}/migration/send`,
      { to: { uri: incoming.body.uri, psk: incoming.body.psk } },
      migrationReportSchema,
    );
    assert.equal(sent.status, 200, JSON.stringify(sent.body));
    console.log(
      `# live migration: total ${Date.now() - t0} ms, QEMU downtime ${sent.body.downtime_ms} ms, ${sent.body.transferred_bytes} B`,
    );
    assert.equal((await b.client.getVm(vm)).state, 'paused', 'the source stays stopped once sent');

    const done = await api(a, 'POST', `/vms/${vm}/migration/complete`, { keep_paused: true }, vmInfoSchema);
    assert.equal(done.status, 200, JSON.stringify(done.body));
    assert.equal(done.body.state, 'paused', 'keep_paused: landed, frozen');
    await assert.rejects(a.client.exec(vm, { argv: ['true'] }), (e: AppError) => e.code === 'SANDBOX_NOT_RUNNING');
    const running = await a.client.resumeVm(vm, { timeoutMs: 180_000 });
    assert.equal(running.state, 'running');
    assert.equal(running.ip, '10.251.7.2', "the target's address");
    const after = await count(a, vm);
    assert.ok(after >= before && after < before + 60, `counter ${before} on the source, ${after} on the target`);
    assert.equal((await a.client.exec(vm, { argv: ['cat', '/root/mark2'] })).stdout, 'migrated-disk\n', 'the disk came in the stream');
    const ep = running.endpoints.find((e) => e.as === 'http');
    assert.equal(await (await fetch(`${ep!.url}/mark2`)).text(), 'migrated-disk\n');
    await b.client.destroyVm(vm);
    assert.equal((await b.client.listVms()).length, 0);
  });

  it('gives up a prepared migration at once: its QEMU and directory go, the name is free again, a second abort finds none', async () => {
    const offer = await api(a, 'GET', `/vms/${vm}/migration/offer`, undefined, migrationOfferSchema);
    const first = await api(b, 'POST', '/migrations/incoming', { vm: spec, machine: offer.body.machine }, incomingMigrationSchema);
    assert.equal(first.status, 201, JSON.stringify(first.body));
    const dir = join(dataDirOf(b), 'qemu/vms', vm);
    const pid = Number((await readFile(join(dir, 'qemu.pid'), 'utf8')).trim());
    assert.ok(alive(pid), 'a QEMU waits for the stream');
    const aborted = await api(b, 'DELETE', `/migrations/incoming/${vm}`, undefined, abortedMigrationSchema);
    assert.deepEqual(aborted.body, { name: vm, aborted: true });
    assert.ok(!alive(pid), 'its QEMU ended');
    assert.ok(!existsSync(dir), 'its directory is gone');
    assert.deepEqual((await api(b, 'DELETE', `/migrations/incoming/${vm}`, undefined, abortedMigrationSchema)).body, {
      name: vm,
      aborted: false,
    });
    // The running source is no incoming migration: an abort there touches nothing.
    assert.equal((await api(a, 'DELETE', `/migrations/incoming/${vm}`, undefined, abortedMigrationSchema)).body.aborted, false);
    assert.equal((await a.client.getVm(vm)).state, 'running');
    const again = await api(b, 'POST', '/migrations/incoming', { vm: spec, machine: offer.body.machine }, incomingMigrationSchema);
    assert.equal(again.status, 201, `the name is free again: ${JSON.stringify(again.body)}`);
    assert.equal((await api(b, 'DELETE', `/migrations/incoming/${vm}`, undefined, abortedMigrationSchema)).body.aborted, true);
  });

  it('migrates lazily (post-copy): the guest runs on the target before its memory has all arrived, and the source goes once it has', async () => {
    if (!existsSync('/proc/sys/vm/unprivileged_userfaultfd')) return;
    const offer = await api(a, 'GET', `/vms/${vm}/migration/offer`, undefined, migrationOfferSchema);
    const incoming = await api(
      b,
      'POST',
      '/migrations/incoming',
      { vm: spec, machine: offer.body.machine, lazy: true },
      incomingMigrationSchema,
    );
    assert.equal(incoming.status, 201, JSON.stringify(incoming.body));
    const before = await count(a, vm);
    const sent = await api(
      a,
      'POST',
      `/vms/${vm}/migration/send`,
      { to: { uri: incoming.body.uri, psk: incoming.body.psk }, lazy: true },
      migrationReportSchema,
    );
    assert.equal(sent.status, 200, JSON.stringify(sent.body));
    assert.equal(sent.body.lazy, true);
    const done = await api(b, 'POST', `/vms/${vm}/migration/complete`, {}, vmInfoSchema);
    assert.equal(done.status, 200, JSON.stringify(done.body));
    console.log(`# lazy migration: switch-over after ${sent.body.downtime_ms} ms, ${sent.body.transferred_bytes} B before it`);
    assert.equal(done.body.state, 'running');
    const after = await count(b, vm);
    assert.ok(after >= before && after < before + 60, `counter ${before} on the source, ${after} on the target`);
    // Destroying the source waits for its last page: the target's guest lives on.
    await a.client.destroyVm(vm, { timeoutMs: 600_000 });
    const c = await count(b, vm);
    await new Promise((r) => setTimeout(r, 1000));
    assert.ok((await count(b, vm)) > c, 'the guest runs on without the source');
    assert.equal((await b.client.exec(vm, { argv: ['cat', '/root/mark2'] })).stdout, 'migrated-disk\n');
  });
  it('keeps saying "not done" after the target agent restarts mid post-copy, until QEMU says the stream completed', async () => {
    if (!existsSync('/proc/sys/vm/unprivileged_userfaultfd')) return;
    // 32 MB of random memory on the source (b, since the last move) and 1 MiB/s once switched: half a minute of post-copy.
    const filled = await b.client.exec(vm, {
      argv: ['sh', '-c', 'head -c 33554432 /dev/urandom > /tmp/ballast && echo filled'],
      timeout_ms: 180_000,
    });
    assert.equal(filled.stdout.trim(), 'filled');
    const sourceQmp = join(dataDirOf(b), 'qemu/run', `${nameHash(vm)}.qmp`);
    await qmp(sourceQmp, 'migrate-set-parameters', { 'max-postcopy-bandwidth': 1024 * 1024 });
    const offer = await api(b, 'GET', `/vms/${vm}/migration/offer`, undefined, migrationOfferSchema);
    const incoming = await api(
      a,
      'POST',
      '/migrations/incoming',
      { vm: spec, machine: offer.body.machine, lazy: true },
      incomingMigrationSchema,
    );
    assert.equal(incoming.status, 201, JSON.stringify(incoming.body));
    const sent = await api(
      b,
      'POST',
      `/vms/${vm}/migration/send`,
      { to: { uri: incoming.body.uri, psk: incoming.body.psk }, lazy: true },
      migrationReportSchema,
    );
    assert.equal(sent.status, 200, JSON.stringify(sent.body));
    const done = await api(a, 'POST', `/vms/${vm}/migration/complete`, {}, vmInfoSchema);
    assert.equal(done.status, 200, JSON.stringify(done.body));
    const memory = async (): Promise<z.infer<typeof memorySchema>> => {
      const res = await api(a, 'GET', `/vms/${vm}/memory`, undefined, memorySchema);
      assert.equal(res.status, 200, JSON.stringify(res.body));
      return res.body;
    };
    assert.deepEqual(await memory(), { resident_chunks: 0, total_chunks: 1, done: false });

    const statePath = join(dataDirOf(a), 'qemu/vms', vm, 'state.json');
    const targetPid = Number((await readFile(join(dataDirOf(a), 'qemu/vms', vm, 'qemu.pid'), 'utf8')).trim());
    await a.kill();
    assert.ok(alive(targetPid), 'the target QEMU outlives its agent');
    const restarted = await start(join(root, 'data-a'), A);
    agents.splice(agents.indexOf(a), 1, restarted);
    a = restarted;
    assert.deepEqual(await memory(), { resident_chunks: 0, total_chunks: 1, done: false }, 'a restarted agent still asks QEMU');
    assert.equal((JSON.parse(await readFile(statePath, 'utf8')) as { postcopy_incoming?: boolean }).postcopy_incoming, true);

    await qmp(sourceQmp, 'migrate-set-parameters', { 'max-postcopy-bandwidth': 0 });
    let last = await memory();
    for (let i = 0; i < 600 && !last.done && !last.error; i++) {
      await new Promise((r) => setTimeout(r, 500));
      last = await memory();
    }
    assert.deepEqual(last, { resident_chunks: 1, total_chunks: 1, done: true });
    assert.equal((JSON.parse(await readFile(statePath, 'utf8')) as { postcopy_incoming?: boolean }).postcopy_incoming, undefined);
    await b.client.destroyVm(vm, { timeoutMs: 600_000 });
    const c = await count(a, vm);
    await new Promise((r) => setTimeout(r, 1000));
    assert.ok((await count(a, vm)) > c, 'the guest runs on without the source');
  });
});
