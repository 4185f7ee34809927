import { spawn } from 'node:child_process';
import { closeSync, constants, existsSync, open as fsOpen } from 'node:fs';
import { readFile, readlink, rm, writeFile } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { featureMissing, sandboxFailed } from '../../backend.js';
import { mustRun, processStartTime, sleep } from './exec-util.js';
import { INIT_STATUS_FILE } from './init-status.js';

/**
 * How a sandbox starts, and how a process enters it.
 *
 * The init is started detached (own session, stdio on the console log), so
 * it outlives the agent; nothing about it lives in the agent's memory that a
 * restart cannot find again from state.json and /proc.
 *
 * Every host-side process here starts with a fixed environment. The last
 * step of a start, and every exec, is the static helper
 * (packages/agent/src/native/fleet-sandbox.c), a host file the guest never sees:
 * it pivots into the sandbox root (start) or enters the init's namespaces
 * and root (exec), reduces capabilities to Docker's default set minus
 * CAP_MKNOD, CAP_SYS_CHROOT and (unless the spec asks) CAP_NET_RAW, sets
 * no_new_privs, installs the seccomp filter, and only then applies the
 * guest's environment and execs. /proc and /sys paths that runc masks are
 * masked by the helper's boot too.
 *
 * User namespace: the init is started in a new user namespace whose root
 * is host id `uidBase` (65536 ids from there). The agent writes the id maps,
 * then the helper (mount-root) mounts the overlay from idmapped clones of the
 * image and of the layer directory, so on disk every id stays what the
 * sandbox sees (root-owned image files are root's inside, the layer records
 * 0, not uidBase): checkpoints restore under any other range. Stage 2 then
 * runs as root of the namespace: proc, sysfs (the netns belongs to the
 * userns), a tmpfs /dev with the host's null/zero/… bind-mounted (mknod is
 * refused in a user namespace), devpts, masks, network.
 */

export interface HostTools {
  readonly busybox: string;
  /** The compiled fleet-sandbox helper (ensureSandboxHelper). */
  readonly helper: string;
  /** Where each sandbox's empty directory is (helper.ts emptyDirOf). */
  readonly emptyRoot: string;
}

/** Absolute paths of the host tools the backend needs, or HOST_FEATURE_MISSING naming the package. */
export function findHostTools(busybox = '/bin/busybox'): Omit<HostTools, 'helper' | 'emptyRoot'> {
  const find = (name: string, pkg: string): string => {
    for (const dir of ['/usr/bin', '/usr/sbin', '/bin', '/sbin']) {
      if (existsSync(`${dir}/${name}`)) return `${dir}/${name}`;
    }
    throw featureMissing(name, `install ${pkg}`);
  };
  find('ip', 'iproute2');
  find('tar', 'tar');
  // CRIU's kernel probes run under unshare(1) (criu.ts).
  find('unshare', 'util-linux');
  if (!existsSync(busybox)) throw featureMissing('busybox', `${busybox} is absent: run \`apt-get install busybox-static\``);
  return { busybox };
}

/** Ids per sandbox user namespace: 0-65535 inside (the helper's `mount-root 0` maps the same block). */
export const USERNS_SIZE = 65536;

/**
 * A start, host side and stage 2, is one process until /sbin/init: the
 * helper's `start` (fleet-sandbox.c), where a busybox outer script,
 * unshare(1), the helper's `reap` and `wait-root` (three execs) and a stage-2
 * script of about twenty busybox applets (each a fork and exec, and `ip link
 * show` polled for eth0) ran before. Its pid 1, still on the host's root in
 * a private mount namespace, mounts proc, sysfs, a tmpfs /dev (host nodes
 * bind-mounted), devpts, sets the hostname and lo up, then waits for the
 * agent to create eth0 in its network namespace and configures it
 * (rtnetlink), so the guest is reachable the moment it reports ready; then
 * it boots.
 */

