import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createReadStream, existsSync } from 'node:fs';
import { mkdtemp, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { AgentConfigError, parseAgentEnv } from '../../packages/agent/src/config.js';
import { ProcessBackend, type ProcessBackendOptions } from '../../packages/agent/src/backend/process/process-backend.js';
import { DISK_POOL_DIR } from '../../packages/agent/src/backend/process/disk-pool.js';
import { listLinks } from '../../packages/agent/src/backend/process/network.js';
import { loopDevices, mountPoints } from '../../packages/agent/src/backend/process/storage.js';
import { collect, type Ran } from '../support/process.js';
import { missingPrerequisite, prepareImages, startAgent, type AgentOptions, type RunningAgent } from './harness.js';

/**
 * The disk pool (disk-pool.ts): sandbox disks formatted ahead of creates.
 * Correctness, not speed: a create takes a pooled image and the pool refills,
 * size 0 works, concurrent creates never share an image, a new sandbox never
 * sees what an earlier one left (files, network), and an agent SIGKILLed with
 * a full pool leaves nothing behind once restarted and stopped. Every object
 * here is named with this file's own prefix and removed at the end.
 */

const skip = (await missingPrerequisite()) ?? (existsSync('/dev/loop-control') ? undefined : 'loop devices (/dev/loop-control)');
if (skip) console.log(`# SKIP disk pool tests: ${skip}`);

const GIB = 1024 ** 3;
const prefixOf = (): string => `k${randomBytes(2).toString('hex')}`;
const subnetOf = (): string => `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`;

async function run(b: ProcessBackend, name: string, script: string): Promise<Ran> {
  return collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }), 60_000);
}

async function until<T>(what: string, fn: () => Promise<T | undefined> | T | undefined, ms = 60_000): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v !== undefined) return v;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Images in the pool directory, by name. */
async function poolFiles(dataDir: string): Promise<string[]> {
  return (await readdir(join(dataDir, DISK_POOL_DIR)).catch(() => [] as string[])).sort();
}

/** Whether the file's bytes contain `needle` anywhere (a raw scan of a disk image). */
async function fileContains(path: string, needle: string): Promise<boolean> {
  const want = Buffer.from(needle);
  let tail = Buffer.alloc(0);
  for await (const chunk of createReadStream(path, { highWaterMark: 4 * 1024 * 1024 })) {
    const buf = Buffer.concat([tail, chunk as Buffer]);
    if (buf.includes(want)) return true;
    tail = buf.subarray(Math.max(0, buf.length - want.length + 1));
  }
  return false;
}

describe('disk pool settings', () => {
  test('AGENT_DISK_POOL defaults to 2 images of AGENT_DISK_POOL_GB 1; bad values are named', () => {
    const token = 'a-token-of-enough-length';
    const ok = parseAgentEnv({ AGENT_TOKEN: token });
    assert.deepEqual([ok.AGENT_DISK_POOL, ok.AGENT_DISK_POOL_GB], [2, 1]);
    assert.equal(parseAgentEnv({ AGENT_TOKEN: token, AGENT_DISK_POOL: '0' }).AGENT_DISK_POOL, 0);
    assert.throws(
      () => parseAgentEnv({ AGENT_TOKEN: token, AGENT_DISK_POOL: '-1', AGENT_DISK_POOL_GB: '0' }),
      (err: unknown) => {
        assert.ok(err instanceof AgentConfigError);
        assert.match(err.message, /AGENT_DISK_POOL: must be 0 or more/);
        assert.match(err.message, /AGENT_DISK_POOL_GB: at least 1/);
        return true;
      },
    );
    assert.throws(() => parseAgentEnv({ AGENT_TOKEN: token, AGENT_DISK_POOL: 'many' }), /AGENT_DISK_POOL:/);
  });
});

