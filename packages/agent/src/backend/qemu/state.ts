import { createHash, randomBytes } from 'node:crypto';
import { mkdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';
import { AppError } from '@fleet/agent-protocol';
import { BackendErrorCode, sandboxFailed, type Checkpoint } from '../../backend.js';
import { mustRun, sleep } from '../process/exec-util.js';
import { MANIFEST, tarInto, ROOTFS, validateCheckpointId, type CheckpointStore } from '../process/checkpoints.js';
import { qmp } from './qmp.js';

/**
 * Memory state of a VM through QEMU itself. A capture stops the guest
 * (QMP `stop`, which drains and flushes the disks), copies its qcow2
 * overlay, and for a live one writes the device and memory state with QMP
 * `migrate` to a file; then `cont`. The checkpoint is the process backend's
 * layout (backend.ts): `rootfs.tar` holds the overlay (`overlay.qcow2`, its
 * digest is the checkpoint's), and the memory half is `qemu-vmstate` (the
 * migration stream exactly as QEMU wrote it) with `qemu-fleet.json` (the
 * machine it must be loaded into). `kind` is `live` only when QEMU reported
 * that migration completed.
 */

export const QEMU_VMSTATE = 'qemu-vmstate';
export const QEMU_META = 'qemu-fleet.json';
export const DISK_FILE = 'overlay.qcow2';

export const qemuMetaSchema = z.object({
  format: z.literal(1),
  /** The machine a state loads into: same size, CPUs and devices. */
  cpus: z.number().int().positive(),
  ram_mb: z.number().int().positive(),
  disk_bytes: z.number().int().positive(),
  accel: z.enum(['kvm', 'tcg']),
  qemu_version: z.string(),
  /** sha256 of the base image's image.json: the overlay is a block-level delta, valid only over that very build. */
  image_build: z.string(),
  /** The image its disk is a delta over. */
  image: z.string().optional(),
  /** Who it was captured as (a restore under another identity re-addresses the guest). */
  name: z.string(),
  ip: z.string(),
  mac: z.string(),
});
export type QemuMeta = z.infer<typeof qemuMetaSchema>;

/** A shell-free path for QEMU's `exec:` migration URI (QEMU runs it with /bin/sh -c). */
function shellPath(p: string): string {
  if (!/^\/[A-Za-z0-9._/+-]+$/.test(p)) throw sandboxFailed(`path "${p}" is not safe for a QEMU migration command`);
  return p;
}

interface MigrateStatus {
  status?: string;
  'error-desc'?: string;
  downtime?: number;
  'total-time'?: number;
  ram?: { transferred?: number };
  disk?: { transferred?: number };
}

/** Polls query-migrate until it settles; answers the final status object. */
export async function waitMigration(qmpPath: string, timeoutMs: number, alive?: () => Promise<boolean>): Promise<MigrateStatus> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    const st = (await qmp(qmpPath, 'query-migrate').catch(async (err: unknown) => {
      if (alive && !(await alive())) throw sandboxFailed('QEMU exited during the migration');
      throw err;
    })) as MigrateStatus;
    if (st.status === 'completed') return st;
    // postcopy-paused: the stream broke after the switch; QEMU would wait for a recovery nobody starts.
    if (st.status === 'failed' || st.status === 'cancelled' || st.status === 'postcopy-paused') {
      throw sandboxFailed(`QEMU migration ${st.status}: ${st['error-desc'] ?? 'no reason given'}`);
    }
    if (Date.now() > until) throw sandboxFailed(`QEMU migration did not finish within ${timeoutMs} ms (status ${st.status ?? 'none'})`);
    await sleep(50);
  }
}

/**
 * Asks a running migration to switch to post-copy and waits for the switch:
 * answers once the guest runs on the target (or the copy finished first).
 */