export interface LaunchOptions {
  readonly imageDir: string;
  readonly upper: string;
  readonly work: string;
  readonly rootMount: string;
  readonly hostname: string;
  /** Host id of the sandbox's root; the namespace maps 65536 ids from there. */
  readonly uidBase: number;
  readonly cgroupProcs: readonly string[];
  readonly consoleLog: string;
  /** At most this many bytes of console output are kept (see openConsoleWriter). */
  readonly consoleLogMaxBytes: number;
  /** Where the reaper records how the init ended (default: init.status beside the console log). */
  readonly initStatus?: string;
  /** Guest address with prefix length, e.g. 10.213.0.2/16, and its gateway. */
  readonly address: string;
  readonly gateway: string;
  readonly tools: HostTools;
  /** Keep CAP_NET_RAW (the spec's net_raw). */
  readonly netRaw: boolean;
  /** The sandbox's empty directory (helper.ts ensureEmptyDir), bound read-only over its masked directories. */
  readonly emptyDir: string;
  /** Called once the namespaces exist (with a pid inside them), to move eth0 in; runs while stage 2 mounts. */
  readonly attachNetwork: (nsPid: number) => Promise<void>;
  readonly timeoutMs?: number;
  /** Timings (create's phases_ms debug line): called as each step ends. */
  readonly mark?: (phase: string) => void;
}

export interface Launched {
  /** Host pid of the sandbox's pid 1. */
  readonly initPid: number;
  readonly initStart: string;
  /** Host pid of the helper's start, the reaper: the init's parent, in its namespaces but the pid one. */
  readonly unsharePid: number;
}

/**
 * The init's stdout and stderr (and so everything it starts) go to the
 * console log, which lives on the data directory's filesystem, outside the
 * sandbox's disk and its storage_gb: a guest that respawns a chatty process
 * from its inittab must not fill the host. So the init writes into a FIFO
 * read by a detached busybox that appends at most `max` bytes, rotates the
 * file once (console.log.1) for `max` bytes more, notes the cut
 * and then drains and discards the rest (the guest never blocks on its
 * console). Like the init, it outlives the agent; it ends at EOF, when the
 * sandbox's last process is gone. Returns the write end (the caller closes
 * its copy once the init has it).
 */
export async function openConsoleWriter(logPath: string, max: number, busybox: string, owner: number): Promise<number> {
  const fifo = `${logPath}.fifo`;
  await rm(fifo, { force: true });
  // The writer makes its FIFO itself (busybox applets, no Node spawn of mkfifo first), owned by the sandbox's root:
  // a process outside the init's tree (an exec, the startup script) may then write the console through
  // /proc/1/fd/1, within the same bound as the init. It opens the read end only after the chown, and the agent's
  // open of the write end below completes only then.
  // dd, not head: head buffers its output, holding back the first lines ("fleet sandbox up") until 4 KiB came.
  const script = `mkfifo -m 600 "$1.new" && chown "$4:$4" "$1.new" && mv "$1.new" "$1" || exit 1
exec < "$1"
rm -f "$1"
dd bs=65536 count="$2" iflag=count_bytes 2>/dev/null >> "$3"
# Full: kept as $3.1 (one previous file) and a new file takes the next $2 bytes; after that the rest is discarded.
head -c 1 > "$3.next"
if [ -s "$3.next" ]; then
  mv -f "$3" "$3.1"; mv -f "$3.next" "$3"
  dd bs=65536 count="$(($2 - 1))" iflag=count_bytes 2>/dev/null >> "$3"
  if [ "$(head -c 1 | wc -c)" -gt 0 ]; then echo "
[fleet: console log cut at $2 bytes; the rest is discarded]" >> "$3"; fi
else rm -f "$3.next"; fi
exec cat > /dev/null`;
  await rm(`${fifo}.new`, { force: true });
  const writer = spawn(busybox, ['sh', '-c', script, 'console', fifo, String(max), logPath, String(owner)], {
    detached: true,
    stdio: 'ignore',
    env: { PATH: '/usr/sbin:/usr/bin:/sbin:/bin' },
  });
  writer.unref();
  let stopped = false;
  // Opening the write end waits (in the thread pool) for the writer to open the read end; until the writer has
  // made the FIFO (renamed into place whole, already owned) the open finds nothing and is tried again. Should the
  // writer die first, or not come, a read end opened here releases that wait, and the create fails.
  const opened = new Promise<number>((resolve, reject) => {
    const attempt = (): void =>
      fsOpen(fifo, constants.O_WRONLY | constants.O_APPEND, (err, fd) => {
        if (!err) resolve(fd);
        else if (err.code === 'ENOENT' && !stopped) setTimeout(attempt, 1);
        else reject(err);
      });
    attempt();
  });
  let timer: NodeJS.Timeout | undefined;
  const failed = new Promise<never>((_, reject) => {
    const fail = (why: string): void => {
      stopped = true;
      fsOpen(fifo, constants.O_RDONLY | constants.O_NONBLOCK, (err, fd) => {
        if (!err) closeSync(fd);
      });
      reject(sandboxFailed(`the console log writer ${why}`));
    };
    writer.once('exit', (code) => fail(`exited (code ${code}) before the init started`));
    writer.once('error', (err) => fail(`could not start: ${err.message}`));
    timer = setTimeout(() => fail('did not open its FIFO within 10 s'), 10_000);
  });
  try {
    return await Promise.race([opened, failed]);
  } catch (err) {
    stopped = true;
    void opened.then(closeSync, () => undefined);
    throw err;
  } finally {
    clearTimeout(timer);
    writer.removeAllListeners('exit');
    writer.removeAllListeners('error');
  }
}

