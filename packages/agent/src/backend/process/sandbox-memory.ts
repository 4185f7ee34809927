import { mkdir, rm } from 'node:fs/promises';
import {
  invalidSpec,
  sandboxFailed,
  sandboxNotFound,
  sandboxNotRunning,
  type Checkpoint,
  type CheckpointOptions,
  type SandboxInfo,
} from '../../backend.js';
import { resolveImage } from '../../images.js';
import { dumpMemory, restoreInto } from './criu-sandbox.js';
import { sleep } from './exec-util.js';
import { detachSandbox } from './network.js';
import type { SandboxHost } from './sandbox-host.js';
import type { Persisted } from './sandbox-state.js';
import { layerDirs } from './storage.js';

/* Checkpoints of a sandbox (disk, or live with criu), pause/resume, and putting a sandbox back to a checkpoint. */

export async function checkpointSandbox(host: SandboxHost, name: string, opts: CheckpointOptions): Promise<Checkpoint> {
  const record = host.must(name);
  return host.locks.run(`sb:${name}`, async () => {
    const running = await host.isAlive(record.state);
    const memory = opts.live === true && running && host.criu !== null;
    if (memory) await host.paging.awaitResident(name);
    const t0 = performance.now();
    let thawedAt: number | undefined;
    // Frozen while archived, so the layer is one instant of the guest, not a smear across the copy.
    if (running) await freeze(host, name);
    try {
      const cp = await host.checkpoints.write(layerDirs(host.sandboxDir(name), record.state.storage_gb).upper, {
        ...(opts.id ? { id: opts.id } : {}),
        ...(opts.maxBytes ? { maxBytes: opts.maxBytes } : {}),
        comment: opts.comment ?? '',
        image: record.state.image,
        now: new Date(),
        // Still frozen: CRIU takes the same instant (--freeze-cgroup leaves it frozen), then the guest runs on.
        ...(memory
          ? {
              memory: async () => {
                try {
                  return await dumpMemory(host, record, true);
                } finally {
                  await host.cgroups.setFrozen(name, false);
                  thawedAt = performance.now();
                }
              },
            }
          : {}),
      });
      if (opts.live && !memory)
        host.log?.info({ sandbox: name, checkpoint: cp.id }, 'live checkpoint requested without criu: took a disk checkpoint');
      return { ...cp, pause_ms: running ? Math.round((thawedAt ?? performance.now()) - t0) : 0 };
    } finally {
      if (running && thawedAt === undefined) await host.cgroups.setFrozen(name, false);
    }
  });
}

export async function freeze(host: SandboxHost, name: string): Promise<void> {
  try {
    await host.cgroups.setFrozen(name, true);
  } catch (err) {
    // Never leave the guest half-frozen (FREEZING) because the freeze did not settle.
    await host.cgroups.setFrozen(name, false).catch(() => undefined);
    throw sandboxFailed(`could not freeze sandbox "${name}" for a consistent checkpoint: ${(err as Error).message}`, { name }, err);
  }
}

/**
 * Takes a memory checkpoint and stops the sandbox: its processes are gone,
 * its CPU and memory free, its disk and layer kept (state `paused`) until
 * resume() or destroy(). The checkpoint is an ordinary live one: it can be
 * moved, and restored under another name elsewhere (create with resume).
 */
