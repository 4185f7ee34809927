import { randomUUID } from 'node:crypto';
import { mkdir, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { AppError } from '@fleet/agent-protocol';
import {
  type Checkpoint,
  type CheckpointOptions,
  invalidSpec,
  type LayerUsageReport,
  type SandboxInfo,
  sandboxNotFound,
  sandboxNotRunning,
} from '../../backend.js';
import { mustRun } from '../process/exec-util.js';
import { resolveQemuImage } from './image.js';
import { qmp } from './qmp.js';
import { capture, DISK_FILE, readMeta, verifyState, writeCheckpoint } from './state.js';
import { expectedArchiveBytes } from '../process/checkpoints.js';
import { checkMachine, imageBuild } from './vm-machine.js';
import { diskFromCheckpoint, launchQemu, loadInto, publish, thaw, waitForGuest } from './vm-boot.js';
import { plugNetwork } from './vm-network.js';
import { stopVm } from './vm-teardown.js';
import type { QemuHost } from './vm-host.js';

/** Memory state (state.ts): checkpoints, pause and resume, restores to a checkpoint, layer usage. */

/** QEMU cannot save the state of a VFIO device: a VM holding one has no memory state to take (its disk can still be). */
function refuseGpuMemoryState(s: { readonly name: string; readonly gpu?: { readonly uuids: readonly string[] } | undefined }): void {
  if (s.gpu && s.gpu.uuids.length > 0)
    throw new AppError(
      'GPU_MEMORY_STATE_UNSUPPORTED',
      409,
      `VM "${s.name}" holds passed-through GPUs (${s.gpu.uuids.join(', ')}): QEMU cannot save a VFIO device's state, so its memory cannot be captured; take a disk snapshot (live: false)`,
      { name: s.name, gpu_uuids: [...s.gpu.uuids] },
    );
}

/**
 * Disk (`live` false, or a VM that is not running) or disk plus memory:
 * the guest is stopped for the copy of its overlay and the write of its
 * state, then runs on. `pause_ms` is how long it was stopped.
 */
export async function checkpointVm(qemu: QemuHost, name: string, opts: CheckpointOptions): Promise<Checkpoint> {
  const r = qemu.records.get(name);
  if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
  if (opts.live === true && r.state.status === 'running') refuseGpuMemoryState(r.state);
  return qemu.locks.run(`vm:${name}`, async () => {
    const s = r.state;
    const running = s.status === 'running' && (await qemu.alive(s));
    const scratch = qemu.scratchDir(name);
    try {
      let pauseMs = 0;
      let memory = false;
      if (running) {
        const got = await capture({
          qmpPath: qemu.qmpPath(name),
          diskPath: join(qemu.vmDir(name), DISK_FILE),
          scratch,
          memory: opts.live === true,
          leaveStopped: false,
          timeoutMs: 120_000,
        });
        pauseMs = got.pauseMs;
        memory = got.memory;
      } else {
        // No QEMU holds the disk (paused): its overlay is already one instant.
        await mkdir(scratch, { recursive: true, mode: 0o700 });
        await mustRun('cp', ['--sparse=always', '--reflink=auto', join(qemu.vmDir(name), DISK_FILE), join(scratch, DISK_FILE)]);
      }
      const image = await resolveQemuImage(qemu.opts.imageDir, s.image);
      const cp = await writeCheckpoint(qemu.store, scratch, {
        ...(opts.id ? { id: opts.id } : {}),
        ...(opts.maxBytes ? { maxBytes: opts.maxBytes } : {}),
        comment: opts.comment ?? '',
        image: s.image,
        now: new Date(),
        machine: qemu.machineMeta(s, await imageBuild(image)),
        memory,
      });
      qemu.log?.info({ vm: name, checkpoint: cp.id, kind: cp.kind, pause_ms: pauseMs }, 'checkpoint taken');
      return { ...cp, pause_ms: pauseMs };
    } finally {
      await rm(scratch, { recursive: true, force: true });
    }
  });
}

/**
 * A live checkpoint, then QEMU ends: the VM's CPU and memory are free, its
 * disk, tap and address kept (state `paused`) until resume() or destroy().
 * The checkpoint is an ordinary live one: it can move, and be resumed
 * under another name elsewhere (create with resume).
 */
export async function pauseVm(qemu: QemuHost, name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
  const r = qemu.records.get(name);
  if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
  if (r.state.status === 'running') refuseGpuMemoryState(r.state);
  return qemu.locks.run(`vm:${name}`, async () => {
    const s = r.state;
    if (s.status === 'paused' && !s.paused_checkpoint) {
      throw new AppError('VM_FROZEN', 409, `VM "${name}" is frozen after a live migration: resume or destroy it`, { name });
    }
    if (s.status === 'paused') return { ...(await qemu.store.get(s.paused_checkpoint)), pause_ms: 0 };
    if (!(await qemu.alive(s))) throw sandboxNotRunning(name);
    const scratch = qemu.scratchDir(name);
    let cp: Checkpoint;
    let pauseMs: number;
    try {
      const got = await capture({
        qmpPath: qemu.qmpPath(name),
        diskPath: join(qemu.vmDir(name), DISK_FILE),
        scratch,
        memory: true,
        leaveStopped: true,
        timeoutMs: 120_000,
      });
      pauseMs = got.pauseMs;
      const image = await resolveQemuImage(qemu.opts.imageDir, s.image);
      cp = await writeCheckpoint(qemu.store, scratch, {
        ...(opts.id ? { id: opts.id } : {}),
        comment: opts.comment ?? 'pause',
        image: s.image,
        now: new Date(),
        machine: qemu.machineMeta(s, await imageBuild(image)),
        memory: true,
      });
    } catch (err) {
      // Nothing was kept: the guest runs on as it was.
      await qmp(qemu.qmpPath(name), 'cont').catch(() => undefined);
      throw err;
    } finally {
      await rm(scratch, { recursive: true, force: true });
    }
    for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
    // Stopped and captured: nothing the guest does is lost by ending QEMU now.
    await stopVm(qemu, s, 0);
    await r.console?.close().catch(() => undefined);
    r.console = undefined;
    s.status = 'paused';
    s.paused_checkpoint = cp.id;
    s.pid = 0;
    s.pid_start = '';
    await qemu.writeState(s);
    qemu.log?.info({ vm: name, checkpoint: cp.id, pause_ms: pauseMs }, 'VM paused');
    return { ...cp, pause_ms: pauseMs };
  });
}

/** Loads a paused VM's state into a new QEMU over its own disk (idempotent: a running VM is answered as it is). */
export async function resumeVm(qemu: QemuHost, name: string): Promise<SandboxInfo> {
  const r = qemu.records.get(name);
  if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
  return qemu.locks.run(`vm:${name}`, async () => {
    const s = r.state;
    if (s.status === 'running') return qemu.info(r);
    if (!s.paused_checkpoint) return thaw(qemu, r);
    const cp = await qemu.store.get(s.paused_checkpoint);
    const image = await resolveQemuImage(qemu.opts.imageDir, s.image);
    await checkMachine(qemu, cp, await readMeta(qemu.store, cp), image);
    try {
      await plugNetwork(qemu, s);
      await loadInto(qemu, r, cp, image, Date.now());
    } catch (err) {
      // Still paused, its checkpoint kept: resume can be asked again.
      await stopVm(qemu, s, 0).catch(() => undefined);
      await r.console?.close().catch(() => undefined);
      r.console = undefined;
      s.pid = 0;
      s.pid_start = '';
      await qemu.writeState(s);
      throw err;
    }
    await publish(qemu, r);
    s.status = 'running';
    s.paused_checkpoint = '';
    await qemu.writeState(s);
    await qemu.store
      .delete(cp.id)
      .catch((err: unknown) => qemu.log?.warn({ err, checkpoint: cp.id }, 'could not remove the pause checkpoint'));
    return qemu.info(r);
  });
}

/**
 * Puts a VM (running or paused) back to a checkpoint of this host: QEMU
 * ends, the disk becomes the checkpoint's; a live one then loads its state
 * (any VM's, re-addressed as this one), a disk one boots afresh.
 */
export async function restoreVmCheckpoint(qemu: QemuHost, name: string, checkpointId: string): Promise<SandboxInfo> {
  const r = qemu.records.get(name);
  if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
  return qemu.locks.run(`vm:${name}`, async () => {
    const s = r.state;
    const cp = await qemu.store.get(checkpointId);
    if (cp.image !== s.image) {
      throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", the VM on "${s.image}"`, [
        { path: 'checkpoint_id', message: 'another image' },
      ]);
    }
    const image = await resolveQemuImage(qemu.opts.imageDir, s.image);
    const meta = cp.kind === 'live' ? await readMeta(qemu.store, cp) : undefined;
    if (meta) {
      await checkMachine(qemu, cp, meta, image);
      if (meta.ram_mb !== s.ram_mb || meta.cpus !== Math.max(1, Math.ceil(s.cpus)) || meta.disk_bytes !== s.disk_bytes) {
        throw invalidSpec(`checkpoint "${cp.id}" holds the memory of a VM of another size than "${name}"`, [
          { path: 'checkpoint_id', message: 'another machine size' },
        ]);
      }
      await verifyState(qemu.store, cp);
    }
    for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
    await stopVm(qemu, s, 0);
    await r.console?.close().catch(() => undefined);
    r.console = undefined;
    const started = Date.now();
    await diskFromCheckpoint(qemu, s, cp, image);
    await plugNetwork(qemu, s);
    // A restored copy of a past state is not the VM that ran on from it: a new generation id.
    s.vmgenid = randomUUID();
    if (meta) {
      await loadInto(qemu, r, cp, image, started);
    } else {
      await launchQemu(qemu, s, image);
      await qemu.writeState(s);
      await qemu.startConsole(r);
      await waitForGuest(qemu, s, started);
    }
    const paused = s.paused_checkpoint;
    s.status = 'running';
    s.paused_checkpoint = '';
    s.checkpoint_id = cp.id;
    await publish(qemu, r);
    await qemu.writeState(s);
    if (paused && paused !== cp.id) await qemu.store.delete(paused).catch(() => undefined);
    return qemu.info(r);
  });
}

/** The overlay's allocated bytes; a checkpoint's rootfs.tar is that file (sparse) plus tar's framing. */
export async function vmLayerUsage(qemu: QemuHost, name: string): Promise<LayerUsageReport> {
  const r = qemu.records.get(name);
  if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
  const st = await stat(join(qemu.vmDir(name), DISK_FILE));
  const used = st.blocks * 512;
  return {
    used_bytes: used,
    entries: 1,
    limit_bytes: r.state.disk_bytes,
    expected_archive_bytes: expectedArchiveBytes({ used_bytes: Math.max(used, st.size), entries: 1 }),
  };
}
