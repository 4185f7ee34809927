import { closeSync, existsSync, fchownSync } from 'node:fs';
import { mkdir, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { dirname, join } from 'node:path';
import { AppError } from '@fleet/agent-protocol';
import { sandboxFailed, type Checkpoint } from '../../backend.js';
import { resolveImage } from '../../images.js';
import { ensureEmptyDir } from '../../native/helper.js';
import {
  CRIU_META,
  criuMetaSchema,
  dumpTree,
  externalMounts,
  restoreTree,
  RestoreTimedOut,
  type CriuMeta,
  type DumpResult,
  type Pager,
  type RestoreTarget,
} from './criu.js';
import { mustRun, processStartTime, runTool, sigkill } from './exec-util.js';
import { startLazyDaemon, type LazyDaemon } from './criu-lazy.js';
import { openConsoleWriter } from './launch.js';
import { deleteLink } from './network.js';
import type { SandboxHost } from './sandbox-host.js';
import type { SandboxRecord } from './sandbox-state.js';
import { layerDirs, mountPoints } from './storage.js';

/* CRIU on a sandbox: a dump of its process tree, a restore of one as a given sandbox. */

/** CRIU dump of the sandbox's tree into a scratch directory (leaveRunning: its cgroup is frozen and stays so). */
export async function dumpMemory(
  host: SandboxHost,
  record: SandboxRecord,
  leaveRunning: boolean,
  lazy = false,
): Promise<{ dir: string; meta: CriuMeta; pageServer?: DumpResult['pageServer'] }> {
  const s = record.state;
  const entry = `.criu-${s.name}-${randomBytes(4).toString('hex')}`;
  const dir = join(host.checkpoints.staging, entry);
  // Until the checkpoint writer has moved the files out (it removes the directory).
  host.scratch.add(entry);
  setTimeout(() => host.scratch.delete(entry), 30 * 60_000).unref();
  try {
    const res = await dumpTree(host.requireCriu(), {
      initPid: s.init_pid,
      dir,
      leaveRunning,
      freezerDir: host.cgroups.freezerDir(s.name),
      uidBase: s.uid_base,
      ip: s.ip,
      hostname: s.name,
      emptyDir: host.emptyDir(s.name),
      lazy,
    });
    host.log?.info({ sandbox: s.name, frozen_ms: res.frozenMs, pages: res.pagesWritten, leave_running: leaveRunning }, 'criu dump');
    return { dir, meta: res.meta, ...(res.pageServer ? { pageServer: res.pageServer } : {}) };
  } catch (err) {
    await rm(dir, { recursive: true, force: true });
    throw err;
  }
}

/**
 * CRIU restore of a live checkpoint as this record (its name, address,
 * MAC, veth, id block and cgroups, whatever the checkpoint's were): the
 * overlay root is mounted for the restore in the agent's namespace from
 * idmapped clones made against a throwaway user namespace with the
 * record's id map, and detached once the restored namespace holds it.
 */
export async function restoreInto(
  host: SandboxHost,
  record: SandboxRecord,
  cp: Checkpoint,
  opts: {
    /** A lazy move's source of memory (a page server through the agents' tunnel) in place of the local images. */
    lazy?: (dir: string) => Promise<Pager>;
    /** The caller (a create) has just applied the firewall with this record in it and readied its bridge. */
    networkReady?: boolean;
  } = {},
): Promise<void> {
  const { lazy } = opts;
  const criu = host.requireCriu();
  const s = record.state;
  const steps: Record<string, number> = {};
  let t = performance.now();
  const lap = (step: string): void => {
    const now = performance.now();
    steps[step] = Math.round(now - t);
    t = now;
  };
  if (cp.kind !== 'live' || !(CRIU_META in cp.files)) {
    throw new AppError('CHECKPOINT_NOT_LIVE', 409, `checkpoint "${cp.id}" holds no memory: it can boot a sandbox, not resume one`, {
      id: cp.id,
    });
  }
  const cpDir = host.checkpoints.path(cp.id);
  const meta = criuMetaSchema.parse(JSON.parse(await readFile(join(cpDir, CRIU_META), 'utf8')));
  const dir = host.sandboxDir(s.name);
  const root = join(dir, 'root');
  const layer = layerDirs(dir, s.storage_gb);
  await mkdir(root, { recursive: true });
  // The host's side of the network (rules, bridge, no stale veth) is made while the root is mounted, which does not
  // need it; only CRIU's setup-namespaces hook does.
  const network = (async () => {
    if (!opts.networkReady) {
      await host.firewall.apply(() => host.firewallState());
      await host.readyBridge(record);
    }
    // A veth of this name left over (a restore killed after its hook ran) would fail the hook's.
    if (existsSync(`/sys/class/net/${s.veth}`)) await deleteLink(s.veth);
  })();
  network.catch(() => undefined);
  // So is the console's writer (a shell that makes the FIFO and opens its read end).
  const consoleWriter = openConsoleWriter(join(dir, 'console.log'), host.opts.consoleLogMaxBytes, host.tools.busybox, s.uid_base).then(
    (fd) => {
      try {
        // CRIU reopens it from inside the sandbox's user namespace, as the sandbox's root.
        fchownSync(fd, s.uid_base, s.uid_base);
        return fd;
      } catch (err) {
        closeSync(fd);
        throw err;
      }
    },
  );
  consoleWriter.catch(() => undefined);
  const local = lazy === undefined && host.opts.lazyRestore && criu.lazyPages;
  // Without a source of its own (a lazy move's), memory is paged in from the local images after the tree runs:
  // the restore does not wait for every page to be read into it (most of its time on a host of 4 KiB pages). A
  // daemon that does not start leaves this restore to read every page itself.
  const pagers: { any?: Pager; local?: LazyDaemon } = {};
  const pager = async (d: string): Promise<Pager | undefined> => {
    if (lazy) return (pagers.any = await lazy(d));
    if (!local) return undefined;
    pagers.local = await startLazyDaemon(criu, d).catch((err: unknown) => {
      host.log?.warn({ err, sandbox: s.name }, 'criu lazy-pages did not start: this restore reads every page itself');
      return undefined;
    });
    return (pagers.any = pagers.local);
  };
  // Set from targetReady, which runs alongside restoreTree.
  const mounted = { root: false };
  const scratch = restoreScratchOf(s.name);
  host.scratch.add(scratch);
  let targetReady: Promise<RestoreTarget> | undefined;
  try {
    // The root, console and network are readied while restoreTree links the images and starts a lazy daemon.
    // PID 0: the helper maps the ids through a user namespace of its own making (the record's id block), and mounts
    // the root in the agent's mount namespace, where CRIU takes it from.
    const mountRoot = async (): Promise<void> => {
      const imagePath = await resolveImage(host.opts.imageDir, s.image);
      await mustRun(host.tools.helper, ['mount-root', '0', String(s.uid_base), imagePath, dirname(layer.upper), root]);
      mounted.root = true;
    };
    targetReady = (async (): Promise<RestoreTarget> => {
      const emptyDir = ensureEmptyDir(host.emptyDir(s.name));
      emptyDir.catch(() => undefined);
      await mountRoot();
      lap('mount_root_ms');
      const consoleFd = await consoleWriter;
      lap('console_wait_ms');
      await network;
      lap('network_wait_ms');
      return {
        root,
        cgroupProcs: host.cgroups.procsFiles(s.name),
        veth: s.veth,
        bridge: s.bridge,
        mac: s.mac,
        ip: s.ip,
        prefixLen: host.subnet.prefixLen,
        gateway: host.subnet.gateway,
        hostname: s.name,
        consoleFd,
        hook: host.criuHook,
        emptyDir: await emptyDir,
      };
    })();
    targetReady.catch(() => undefined);
    let pid: number;
    for (let attempt = 1; ; attempt++) {
      try {
        const staged = join(host.checkpoints.staging, scratch);
        pid = await restoreTree(criu, cpDir, meta, s.uid_base, targetReady, staged, pager, host.restoreDeadlineMs, attempt > 1);
        break;
      } catch (err) {
        if (!(err instanceof RestoreTimedOut)) throw err;
        const kept = await keepHungLog(host.opts.dataDir, s.name, attempt, err.kept);
        host.log?.warn(
          { sandbox: s.name, checkpoint: cp.id, attempt, deadline_ms: err.deadlineMs, criu_log: err.logTail, criu_log_file: kept },
          'criu restore hung: killed',
        );
        // What the killed restore left: its half-restored tasks (in the sandbox's cgroups) and the veth its hook made.
        await host.cgroups.killAll(s.name);
        if ((await host.cgroups.pids(s.name)).length > 0)
          throw sandboxFailed(`tasks of a killed restore are still in the cgroups of ${s.name}`);
        await deleteLink(s.veth);
        // A lazy restore is not tried again: its pages come from a source page server that served the first try.
        if (attempt >= (lazy ? 1 : RESTORE_ATTEMPTS))
          throw sandboxFailed(`${err.message}, ${attempt} times (the criu log ends: ${err.logTail})`);
        // A try killed after its post-resume step had the helper detach the root: the next one needs it again.
        if (!(await isMounted(root))) await mountRoot();
      }
    }
    lap('criu_restore_ms');
    const before = { pid: s.init_pid, start: s.init_start };
    try {
      const start = await processStartTime(pid);
      if (start === null) throw sandboxFailed('the restored init exited right away; see the console log');
      s.init_pid = pid;
      s.init_start = start;
      // From here the daemon is the sandbox's: its failure kills this init, and a memory capture waits for it.
      if (pagers.local) host.paging.track(s.name, pagers.local);
      // CRIU binds the masked directories without their flags; the helper (its action script) set them again before
      // any restored task ran. A restore that left one writable is not this sandbox's.
      const { writable } = await externalMounts(pid, (await targetReady).emptyDir);
      if (writable.length > 0) throw sandboxFailed(`the restore left masked directories without their flags: ${writable.join(', ')}`);
      // The veth's sysctls were set by the helper (CRIU's action script) before it came up.
    } catch (err) {
      // Not the sandbox's then: the restored tree goes (without its daemon its missing pages would be zeros).
      sigkill(pid);
      host.paging.forget(s.name);
      pagers.local?.kill();
      s.init_pid = before.pid;
      s.init_start = before.start;
      throw err;
    }
    lap('harden_ms');
  } finally {
    // Settled before the caller cleans up (an early failure leaves them in flight: a root mounted after the unmount
    // below would stay mounted).
    await targetReady?.catch(() => undefined);
    await network.catch(() => undefined);
    const consoleFd = await consoleWriter.catch(() => undefined);
    if (consoleFd !== undefined) closeSync(consoleFd);
    // A restore that ran detached it already (the helper, at CRIU's post-resume).
    if (mounted.root && (await isMounted(root))) await runTool('umount', ['-l', root]);
    // A daemon still paging in reads its images and writes its log there: prune leaves it until the daemon ends.
    if (pagers.any) void pagers.any.exited.finally(() => host.scratch.delete(scratch));
    else host.scratch.delete(scratch);
  }
  lap('unmount_ms');
  host.log?.info(
    { sandbox: s.name, checkpoint: cp.id, lazy: lazy !== undefined, paged_in_after: pagers.local !== undefined, ...steps },
    'criu restore',
  );
}

/** Where the logs of restores that hung are kept (HUNG_LOGS_KEPT newest), for whoever looks into why. */
const HUNG_LOG_DIR = 'criu-hung';
const HUNG_LOGS_KEPT = 10;

async function keepHungLog(dataDir: string, sandbox: string, attempt: number, log: string): Promise<string | undefined> {
  try {
    const dir = join(dataDir, HUNG_LOG_DIR);
    await mkdir(dir, { recursive: true, mode: 0o700 });
    const file = join(dir, `${new Date().toISOString().replace(/[:.]/g, '-')}-${sandbox}-try${attempt}.log`);
    await writeFile(file, log, { mode: 0o600 });
    const all = (await readdir(dir)).sort();
    for (const old of all.slice(0, Math.max(0, all.length - HUNG_LOGS_KEPT))) await rm(join(dir, old), { force: true });
    return file;
  } catch {
    return undefined;
  }
}

/** Whether something is mounted at `path` in the agent's mount namespace (true when its mountinfo cannot be read). */
async function isMounted(path: string): Promise<boolean> {
  const mounts = await mountPoints();
  // Never empty when read: "/" is always mounted.
  return mounts.size === 0 || mounts.has(path);
}

/** A restore's scratch directory in the staging directory (its images, and a lazy daemon's log): one per attempt. */
function restoreScratchOf(sandbox: string): string {
  return `.restore-${sandbox}-${randomBytes(4).toString('hex')}`;
}

/** The sandbox a restore scratch directory (restoreScratchOf) was made for; undefined for any other entry. */
export function sandboxOfRestoreScratch(entry: string): string | undefined {
  return /^\.restore-(.+)-[0-9a-f]{8}$/.exec(entry)?.[1];
}

/** A restore that hangs is tried this many times in all (each within SandboxHost.restoreDeadlineMs). */
const RESTORE_ATTEMPTS = 2;