export async function pauseSandbox(host: SandboxHost, name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
  host.requireCriu();
  const record = host.records.get(name);
  if (!record) throw sandboxNotFound(name);
  return host.locks.run(`sb:${name}`, async () => {
    const s = record.state;
    if (s.status === 'paused') return { ...(await host.checkpoints.get(s.paused_checkpoint)), pause_ms: 0 };
    if (s.status !== 'running' || !(await host.isAlive(s))) throw sandboxNotRunning(name);
    await host.paging.awaitResident(name);
    const t0 = performance.now();
    await freeze(host, name);
    const progress: { dumped: boolean; detached?: Promise<void> } = { dumped: false };
    let cp: Checkpoint;
    try {
      cp = await host.checkpoints.write(layerDirs(host.sandboxDir(name), s.storage_gb).upper, {
        ...(opts.id ? { id: opts.id } : {}),
        comment: opts.comment ?? 'pause',
        image: s.image,
        now: new Date(),
        memory: async () => {
          const d = await dumpMemory(host, record, false);
          progress.dumped = true;
          // The tree is gone: its route and veth go while the files are hashed.
          progress.detached = detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip });
          progress.detached.catch(() => undefined);
          return d;
        },
      });
    } catch (err) {
      // Within the lock: a later restore of this sandbox must not have its new veth deleted by this teardown.
      await progress.detached?.catch(() => undefined);
      // A failed dump leaves the tree running (CRIU resumes it); thaw it, nothing else changed.
      if (!progress.dumped) await host.cgroups.setFrozen(name, false).catch(() => undefined);
      else host.log?.error({ err, sandbox: name }, 'the sandbox was dumped but its checkpoint could not be kept');
      throw err;
    }
    const pauseMs = Math.round(performance.now() - t0);
    await host.unpublish(record);
    await (progress.detached ?? detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip }));
    // Killed by criu: the (empty) group is thawed for whoever joins it next.
    await host.cgroups.setFrozen(name, false).catch(() => undefined);
    s.status = 'paused';
    s.paused_checkpoint = cp.id;
    s.init_pid = 0;
    s.init_start = '';
    await host.persist(s);
    host.log?.info({ sandbox: name, checkpoint: cp.id, pause_ms: pauseMs }, 'sandbox paused');
    return { ...cp, pause_ms: pauseMs };
  });
}

/** Restores a paused sandbox from its pause checkpoint (idempotent: a running one is answered as it is). */
export async function resumeSandbox(host: SandboxHost, name: string): Promise<SandboxInfo> {
  const record = host.records.get(name);
  if (!record) throw sandboxNotFound(name);
  return host.locks.run(`sb:${name}`, async () => {
    const s = record.state;
    if (s.status === 'running') return host.info(record);
    if (s.status !== 'paused') throw sandboxNotRunning(name);
    const cp = await host.checkpoints.get(s.paused_checkpoint);
    await restoreInto(host, record, cp);
    const old = s.paused_checkpoint;
    s.status = 'running';
    s.paused_checkpoint = '';
    await host.persist(s);
    await host.publish(record);
    await host.persist(s);
    await host.checkpoints
      .delete(old)
      .catch((err: unknown) => host.log?.warn({ err, checkpoint: old }, 'could not remove the pause checkpoint'));
    return host.info(record);
  });
}

/**
 * Puts a sandbox (running or paused) back to a checkpoint: its processes
 * are ended, its layer replaced by the checkpoint's; a live checkpoint
 * then resumes its processes (any sandbox's, under this one's name,
 * address and ids), a disk one boots the image afresh.
 */
export async function restoreSandboxCheckpoint(host: SandboxHost, name: string, checkpointId: string): Promise<SandboxInfo> {
  const record = host.records.get(name);
  if (!record || record.state.status === 'creating') throw sandboxNotFound(name);
  return host.locks.run(`sb:${name}`, async () => {
    const s = record.state;
    const cp = await host.checkpoints.get(checkpointId);
    if (cp.image !== s.image) {
      throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", the sandbox on "${s.image}"`, [
        { path: 'checkpoint_id', message: 'another image' },
      ]);
    }
    if (cp.kind === 'live') host.requireCriu();
    await host.unpublish(record);
    if (await host.isAlive(s)) await killInit(host, s);
    // Its processes are gone: a restore of theirs still paging in has nothing left to page.
    host.paging.forget(name);
    await detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip });
    const layer = layerDirs(host.sandboxDir(name), s.storage_gb);
    for (const d of [layer.upper, layer.work]) {
      await rm(d, { recursive: true, force: true });
      await mkdir(d, { recursive: true });
    }
    await host.checkpoints.extract(cp.id, layer.upper);
    if (cp.kind === 'live') await restoreInto(host, record, cp);
    else await host.launch(record, await resolveImage(host.opts.imageDir, s.image));
    const paused = s.paused_checkpoint;
    s.status = 'running';
    s.paused_checkpoint = '';
    s.checkpoint_id = cp.id;
    await host.persist(s);
    await host.publish(record);
    await host.persist(s);
    if (paused && paused !== cp.id) await host.checkpoints.delete(paused).catch(() => undefined);
    return host.info(record);
  });
}

export async function killInit(host: SandboxHost, s: Persisted): Promise<void> {
  try {
    process.kill(s.init_pid, 'SIGKILL');
  } catch {
    /* gone */
  }
  for (let i = 0; i < 500 && (await host.isAlive(s)); i++) await sleep(5);
  if (await host.isAlive(s)) throw sandboxFailed(`init ${s.init_pid} survived SIGKILL for 2.5 s`);
}
