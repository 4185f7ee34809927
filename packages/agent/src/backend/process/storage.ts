import { existsSync } from 'node:fs';
import { lstat, mkdir, readdir, readFile, rm, statfs } from 'node:fs/promises';
import { join } from 'node:path';
import { capacityExhausted, featureMissing, sandboxFailed } from '../../backend.js';
import { mustRun, runTool } from './exec-util.js';

/**
 * The per-sandbox disk: `storage_gb` is enforced by giving each sandbox its
 * own ext4 filesystem, in a preallocated image file on a loop device, and
 * putting the overlay's upper and work directories inside it:
 *
 *   <sandbox>/disk.img    the image (storage_gb GiB, fallocated)
 *   <sandbox>/disk/       its mount point, in the agent's mount namespace
 *   <sandbox>/disk/upper  the writable layer (what a checkpoint archives)
 *   <sandbox>/disk/work   overlayfs work dir (same filesystem as upper, as overlayfs requires)
 *
 * Why an image rather than project quotas: quotas need the data dir's
 * filesystem to carry the `quota`/`project` features and a `prjquota` mount,
 * which the host's root filesystem usually has not (and an agent cannot add
 * them without a remount); an image works on any filesystem that can hold a
 * file. Why preallocated rather than sparse: placement already counts
 * storage_gb against the host's disk, so the image takes that space at
 * create, and a guest filling its disk can never fill the host's (a sparse
 * image would be thin provisioning: N guests writing at once could still
 * exhaust the filesystem that also holds checkpoints and, embedded, Postgres,
 * and the guest would then see EIO instead of ENOSPC). `fallocate` and a lazy
 * mkfs cost a few milliseconds whatever the size.
 *
 * The mount lives in the agent's (host) mount namespace so it survives an
 * agent restart and the agent can archive the layer; each sandbox's private
 * mount namespace gets a copy at unshare. storage_gb 0 means no disk of its
 * own: the layer sits in <sandbox>/upper on the data dir's filesystem
 * (direct agent callers only; the control plane always asks for ≥ 1).
 */

export const DISK_IMAGE = 'disk.img';
export const DISK_MOUNT = 'disk';
const GIB = 1024 ** 3;

/** Absolute paths: the agent's PATH (a service manager's, a user's) may lack the sbin directories. */
function tool(name: string, pkg: string): string {
  for (const dir of ['/usr/sbin', '/usr/bin', '/sbin', '/bin']) {
    if (existsSync(`${dir}/${name}`)) return `${dir}/${name}`;
  }
  throw featureMissing(name, `storage_gb needs it: apt-get install ${pkg}`);
}

export interface LayerDirs {
  readonly upper: string;
  readonly work: string;
}

export function layerDirs(sandboxDir: string, storageGb: number): LayerDirs {
  const base = storageGb > 0 ? join(sandboxDir, DISK_MOUNT) : sandboxDir;
  return { upper: join(base, 'upper'), work: join(base, 'work') };
}

/** HOST_FEATURE_MISSING naming the package, at open rather than at the first create. */
export function requireDiskTools(): void {
  tool('mkfs.ext4', 'e2fsprogs');
  tool('fallocate', 'util-linux');
  tool('losetup', 'mount');
  if (!existsSync('/dev/loop-control')) throw featureMissing('loop devices', 'storage_gb needs /dev/loop-control (modprobe loop)');
}

/** Makes, formats and mounts the sandbox's disk, with an empty upper and work inside. */
export async function createDisk(sandboxDir: string, storageGb: number): Promise<void> {
  await formatImage(join(sandboxDir, DISK_IMAGE), storageGb);
  await mountNewDisk(sandboxDir);
}

/** Mounts a just-formatted `<sandbox>/disk.img` (createDisk's, or one from the disk pool) and makes its empty upper and work. */
export async function mountNewDisk(sandboxDir: string): Promise<void> {
  await mountDisk(sandboxDir);
  for (const d of ['upper', 'work']) await mkdir(join(sandboxDir, DISK_MOUNT, d), { mode: 0o755 });
}

/** A preallocated image of storageGb GiB holding an empty ext4 filesystem (CAPACITY_EXHAUSTED when the filesystem is full). */
export async function formatImage(img: string, storageGb: number): Promise<void> {
  const bytes = storageGb * GIB;
  const mkfs = tool('mkfs.ext4', 'e2fsprogs');
  const fa = await runTool(tool('fallocate', 'util-linux'), ['-l', String(bytes), img]);
  if (fa.code !== 0) {
    if (/No space left/i.test(fa.stderr)) {
      await rm(img, { force: true });
      throw capacityExhausted(`no room for a ${storageGb} GiB sandbox disk on the data directory's filesystem`, { storage_gb: storageGb });
    }
    // Filesystems without fallocate (some network filesystems): a sparse image still bounds the guest.
    if (!/not supported/i.test(fa.stderr)) throw sandboxFailed(`fallocate of the sandbox disk failed: ${fa.stderr.trim().slice(0, 300)}`);
    await mustRun(tool('truncate', 'coreutils'), ['-s', String(bytes), img]);
  }
  // -m 0: no blocks reserved for root (the guest is root); nodiscard: keep the preallocation; lazy init: no zeroing.
  await mustRun(mkfs, ['-q', '-F', '-m', '0', '-E', 'lazy_itable_init=1,lazy_journal_init=1,nodiscard', img], { timeoutMs: 60_000 });
}

/**
 * Mounts `<sandbox>/disk.img` at `<sandbox>/disk` unless it is mounted.
 * When a sandbox's namespace still holds the image (the host-side mount went,
 * the guest runs on), mount(8) reuses that loop device (util-linux ≥ 2.29):
 * a second device over the same image would be a second, independent ext4
 * mount of the same blocks, which corrupts it. The tests check it stays one.
 */