describe('process backend: the disk pool', { skip: skip ?? false, timeout: 600_000 }, () => {
  let root: string;
  let imageDir: string;
  const backends: ProcessBackend[] = [];
  const agents: RunningAgent[] = [];
  const prefixes: string[] = [];

  const open = async (extra: Partial<ProcessBackendOptions>): Promise<{ b: ProcessBackend; dataDir: string }> => {
    const prefix = prefixOf();
    prefixes.push(prefix);
    const dataDir = join(root, `data-${prefix}`);
    const b = await ProcessBackend.open({ dataDir, imageDir, subnet: subnetOf(), bridgePrefix: prefix, maxSandboxes: 8, ...extra });
    backends.push(b);
    return { b, dataDir };
  };

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'pb-diskpool-'));
    const images = await prepareImages();
    if ('skip' in images) throw new Error(images.skip);
    imageDir = images.imageDir;
  });

  after(async () => {
    // A test that failed midway leaves its agent's sandboxes running: destroy them through the agent still up.
    for (const a of agents) {
      if (a.proc.exitCode !== null || a.proc.signalCode !== null) continue;
      for (const v of await a.client.listVms().catch(() => [])) await a.client.destroyVm(v.name, { force: true }).catch(() => undefined);
      await a.stop();
    }
    // And whatever still runs in our cgroups (a sandbox of a killed agent).
    for (const p of prefixes) {
      for (const c of ['pids', 'unified', '']) {
        const parent = join('/sys/fs/cgroup', c, `fleet-${p}`);
        for (const child of await readdir(parent, { withFileTypes: true }).catch(() => [])) {
          if (!child.isDirectory()) continue;
          const procs = await readFile(join(parent, child.name, 'cgroup.procs'), 'utf8').catch(() => '');
          for (const pid of procs.split('\n').filter(Boolean)) spawnSync('kill', ['-9', pid]);
        }
      }
    }
    for (const b of backends) {
      for (const s of await b.list().catch(() => [])) await b.destroy(s.name).catch(() => undefined);
      await b.prune().catch(() => undefined);
      await b.close().catch(() => undefined);
    }
    for (const m of [...(await mountPoints())].filter((p) => p.startsWith(`${root}/`)).sort((x, y) => y.length - x.length))
      spawnSync('umount', ['-l', m]);
    for (const l of await loopDevices()) if (l.backingFile.startsWith(`${root}/`)) spawnSync('losetup', ['-d', l.name]);
    const links = spawnSync('ip', ['-j', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const l of (JSON.parse(links || '[]') as Array<{ ifname: string }>).map((x) => x.ifname.split('@')[0]!)) {
      if (prefixes.some((p) => l.startsWith(p))) spawnSync('ip', ['link', 'del', l]);
    }
    for (const p of prefixes) {
      for (const family of ['inet', 'bridge']) spawnSync('nft', ['delete', 'table', family, `fleet_${p}`], { stdio: 'ignore' });
      for (const c of await readdir('/sys/fs/cgroup').catch(() => [] as string[])) {
        const parent = join('/sys/fs/cgroup', c, `fleet-${p}`);
        for (const child of await readdir(parent, { withFileTypes: true }).catch(() => [])) {
          if (child.isDirectory()) spawnSync('rmdir', [join(parent, child.name)], { stdio: 'ignore' });
        }
        spawnSync('rmdir', [parent], { stdio: 'ignore' });
      }
      spawnSync('rmdir', [join('/sys/fs/cgroup', `fleet-${p}`)], { stdio: 'ignore' });
    }
    await rm(root, { recursive: true, force: true });
  });

  test('a create takes a pooled disk (renamed in, not formatted) and the pool refills', async () => {
    const { b, dataDir } = await open({ diskPool: 2 });
    await until('the pool filled', () => (b.diskPool().ready === 2 ? true : undefined));
    const pooled = new Map<number, string>();
    for (const f of await poolFiles(dataDir)) pooled.set((await stat(join(dataDir, DISK_POOL_DIR, f))).ino, f);
    assert.equal(pooled.size, 2);
    assert.ok([...pooled.values()].every((f) => /^ready-[0-9a-f]{16}\.img$/.test(f)));
    // Prune takes nothing of the pool for an orphan.
    const report = await b.prune();
    assert.ok(!JSON.stringify(report).includes(DISK_POOL_DIR), JSON.stringify(report));
    assert.equal(b.diskPool().ready, 2);
    assert.deepEqual((await poolFiles(dataDir)).sort(), [...pooled.values()].sort());

    await b.create({ name: 'taker', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 1 });
    const img = await stat(join(dataDir, 'sandboxes', 'taker', 'disk.img'));
    assert.ok(pooled.has(img.ino), 'the sandbox disk is one of the pooled images');
    assert.equal(img.size, GIB);
    assert.ok(img.blocks * 512 >= GIB, 'still preallocated');
    assert.ok(!(await poolFiles(dataDir)).includes(pooled.get(img.ino)!), 'and it left the pool');
    assert.deepEqual({ ...b.diskPool(), ready: 0 }, { size: 2, gb: 1, ready: 0, taken: 1, missed: 0 });
    // Mounted with the same options as a formatted-here disk, writable layer inside.
    const info = spawnSync('findmnt', ['-n', '-o', 'OPTIONS', join(dataDir, 'sandboxes', 'taker', 'disk')], { encoding: 'utf8' }).stdout;
    assert.match(info, /nosuid/);
    assert.match(info, /nodev/);
    const r = await run(b, 'taker', 'echo kept > /root/f && cat /root/f && df -k / | tail -1');
    assert.equal(r.exitCode, 0, r.stderr);
    assert.match(r.stdout, /^kept\n/);

    await until('the pool refilled', () => (b.diskPool().ready === 2 ? true : undefined));
    const now = await poolFiles(dataDir);
    assert.equal(now.length, 2);
    assert.ok(!now.some((f) => f.startsWith('tmp-')));

    // Another size formats its own and leaves the pool alone.
    await b.create({ name: 'bigger', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 2 });
    assert.equal((await stat(join(dataDir, 'sandboxes', 'bigger', 'disk.img'))).size, 2 * GIB);
    assert.deepEqual(await poolFiles(dataDir), now);
    await b.destroy('bigger');
    await b.destroy('taker');

    // Shutdown deletes what the pool holds.
    await b.close();
    assert.ok(!existsSync(join(dataDir, DISK_POOL_DIR)), 'the pool directory is gone after close');
  });

  test('pool size 0: nothing is kept ready and creates format their own disk', async () => {
    const { b, dataDir } = await open({ diskPool: 0 });
    await b.create({ name: 'plain', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 1 });
    assert.deepEqual(await poolFiles(dataDir), []);
    assert.deepEqual(b.diskPool(), { size: 0, gb: 1, ready: 0, taken: 0, missed: 0 });
    const r = await run(b, 'plain', 'echo ok > /root/x && cat /root/x');
    assert.equal(r.stdout, 'ok\n');
    await b.destroy('plain');
    assert.deepEqual(await poolFiles(dataDir), []);
  });

  test('concurrent creates never get the same disk; each sees only its own files', async () => {
    const { b, dataDir } = await open({ diskPool: 3 });
    await until('the pool filled', () => (b.diskPool().ready === 3 ? true : undefined));
    const pooled = new Set<number>();
    for (const f of await poolFiles(dataDir)) pooled.add((await stat(join(dataDir, DISK_POOL_DIR, f))).ino);
    const names = ['c0', 'c1', 'c2', 'c3', 'c4'];
    await Promise.all(names.map((name) => b.create({ name, cpus: 0.1, ram_mb: 32, tenant: `t-${name}`, storage_gb: 1 })));
    const inos = await Promise.all(names.map(async (n) => (await stat(join(dataDir, 'sandboxes', n, 'disk.img'))).ino));
    assert.equal(new Set(inos).size, names.length, 'five sandboxes, five images');
    assert.equal(inos.filter((i) => pooled.has(i)).length, 3, 'three came from the pool, each once');
    const { taken, missed } = b.diskPool();
    assert.deepEqual({ taken, missed }, { taken: 3, missed: 2 });
    const loops = (await loopDevices()).filter((l) => l.backingFile.startsWith(join(dataDir, 'sandboxes')));
    assert.equal(new Set(loops.map((l) => l.name)).size, names.length, 'one loop device per sandbox');
    for (const n of names) assert.equal((await run(b, n, `echo ${n} > /root/who`)).exitCode, 0);
    for (const n of names) assert.equal((await run(b, n, 'cat /root/who')).stdout, `${n}\n`);
    for (const n of names) await b.destroy(n);
  });

  test("a sandbox on a pooled disk never sees an earlier sandbox's files or network state", async () => {
    const { b, dataDir } = await open({ diskPool: 1 });
    await until('the pool filled', () => (b.diskPool().ready === 1 ? true : undefined));
    const marker = `secret-${randomBytes(16).toString('hex')}`;
    const first = await b.create({ name: 'first', cpus: 1, ram_mb: 64, tenant: 'one', storage_gb: 1 });
    // Its file (synced to its disk), a listener and its address: what a reused disk or namespace would carry over.
    const w = await run(
      b,
      'first',
      `echo ${marker} > /root/secret && sync && (nc -l -p 7777 >/dev/null 2>&1 &) && sleep 0.3 && cat /proc/net/tcp /proc/net/tcp6`,
    );
    assert.equal(w.exitCode, 0, w.stderr);
    assert.match(w.stdout, /:1E61 /i, 'the listener is up in the first sandbox');
    const firstDisk = join(dataDir, 'sandboxes', 'first', 'disk.img');
    assert.ok(await fileContains(firstDisk, marker), "the marker is on the first sandbox's disk");
    await b.destroy('first');

    await until('the pool refilled', () => (b.diskPool().ready >= 1 ? true : undefined));
    for (const f of await poolFiles(dataDir)) assert.ok(!(await fileContains(join(dataDir, DISK_POOL_DIR, f), marker)), `${f} is clean`);
    const second = await b.create({ name: 'second', cpus: 1, ram_mb: 64, tenant: 'two', storage_gb: 1 });
    assert.equal(b.diskPool().taken, 2, 'both sandboxes took their disk from the pool');
    const r = await run(b, 'second', 'ls -A /root; cat /root/secret 2>&1; cat /proc/net/tcp /proc/net/tcp6; ip addr show');
    assert.ok(!r.stdout.includes(marker), r.stdout);
    assert.doesNotMatch(r.stdout, /:1E61 /i, 'no listener of the first sandbox');
    assert.ok(!r.stdout.includes(first.mac), "no link of the first sandbox's");
    assert.ok(r.stdout.includes(second.mac), r.stdout);
    assert.match(r.stdout, new RegExp(`inet ${second.ip.replaceAll('.', '\\.')}/`));
    assert.ok(!(await fileContains(join(dataDir, 'sandboxes', 'second', 'disk.img'), marker)), "no byte of the first sandbox's disk");
    await b.destroy('second');
  });

  test('an agent SIGKILLed with a full pool and restarted leaves no loop device, mount, link, table or file behind', async () => {
    const prefix = prefixOf();
    prefixes.push(prefix);
    const opts: AgentOptions = {
      dataDir: join(root, `agent-${prefix}`),
      imageDir,
      subnet: subnetOf(),
      bridgePrefix: prefix,
      env: { AGENT_DISK_POOL: '3', AGENT_LOG_LEVEL: 'warn' },
    };
    let a = await startAgent(opts, 60_000);
    agents.push(a);
    await until('the pool filled', async () =>
      (await poolFiles(opts.dataDir)).filter((f) => f.startsWith('ready-')).length === 3 ? true : undefined,
    );
    await a.client.createVm({ name: 'survivor', image: 'base', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 1 });
    await until('the pool refilled', async () =>
      (await poolFiles(opts.dataDir)).filter((f) => f.startsWith('ready-')).length === 3 ? true : undefined,
    );
    const before = await poolFiles(opts.dataDir);
    // What a kill in the middle of a fill leaves.
    await writeFile(join(opts.dataDir, DISK_POOL_DIR, 'tmp-00000000deadbeef.img'), 'half-made');
    await a.kill();

    a = await startAgent(opts, 60_000);
    agents.push(a);
    await until('the restarted pool filled', async () => {
      const f = await poolFiles(opts.dataDir);
      return f.length === 3 && f.every((x) => x.startsWith('ready-')) ? f : undefined;
    });
    const after1 = await poolFiles(opts.dataDir);
    assert.deepEqual(
      after1.filter((f) => before.includes(f)),
      [],
      "no image of the killed agent's pool is handed out",
    );
    assert.equal((await a.client.exec('survivor', { argv: ['true'] })).exit_code, 0, 'the sandbox survived the kill');
    const ours = async (): Promise<{ loops: string[]; mounts: string[] }> => ({
      loops: (await loopDevices()).filter((l) => l.backingFile.startsWith(`${opts.dataDir}/`)).map((l) => l.backingFile),
      mounts: [...(await mountPoints())].filter((m) => m.startsWith(`${opts.dataDir}/`)),
    });
    assert.deepEqual(await ours(), {
      loops: [join(opts.dataDir, 'sandboxes', 'survivor', 'disk.img')],
      mounts: [join(opts.dataDir, 'sandboxes', 'survivor', 'disk')],
    });

    await a.client.destroyVm('survivor');
    await a.stop();
    await a.cleanupHost();
    assert.deepEqual(await ours(), { loops: [], mounts: [] });
    assert.deepEqual(await poolFiles(opts.dataDir), [], 'a clean shutdown deletes the pool');
    assert.deepEqual(
      (await listLinks('veth')).concat(await listLinks('bridge')).filter((l) => l.startsWith(prefix)),
      [],
    );
    const tables = spawnSync('nft', ['list', 'tables'], { encoding: 'utf8' }).stdout;
    assert.ok(!tables.includes(`fleet_${prefix}`), tables);
    assert.deepEqual(await readdir(join(opts.dataDir, 'sandboxes')), []);
  });
});