export async function launchInit(opts: LaunchOptions): Promise<Launched> {
  // mount-root clones the layer directory: upper/ and work/ must be its children under those names.
  if (basename(opts.upper) !== 'upper' || basename(opts.work) !== 'work' || dirname(opts.upper) !== dirname(opts.work)) {
    throw sandboxFailed(`the writable layer must be <dir>/upper and <dir>/work, got ${opts.upper} and ${opts.work}`);
  }
  const mark = opts.mark ?? ((): void => undefined);
  const log = await openConsoleWriter(opts.consoleLog, opts.consoleLogMaxBytes, opts.tools.busybox, opts.uidBase);
  mark('init.console');
  let child;
  try {
    // The helper's `start` (fleet-sandbox.c): joins the cgroup (so everything after is limited), creates the
    // namespaces with one unshare(2) and forks the init, which runs stage 2 in C; it stays as the init's reaper.
    child = spawn(
      opts.tools.helper,
      [
        'start',
        String(opts.cgroupProcs.length),
        ...opts.cgroupProcs,
        opts.initStatus ?? join(dirname(opts.consoleLog), INIT_STATUS_FILE),
        opts.rootMount,
        opts.hostname,
        opts.address,
        opts.gateway,
        opts.netRaw ? '1' : '0',
        opts.emptyDir,
      ],
      { detached: true, stdio: ['ignore', log, log, 'pipe'], env: {} },
    );
  } finally {
    closeSync(log);
  }
  const unsharePid = child.pid;
  if (unsharePid === undefined) throw sandboxFailed('could not start the sandbox init (spawn failed)');
  // The helper's own waits in a start (the root mount, eth0) end at the same 15 s (START_TIMEOUT_MS in fleet-sandbox.c).
  const ready = new Promise<void>((resolve, reject) => {
    let got = '';
    const timer = setTimeout(() => reject(new Error(`no ready signal within ${opts.timeoutMs ?? 15_000} ms`)), opts.timeoutMs ?? 15_000);
    const pipe = child.stdio[3] as NodeJS.ReadableStream | null;
    pipe?.setEncoding('utf8');
    pipe?.on('data', (d: string) => {
      got += d;
      if (got.includes('ready')) {
        clearTimeout(timer);
        resolve();
      }
    });
    child.once('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`init setup exited (${signal ?? `code ${code}`}) before it was ready`));
    });
  });
  try {
    const setUp = async (): Promise<void> => {
      await waitForNetns(unsharePid);
      mark('init.unshare');
      const map = `0 ${opts.uidBase} ${USERNS_SIZE}\n`;
      await writeFile(`/proc/${unsharePid}/uid_map`, map);
      await writeFile(`/proc/${unsharePid}/gid_map`, map);
      await mustRun(opts.tools.helper, [
        'mount-root',
        String(unsharePid),
        String(opts.uidBase),
        opts.imageDir,
        dirname(opts.upper),
        opts.rootMount,
      ]);
      mark('init.mount-root');
      await opts.attachNetwork(unsharePid);
      mark('init.network');
    };
    await Promise.all([ready.then(() => mark('init.ready')), setUp()]);
  } catch (err) {
    try {
      process.kill(-unsharePid, 'SIGKILL');
    } catch {
      /* gone */
    }
    const tail = (await readFile(opts.consoleLog, 'utf8').catch(() => '')).trim().split('\n').slice(-5).join(' | ');
    throw sandboxFailed(`sandbox init failed to start: ${(err as Error).message}; console: ${tail}`, {}, err);
  } finally {
    (child.stdio[3] as (NodeJS.ReadableStream & { destroy?: () => void }) | null)?.destroy?.();
    child.unref();
  }
  const initPid = await childOf(unsharePid);
  // The reaper (never forking again) is kept out of the OOM killer's choice where the host allows it
  // (CAP_SYS_RESOURCE), as before; its few pages are rarely the pick anyway. Only now that the init is forked: the
  // helper must not do it itself before the fork, since the -1000 would become the floor of every guest process
  // (see guest_oom_floor in fleet-sandbox.c), nor can it after, from inside the user namespace.
  await writeFile(`/proc/${unsharePid}/oom_score_adj`, '-1000').catch(() => undefined);
  const initStart = await processStartTime(initPid);
  if (initStart === null) throw sandboxFailed('sandbox init exited right after start; see its console log');
  return { initPid, initStart, unsharePid };
}

