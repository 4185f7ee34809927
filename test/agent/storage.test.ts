import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readdir, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { ProcessBackend, type ProcessBackendOptions } from '../../packages/agent/src/backend/process/process-backend.js';
import { expectedArchiveBytes } from '../../packages/agent/src/backend/process/checkpoints.js';
import { loopDevices, mountPoints } from '../../packages/agent/src/backend/process/storage.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { collect, type Ran } from '../support/process.js';

/**
 * storage_gb on the process backend: each sandbox's writable layer is its
 * own ext4 disk (storage.ts). Real sandboxes, real loop devices; every loop
 * device and mount made here is gone when the file ends.
 */

function missingFeature(): string | undefined {
  if (process.platform !== 'linux') return 'Linux';
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  for (const tool of ['unshare', 'nsenter', 'setpriv', 'ip', 'tar', 'losetup', 'mkfs.ext4', 'fallocate']) {
    if (spawnSync('sh', ['-c', `command -v ${tool}`]).status !== 0) return `${tool} (util-linux / mount / e2fsprogs / iproute2 / tar)`;
  }
  if (!existsSync('/dev/loop-control')) return 'loop devices (/dev/loop-control)';
  return undefined;
}
const skip = missingFeature();
if (skip) console.log(`# SKIP storage tests: host feature missing: ${skip}`);

const GIB = 1024 ** 3;
const MIB = 1024 ** 2;

async function run(b: ProcessBackend, name: string, script: string, timeoutMs = 60_000): Promise<Ran> {
  return collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }), timeoutMs);
}

async function rejectsWithCode(p: Promise<unknown>, code: string): Promise<void> {
  await assert.rejects(p, (err: unknown) => {
    assert.ok(err instanceof AppError, `expected an AppError, got ${String(err)}`);
    assert.equal(err.code, code, err.message);
    return true;
  });
}