export async function switchToPostcopy(qmpPath: string, timeoutMs: number, alive: () => Promise<boolean>): Promise<MigrateStatus> {
  const until = Date.now() + timeoutMs;
  let askedAt: number | undefined;
  for (;;) {
    const st = (await qmp(qmpPath, 'query-migrate').catch(async (err: unknown) => {
      if (!(await alive())) throw sandboxFailed('QEMU exited during the migration');
      throw err;
    })) as MigrateStatus;
    // The guest stopped at the ask (QEMU reports no downtime until the whole stream completed): from it to running on the target.
    if (st.status === 'postcopy-active') return { ...st, downtime: st.downtime ?? Date.now() - (askedAt ?? Date.now()) };
    if (st.status === 'completed') return st;
    if (st.status === 'failed' || st.status === 'cancelled' || st.status === 'postcopy-paused') {
      throw sandboxFailed(`QEMU migration ${st.status}: ${st['error-desc'] ?? 'no reason given'}`);
    }
    // Only once the stream is up: before that QEMU refuses the switch.
    if (askedAt === undefined && st.status === 'active') {
      askedAt = Date.now();
      await qmp(qmpPath, 'migrate-start-postcopy');
    }
    if (Date.now() > until) throw sandboxFailed(`QEMU did not switch to post-copy within ${timeoutMs} ms (status ${st.status ?? 'none'})`);
    await sleep(50);
  }
}

/**
 * Stops the guest, copies its overlay into `scratch`, writes its state
 * there when `memory`, and lets it run again unless `leaveStopped` (pause:
 * the VM is ended right after). Answers how long the guest was stopped.
 */
export async function capture(opts: {
  qmpPath: string;
  diskPath: string;
  scratch: string;
  memory: boolean;
  leaveStopped: boolean;
  timeoutMs: number;
}): Promise<{ pauseMs: number; memory: boolean }> {
  await mkdir(opts.scratch, { recursive: true, mode: 0o700 });
  const t0 = performance.now();
  await qmp(opts.qmpPath, 'stop');
  let resumed = false;
  const resume = async (): Promise<number> => {
    if (!resumed && !opts.leaveStopped) await qmp(opts.qmpPath, 'cont');
    resumed = true;
    return Math.round(performance.now() - t0);
  };
  try {
    // `stop` flushed the disk: the file is the guest's disk at this instant.
    await mustRun('cp', ['--sparse=always', '--reflink=auto', opts.diskPath, join(opts.scratch, DISK_FILE)], { timeoutMs: opts.timeoutMs });
    if (opts.memory) {
      const file = join(opts.scratch, QEMU_VMSTATE);
      // A plain file: whatever a live migration set on this QEMU before (TLS, disk blocks in the stream) is off.
      await qmp(opts.qmpPath, 'migrate-set-capabilities', {
        capabilities: [
          { capability: 'postcopy-ram', state: false },
          { capability: 'block', state: false },
        ],
      });
      await qmp(opts.qmpPath, 'migrate-set-parameters', { 'max-bandwidth': 8 * 1024 ** 3, 'tls-creds': '', 'block-incremental': false });
      await qmp(opts.qmpPath, 'migrate', { uri: `exec:cat > ${shellPath(file)}` });
      await waitMigration(opts.qmpPath, opts.timeoutMs);
    }
    return { pauseMs: await resume(), memory: opts.memory };
  } finally {
    await resume().catch(() => undefined);
  }
}

/** Where a state file is loaded from (QEMU started with `-incoming defer -S`): resolves once loaded, the guest still stopped. */
export async function loadState(qmpPath: string, file: string, timeoutMs: number, alive: () => Promise<boolean>): Promise<void> {
  await qmp(qmpPath, 'migrate-incoming', { uri: `exec:cat ${shellPath(file)}` });
  await waitIncoming(qmpPath, timeoutMs, alive);
}

/** Waits for an incoming migration to land: the VM leaves `inmigrate` (stopped by -S). */
export async function waitIncoming(qmpPath: string, timeoutMs: number, alive: () => Promise<boolean>): Promise<void> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    if (!(await alive())) throw sandboxFailed('QEMU exited while loading the state (a state from another machine, or corrupt)');
    const st = (await qmp(qmpPath, 'query-status').catch(() => null)) as { status?: string } | null;
    if (st?.status && st.status !== 'inmigrate') {
      if (st.status === 'paused' || st.status === 'prelaunch') return;
      throw sandboxFailed(`QEMU is "${st.status}" after loading the state`);
    }
    if (Date.now() > until) throw sandboxFailed(`QEMU did not load the state within ${timeoutMs} ms`);
    await sleep(50);
  }
}