/** The helper's start moves itself into the new namespaces (one unshare(2)) before it forks pid 1: wait until its netns is not ours. */
async function waitForNetns(pid: number): Promise<void> {
  const own = await readlink('/proc/self/ns/net');
  for (let i = 0; i < 2000; i++) {
    const theirs = await readlink(`/proc/${pid}/ns/net`).catch(() => null);
    if (theirs === null) throw new Error('the sandbox init exited before its network namespace existed');
    if (theirs !== own) return;
    await sleep(2);
  }
  throw new Error('the sandbox network namespace did not appear within 4 s');
}

async function childOf(pid: number): Promise<number> {
  for (let i = 0; i < 200; i++) {
    const text = await readFile(`/proc/${pid}/task/${pid}/children`, 'utf8').catch(() => '');
    const first = text.trim().split(/\s+/)[0];
    if (first) return Number(first);
    await sleep(5);
  }
  throw sandboxFailed(`could not find the sandbox init under unshare pid ${pid}`);
}

export type EnterOp =
  | { readonly op: 'exec'; readonly argv: readonly string[] }
  | { readonly op: 'put'; readonly path: string; readonly mode: string; readonly tmp: string; readonly parents?: boolean }
  | { readonly op: 'get' | 'unlink'; readonly path: string };

/**
 * The argv that runs an operation inside a sandbox: one exec of the helper,
 * which joins the cgroups, enters the init's namespaces (user first) and
 * root, confines itself and runs `op` there. cwd is resolved inside.
 */
export function enterArgv(opts: {
  initPid: number;
  initStart: string;
  cgroupProcs: readonly string[];
  cwd: string;
  netRaw: boolean;
  winsize?: { rows: number; cols: number };
  op: EnterOp;
  tools: HostTools;
}): string[] {
  const op = opts.op;
  const tail =
    op.op === 'exec'
      ? ['exec', ...op.argv]
      : op.op === 'put'
        ? ['put', op.path, op.mode, op.tmp, ...(op.parents ? ['parents'] : [])]
        : [op.op, op.path];
  return [
    opts.tools.helper,
    'enter',
    String(opts.initPid),
    '--start',
    opts.initStart,
    ...opts.cgroupProcs.flatMap((f) => ['--cg', f]),
    '--cwd',
    opts.cwd,
    ...(opts.netRaw ? ['--net-raw'] : []),
    ...(opts.winsize ? ['--winsize', String(opts.winsize.rows), String(opts.winsize.cols)] : []),
    '--',
    ...tail,
  ];
}