export async function mountDisk(sandboxDir: string): Promise<void> {
  const mnt = join(sandboxDir, DISK_MOUNT);
  if ((await mountPoints()).has(mnt)) return;
  await mkdir(mnt, { recursive: true, mode: 0o755 });
  // Sandbox root is on-disk id 0 (idmapped layer): without nosuid a set-uid or file-capability binary the guest made
  // would be host root's for any host user who reaches it. The guest runs with no_new_privs, so it loses nothing.
  // noinit_itable: the kernel's lazy inode-table zeroing goes to the loop device as write-zeroes, which
  // the loop driver turns into hole punches in the image, quietly un-preallocating it. The image was
  // fallocated, so its unwritten blocks already read as zeros: nothing needs zeroing.
  await mustRun(tool('mount', 'mount'), ['-t', 'ext4', '-o', 'loop,nosuid,nodev,noinit_itable', join(sandboxDir, DISK_IMAGE), mnt]);
}

/** Unmounts the disk and detaches its loop device; idempotent. */
export async function removeDisk(sandboxDir: string): Promise<void> {
  const img = join(sandboxDir, DISK_IMAGE);
  const mnt = join(sandboxDir, DISK_MOUNT);
  if ((await mountPoints()).has(mnt)) {
    const umount = tool('umount', 'mount');
    const res = await runTool(umount, [mnt]);
    // Busy (a host-side reader): detach it from the tree; the loop device autoclears when the last user lets go.
    if (res.code !== 0) await mustRun(umount, ['-l', mnt]);
  }
  for (const l of await loopDevices()) {
    // On a device still held by a namespace, LOOP_CLR_FD only marks it autoclear: it goes with its last user.
    if (l.backingFile === img) await runTool(tool('losetup', 'mount'), ['-d', l.name]);
  }
}

export interface LayerUsage {
  /** Bytes the writable layer takes on disk (allocated blocks: holes in sparse files are free). */
  readonly used_bytes: number;
  /** Files, directories and other entries in it. */
  readonly entries: number;
  /** storage_gb in bytes, 0 when the sandbox has no disk of its own. */
  readonly limit_bytes: number;
}

/**
 * What the layer holds, cheaply: statfs of the sandbox's own filesystem (ext4
 * leaves its metadata overhead out of f_blocks, so what is used is the
 * layer's blocks), else a walk of the upper directory.
 */
export async function layerUsage(sandboxDir: string, storageGb: number): Promise<LayerUsage> {
  const mnt = join(sandboxDir, DISK_MOUNT);
  if (storageGb > 0 && (await mountPoints()).has(mnt)) {
    const s = await statfs(mnt, { bigint: false });
    return { used_bytes: (s.blocks - s.bfree) * s.bsize, entries: s.files - s.ffree, limit_bytes: storageGb * GIB };
  }
  let used = 0;
  let entries = 0;
  const walk = async (dir: string): Promise<void> => {
    for (const e of await readdir(dir, { withFileTypes: true }).catch(() => [])) {
      const p = join(dir, e.name);
      const st = await lstat(p).catch(() => null);
      if (!st) continue;
      entries++;
      used += st.blocks * 512;
      if (st.isDirectory()) await walk(p);
    }
  };
  await walk(layerDirs(sandboxDir, storageGb).upper);
  return { used_bytes: used, entries, limit_bytes: storageGb * GIB };
}

/** A path field of a mountinfo line with its octal escapes (`\\040` for a space, ...) undone. */
export const unescapeMountField = (field: string): string =>
  field.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(Number.parseInt(o, 8)));

/** Mount points of this mount namespace (mountinfo's octal escapes undone); empty when mountinfo cannot be read. */
export async function mountPoints(): Promise<Set<string>> {
  const text = await readFile('/proc/self/mountinfo', 'utf8').catch(() => '');
  const out = new Set<string>();
  for (const line of text.split('\n')) {
    const m = line.split(' ')[4];
    if (m) out.add(unescapeMountField(m));
  }
  return out;
}

export interface LoopDevice {
  readonly name: string;
  readonly backingFile: string;
}

export async function loopDevices(): Promise<LoopDevice[]> {
  if (!existsSync('/sys/block')) return [];
  const out: LoopDevice[] = [];
  for (const dev of await readdir('/sys/block').catch(() => [] as string[])) {
    if (!dev.startsWith('loop')) continue;
    const file = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
    if (file) out.push({ name: `/dev/${dev}`, backingFile: file.trim().replace(/ \(deleted\)$/, '') });
  }
  return out;
}

/**
 * Detaches loop devices over an image under `sandboxesDir` that no live
 * sandbox owns (an agent killed between attach and mount, or a lazy unmount
 * whose last user is gone). Returns what it detached.
 */
export async function pruneLoopDevices(sandboxesDir: string, keep: ReadonlySet<string>): Promise<{ detached: string[]; errors: string[] }> {
  const detached: string[] = [];
  const errors: string[] = [];
  const mounted = await mountPoints();
  for (const l of await loopDevices()) {
    if (!l.backingFile.startsWith(`${sandboxesDir}/`) || keep.has(l.backingFile)) continue;
    const mnt = join(l.backingFile, '..', DISK_MOUNT);
    if (mounted.has(mnt)) await runTool(tool('umount', 'mount'), ['-l', mnt]);
    const res = await runTool(tool('losetup', 'mount'), ['-d', l.name]);
    if (res.code === 0) detached.push(`${l.name} (${l.backingFile})`);
    else errors.push(`losetup -d ${l.name}: ${res.stderr.trim()}`);
  }
  return { detached, errors };
}