describe(
  'process backend: a disk of its own per sandbox (storage_gb)',
  { skip: skip ? `host feature missing: ${skip}` : false, timeout: 300_000 },
  () => {
    let root: string;
    let imageDir: string;
    let options: ProcessBackendOptions;
    let b: ProcessBackend;
    const backends: ProcessBackend[] = [];
    const prefix = `q${randomBytes(2).toString('hex')}`;
    const ofRoot = async (): Promise<string[]> =>
      (await loopDevices()).filter((l) => l.backingFile.startsWith(`${root}/`)).map((l) => l.name);

    before(async () => {
      root = await mkdtemp(join(tmpdir(), 'pb-storage-'));
      imageDir = join(root, 'images');
      await buildImage(imageDir, 'base');
      options = {
        dataDir: join(root, 'data'),
        imageDir,
        subnet: `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`,
        bridgePrefix: prefix,
        maxSandboxes: 8,
      };
      b = await ProcessBackend.open(options);
      backends.push(b);
    });

    after(async () => {
      for (const backend of backends) {
        for (const s of await backend.list().catch(() => [])) await backend.destroy(s.name).catch(() => undefined);
        await backend.prune().catch(() => undefined);
        await backend.close().catch(() => undefined);
      }
      // Whatever a failed assertion left: no mount or loop device of ours survives the file.
      for (const m of [...(await mountPoints())].filter((p) => p.startsWith(`${root}/`)).sort((x, y) => y.length - x.length))
        spawnSync('umount', ['-l', m]);
      for (const dev of await ofRoot()) spawnSync('losetup', ['-d', dev]);
      const links = spawnSync('ip', ['-j', 'link', 'show'], { encoding: 'utf8' }).stdout;
      for (const l of (JSON.parse(links || '[]') as Array<{ ifname: string }>).map((x) => x.ifname.split('@')[0]!)) {
        if (l.startsWith(prefix)) spawnSync('ip', ['link', 'del', l]);
      }
      await rm(root, { recursive: true, force: true });
    });

    test('writing past storage_gb fails inside with ENOSPC; the host keeps its free space; the sandbox recovers once it deletes', async () => {
      const info = await b.create({ name: 'full', cpus: 1, ram_mb: 128, tenant: 'acme', storage_gb: 1 });
      const dir = join(options.dataDir, 'sandboxes', 'full');
      const df = await run(b, 'full', 'df -k / | tail -1');
      const sizeKb = Number(df.stdout.trim().split(/\s+/)[1]);
      assert.ok(sizeKb > 0.9 * 1024 * 1024 && sizeKb <= 1024 * 1024, `the guest sees a 1 GiB disk: ${df.stdout}`);

      // What this sandbox holds on the host's filesystem (`du -x`: its directory, not the disk mounted inside it); the
      // host's free space would count whatever else runs on this machine.
      const onHost = (): number => Number(spawnSync('du', ['-skx', dir], { encoding: 'utf8' }).stdout.split(/\s/)[0]) * 1024;
      const hostBefore = onHost();
      const dd = await run(b, 'full', 'dd if=/dev/zero of=/root/big bs=1M count=1536; echo "dd exit $?"', 120_000);
      assert.match(dd.stderr, /No space left on device/, dd.stderr);
      assert.match(dd.stdout, /dd exit [1-9]/);
      const spent = onHost() - hostBefore;
      // Without the disk the guest would have written 1.5 GiB into its directory here.
      assert.ok(spent < 256 * MIB, `the host's filesystem lost ${Math.round(spent / MIB)} MiB`);
      const img = await stat(join(dir, 'disk.img'));
      assert.equal(img.size, GIB, 'the image is exactly storage_gb');
      assert.ok(img.blocks * 512 <= GIB + 8 * MIB, `the image holds at most storage_gb on the host (${img.blocks * 512})`);

      const after = await run(b, 'full', 'rm /root/big && echo fine > /root/after && cat /root/after');
      assert.equal(after.stdout, 'fine\n', after.stderr);
      assert.ok(info.init_pid > 0);

      await b.destroy('full');
      assert.ok(!(await mountPoints()).has(join(dir, 'disk')), 'the disk is unmounted');
      assert.deepEqual(await ofRoot(), [], 'its loop device is detached');
      assert.ok(!existsSync(dir));
    });

    test('a 100 GiB sparse file fits a 1 GiB disk, checkpoints small, and restores sparse with its data', async (t) => {
      await b.create({ name: 'sparse', cpus: 1, ram_mb: 128, tenant: 'acme', storage_gb: 1 });
      const made = await run(
        b,
        'sparse',
        'truncate -s 100G /root/holes && dd if=/dev/urandom of=/root/holes bs=4096 count=4 seek=1000000 conv=notrunc 2>/dev/null && dd if=/root/holes bs=4096 skip=1000000 count=4 2>/dev/null | md5sum',
      );
      assert.equal(made.exitCode, 0, made.stderr);
      const sum = made.stdout.trim().split(/\s+/)[0];

      const usage = await b.layerUsage('sparse');
      assert.equal(usage.limit_bytes, GIB);
      assert.ok(usage.used_bytes < 4 * MIB, `holes take no space: ${JSON.stringify(usage)}`);
      // maxBytes: were the holes archived as zeros, this fails fast instead of writing 100 GiB.
      const cp = await b.checkpoint('sparse', { comment: 'sparse', maxBytes: 64 * MIB });
      assert.ok(cp.size_bytes < MIB, `the archive stores data regions only: ${cp.size_bytes} bytes`);
      t.diagnostic(`checkpoint of a 100 GiB sparse file holding 16 KiB: ${cp.size_bytes} bytes`);
      assert.ok(
        usage.expected_archive_bytes >= cp.size_bytes,
        `the estimate (${usage.expected_archive_bytes}) bounds the archive (${cp.size_bytes})`,
      );

      await b.create({ name: 'sparse-copy', checkpointId: cp.id, cpus: 1, ram_mb: 128, tenant: 'acme', storage_gb: 1 });
      const back = await run(
        b,
        'sparse-copy',
        'stat -c "%s %b %B" /root/holes && dd if=/root/holes bs=4096 skip=1000000 count=4 2>/dev/null | md5sum',
      );
      const [size, blocks, unit, restoredSum] = back.stdout.trim().split(/\s+/);
      assert.equal(Number(size), 100 * GIB, back.stdout);
      assert.ok(Number(blocks) * Number(unit) < 4 * MIB, `restored sparse: ${back.stdout}`);
      assert.equal(restoredSum, sum, 'the data region survives');
      await b.destroy('sparse-copy');
      await b.deleteCheckpoint(cp.id);
    });

    test('the expected archive size bounds a real one; an archive past maxBytes is abandoned and leaves nothing', async () => {
      const made = await run(
        b,
        'sparse',
        'rm /root/holes && mkdir -p /root/many && for i in $(seq 1 300); do echo "file $i" > /root/many/f$i; done; dd if=/dev/urandom of=/root/rand bs=1M count=3 2>/dev/null; echo ok',
      );
      assert.equal(made.stdout.trim(), 'ok', made.stderr);
      const usage = await b.layerUsage('sparse');
      assert.equal(usage.expected_archive_bytes, expectedArchiveBytes(usage));
      // Every checkpoint here is bounded: should a boundary break, a test fails instead of filling the host's disk.
      const cp = await b.checkpoint('sparse', { maxBytes: 64 * MIB });
      assert.ok(usage.expected_archive_bytes >= cp.size_bytes, `estimate ${usage.expected_archive_bytes} < archive ${cp.size_bytes}`);
      await b.deleteCheckpoint(cp.id);

      await rejectsWithCode(b.checkpoint('sparse', { id: 'too-big', maxBytes: MIB }), 'CHECKPOINT_TOO_LARGE');
      await rejectsWithCode(b.getCheckpoint('too-big'), 'CHECKPOINT_NOT_FOUND');
      const leftovers = (await readdir(join(options.dataDir, 'checkpoints'))).filter((e) => e.includes('too-big'));
      assert.deepEqual(leftovers, []);
      assert.equal((await run(b, 'sparse', 'echo thawed')).stdout, 'thawed\n', 'the sandbox is not left frozen');
    });

    test('a restarted agent keeps the disk; one whose mount vanished (a reboot) mounts it again over the same loop device', async () => {
      const dir = join(options.dataDir, 'sandboxes', 'sparse');
      assert.equal((await run(b, 'sparse', 'echo before > /root/restart')).exitCode, 0);
      await b.close();
      b = await ProcessBackend.open(options);
      backends.push(b);
      assert.equal((await run(b, 'sparse', 'cat /root/restart')).stdout, 'before\n');

      // The host-side mount goes; the sandbox's namespace still holds the filesystem.
      assert.equal(spawnSync('umount', [join(dir, 'disk')]).status, 0);
      assert.equal((await run(b, 'sparse', 'echo while-unmounted > /root/later')).exitCode, 0);
      await b.close();
      b = await ProcessBackend.open(options);
      backends.push(b);
      assert.ok((await mountPoints()).has(join(dir, 'disk')), 'mounted again');
      assert.equal((await ofRoot()).length, 1, 'one loop device for the image, never a second mount of its blocks');
      const cp = await b.checkpoint('sparse', { maxBytes: 64 * MIB });
      await b.create({ name: 'after-reboot', checkpointId: cp.id, cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 1 });
      assert.equal((await run(b, 'after-reboot', 'cat /root/later')).stdout, 'while-unmounted\n');
      await b.destroy('after-reboot');
      await b.deleteCheckpoint(cp.id);
      await b.destroy('sparse');
      assert.deepEqual(await ofRoot(), []);
    });

    test('prune detaches a loop device over an image no sandbox owns, and leaves a live sandbox its disk', async () => {
      await b.create({ name: 'keeper', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 1 });
      const ghost = join(options.dataDir, 'sandboxes', 'ghost');
      await mkdir(ghost, { recursive: true });
      assert.equal(spawnSync('truncate', ['-s', '8M', join(ghost, 'disk.img')]).status, 0);
      const attached = spawnSync('losetup', ['-f', '--show', join(ghost, 'disk.img')], { encoding: 'utf8' });
      assert.equal(attached.status, 0, attached.stderr);
      const dev = attached.stdout.trim();
      const report = await b.prune();
      assert.ok(
        report.loopDevices.some((l) => l.startsWith(`${dev} `)),
        JSON.stringify(report),
      );
      assert.ok(!(await loopDevices()).some((l) => l.name === dev && l.backingFile.startsWith(ghost)));
      assert.ok((await mountPoints()).has(join(options.dataDir, 'sandboxes', 'keeper', 'disk')), "a live sandbox's disk stays mounted");
      assert.equal((await run(b, 'keeper', 'echo ok > /root/x && cat /root/x')).stdout, 'ok\n');
      await b.destroy('keeper');
      assert.deepEqual(await ofRoot(), []);
    });

    test('capacity counts a sandbox disk once: its preallocated image is added back to the probed free space', async () => {
      const before = (await b.capacity()).storage_gb;
      await b.create({ name: 'big-disk', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: 4 });
      try {
        const during = (await b.capacity()).storage_gb;
        // Placement subtracts the VM's 4 GiB itself; other writers on this shared filesystem explain a GiB either way.
        assert.ok(Math.abs(during - before) <= 1, `capacity moved from ${before} to ${during} GiB`);
        // Long enough for ext4's lazy inode-table init to have run: unless the disk is mounted noinit_itable,
        // its zeroing reaches the image as hole punches (about 32 MiB per 2 GiB within seconds).
        await new Promise((r) => setTimeout(r, 6000));
        const img = await stat(join(options.dataDir, 'sandboxes', 'big-disk', 'disk.img'));
        assert.ok(img.blocks * 512 >= 4 * GIB, `preallocated: ${img.blocks * 512} of ${4 * GIB} bytes allocated`);
      } finally {
        await b.destroy('big-disk');
      }
    });

    test('what the disk costs: create → first exec with and without one (diagnostic)', async (t) => {
      const p50 = async (storageGb: number): Promise<number> => {
        const lat: number[] = [];
        for (let i = 0; i < 10; i++) {
          const t0 = performance.now();
          await b.create({ name: `cost-${storageGb}-${i}`, cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: storageGb });
          assert.equal((await run(b, `cost-${storageGb}-${i}`, 'true')).exitCode, 0);
          lat.push(performance.now() - t0);
          await b.destroy(`cost-${storageGb}-${i}`);
        }
        return lat.sort((x, y) => x - y)[5]!;
      };
      const without = await p50(0);
      const withDisk = await p50(1);
      t.diagnostic(`create→first exec p50: ${withDisk.toFixed(1)} ms with a 1 GiB disk, ${without.toFixed(1)} ms without`);
      assert.ok(withDisk < 2000, `p50 ${withDisk} ms`);
      assert.deepEqual(await ofRoot(), []);
    });

    test('storage_gb 0 keeps the layer on the data directory (no disk); a bad storage_gb is refused', async () => {
      await b.create({ name: 'nodisk', cpus: 1, ram_mb: 64, tenant: 'acme' });
      const dir = join(options.dataDir, 'sandboxes', 'nodisk');
      assert.ok(existsSync(join(dir, 'upper')) && !existsSync(join(dir, 'disk.img')));
      assert.equal((await b.layerUsage('nodisk')).limit_bytes, 0);
      await b.destroy('nodisk');
      await rejectsWithCode(b.create({ name: 'neg', cpus: 1, ram_mb: 64, tenant: 'acme', storage_gb: -1 }), 'INVALID_SANDBOX_SPEC');
    });
  },
);