/**
 * Makes a checkpoint of what capture() left in `scratch`: the overlay tarred
 * into rootfs.tar (hashed while written, abandoned past maxBytes), the state
 * and its meta moved in and hashed, manifest last, renamed into the store.
 */
export async function writeCheckpoint(
  store: CheckpointStore,
  scratch: string,
  meta: { id?: string; comment: string; image: string; now: Date; maxBytes?: number; machine: QemuMeta; memory: boolean },
): Promise<Checkpoint> {
  const id = meta.id ?? `ckpt-${meta.now.getTime().toString(36)}-${randomBytes(6).toString('hex')}`;
  validateCheckpointId(id);
  if (
    await stat(join(store.dir, id)).then(
      () => true,
      () => false,
    )
  ) {
    throw new AppError(BackendErrorCode.CheckpointExists, 409, `checkpoint "${id}" already exists on this host; pick another id`, { id });
  }
  const tmp = join(store.dir, `.tmp-${id}-${randomBytes(4).toString('hex')}`);
  await mkdir(tmp);
  try {
    const { size, digest } = await tarInto(
      ['--sparse', '--numeric-owner', '-C', scratch, '-cf', '-', DISK_FILE],
      join(tmp, ROOTFS),
      meta.maxBytes,
      "the VM's disk",
    );
    const files: Record<string, string> = {};
    if (meta.memory) {
      await rename(join(scratch, QEMU_VMSTATE), join(tmp, QEMU_VMSTATE));
      files[QEMU_VMSTATE] = (await store.hashFile(join(tmp, QEMU_VMSTATE))).digest;
      await writeFile(join(tmp, QEMU_META), JSON.stringify(meta.machine));
      files[QEMU_META] = (await store.hashFile(join(tmp, QEMU_META))).digest;
    }
    const checkpoint: Checkpoint = {
      id,
      comment: meta.comment,
      kind: meta.memory ? 'live' : 'disk',
      size_bytes: size,
      digest,
      created_at: meta.now.toISOString(),
      image: meta.image,
      files,
      parent: '',
    };
    await writeFile(join(tmp, MANIFEST), JSON.stringify(checkpoint, null, 2));
    await rename(tmp, join(store.dir, id));
    return checkpoint;
  } catch (err) {
    await rm(tmp, { recursive: true, force: true });
    throw err;
  }
}

/** The machine a live checkpoint must be loaded into; CHECKPOINT_NOT_LIVE for a disk one or a CRIU one. */
export async function readMeta(store: CheckpointStore, cp: Checkpoint): Promise<QemuMeta> {
  if (cp.kind !== 'live' || !(QEMU_META in cp.files) || !(QEMU_VMSTATE in cp.files)) {
    throw new AppError('CHECKPOINT_NOT_LIVE', 409, `checkpoint "${cp.id}" holds no QEMU memory state: it can boot a VM, not resume one`, {
      id: cp.id,
    });
  }
  const raw = await readFile(join(store.path(cp.id), QEMU_META), 'utf8');
  const digest = createHash('sha256').update(raw).digest('hex');
  if (digest !== cp.files[QEMU_META]) {
    throw new AppError(BackendErrorCode.CheckpointCorrupt, 500, `checkpoint "${cp.id}": ${QEMU_META} does not match its sha256`, {
      id: cp.id,
    });
  }
  return qemuMetaSchema.parse(JSON.parse(raw));
}

/** Checks the memory file against the manifest's sha256 before QEMU reads it (a tampered state never reaches QEMU). */
export async function verifyState(store: CheckpointStore, cp: Checkpoint): Promise<string> {
  const file = join(store.path(cp.id), QEMU_VMSTATE);
  const { digest } = await store.hashFile(file);
  if (digest !== cp.files[QEMU_VMSTATE]) {
    throw new AppError(BackendErrorCode.CheckpointCorrupt, 500, `checkpoint "${cp.id}": ${QEMU_VMSTATE} does not match its sha256`, {
      id: cp.id,
    });
  }
  return file;
}
