import { spawn } from 'node:child_process';
import { closeSync, existsSync, openSync } from 'node:fs';
import { chmod, copyFile, mkdir, readFile, readlink, rename, rm, stat, symlink } from 'node:fs/promises';
import { join } from 'node:path';
import { featureMissing, sandboxFailed } from '../../backend.js';
import { mustRun, processStartTime, sleep } from './exec-util.js';

/**
 * How a sandbox starts, and how a process enters it.
 *
 * The init is started detached (own session, stdio on the console log), so
 * it outlives the agent; nothing about it lives in the agent's memory that a
 * restart cannot find again from state.json and /proc.
 *
 * Capabilities: sandbox processes run as uid 0 but with Docker's default
 * bounding set minus CAP_MKNOD and CAP_SYS_CHROOT (and without
 * CAP_SYS_ADMIN/NET_ADMIN), so they cannot mount, create devices, chroot out
 * of the pivoted root, or change their routes. Setting up needs
 * CAP_SYS_ADMIN after the bounding set is dropped (pivot_root, umount), so it
 * is carried in the inheritable+ambient sets across that exec and cleared by
 * the last exec — by a copy of the host's static busybox, bind-mounted
 * read-only at /dev/.fleet/busybox, because after the pivot no host binary
 * is reachable.
 * Every exec runs that binary with CAP_SYS_ADMIN still ambient, so the guest
 * must not be able to swap it: /dev/.fleet is its own read-only mount (a
 * mount point cannot be renamed, and sandboxes cannot unmount).
 *
 * /dev is a fresh tmpfs filled by one copy of a template made at open
 * (prepareRuntime), rather than a dozen mknod/ln calls per create.
 * The inheritable set must be raised before the bounding set is dropped
 * (capset refuses otherwise), hence two setpriv calls.
 */

export interface HostTools {
  readonly setpriv: string;
  readonly nsenter: string;
  readonly unshare: string;
  readonly busybox: string;
}

/** Absolute paths of the host tools the backend needs, or HOST_FEATURE_MISSING naming the package. */
export function findHostTools(busybox = '/bin/busybox'): HostTools {
  const find = (name: string, pkg: string): string => {
    for (const dir of ['/usr/bin', '/usr/sbin', '/bin', '/sbin']) {
      if (existsSync(`${dir}/${name}`)) return `${dir}/${name}`;
    }
    throw featureMissing(name, `install ${pkg}`);
  };
  find('ip', 'iproute2');
  find('tar', 'tar');
  if (!existsSync(busybox)) throw featureMissing('busybox', `${busybox} is absent: run \`apt-get install busybox-static\``);
  return { setpriv: find('setpriv', 'util-linux'), nsenter: find('nsenter', 'util-linux'), unshare: find('unshare', 'util-linux'), busybox };
}

const DEV_NODES: ReadonlyArray<[string, number, number]> = [
  ['null', 1, 3],
  ['zero', 1, 5],
  ['full', 1, 7],
  ['random', 1, 8],
  ['urandom', 1, 9],
  ['tty', 5, 0],
];

/**
 * `<dataDir>/runtime/{dev,helper}`: the guest /dev template and the helper
 * directory (busybox alone). Built under a temporary name and renamed, and
 * never deleted while the agent runs: live sandboxes have the helper
 * directory mounted.
 */
export async function prepareRuntime(dataDir: string, busybox: string): Promise<string> {
  const dir = join(dataDir, 'runtime');
  const helper = join(dir, 'helper', 'busybox');
  const want = (await stat(busybox)).size;
  const have = await stat(helper).then((s) => s.size, () => -1);
  if (have === want && existsSync(join(dir, 'dev', 'null'))) return dir;
  const tmp = `${dir}.tmp-${process.pid}`;
  await rm(tmp, { recursive: true, force: true });
  await mkdir(join(tmp, 'helper'), { recursive: true });
  await copyFile(busybox, join(tmp, 'helper', 'busybox'));
  await chmod(join(tmp, 'helper', 'busybox'), 0o755);
  const dev = join(tmp, 'dev');
  for (const d of ['pts', 'shm', '.fleet']) await mkdir(join(dev, d), { recursive: true });
  await chmod(join(dev, 'shm'), 0o1777);
  for (const [name, major, minor] of DEV_NODES) await mustRun('mknod', ['-m', '666', join(dev, name), 'c', String(major), String(minor)]);
  for (const [name, target] of [['fd', '/proc/self/fd'], ['stdin', '/proc/self/fd/0'], ['stdout', '/proc/self/fd/1'], ['stderr', '/proc/self/fd/2'], ['ptmx', 'pts/ptmx']] as const) {
    await symlink(target, join(dev, name));
  }
  // A previous runtime may be mounted by live sandboxes: move it aside rather than delete it.
  if (existsSync(dir)) await rename(dir, `${dir}.old-${Date.now()}`);
  await rename(tmp, dir);
  return dir;
}

export const GUEST_BUSYBOX = '/dev/.fleet/busybox';
const BOUNDING = '-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,+net_bind_service,+net_raw,+audit_write,+setfcap';

/**
 * Outer: runs on the host, joins the cgroup (so everything after is limited),
 * then creates the namespaces. The scripts run under the host's static
 * busybox sh: its applets (mount, mkdir, ip…) start without an exec of a
 * dynamic binary, which is most of a create's latency on a busy host.
 */
const OUTER = `set -eu
n=$1; shift
i=0
for f in "$@"; do
  i=$((i+1)); [ "$i" -gt "$n" ] && break
  echo $$ > "$f"
done
shift "$n"
exec "$UNSHARE" --pid --mount --uts --ipc --net --fork --propagation private -- "$BB" sh -c "$STAGE2" stage2 "$@"
`;

/**
 * Stage 2: pid 1 of the new namespaces, still on the host's root, in a
 * private mount namespace. It waits for the agent to move eth0 into its
 * network namespace and configures it, so the guest is reachable the
 * moment it reports ready.
 */
const STAGE2 = `set -eu
unset STAGE2 UNSHARE BB SETPRIV
img=$1 upper=$2 work=$3 root=$4 host=$5 runtime=$6 addr=$7 gw=$8 setpriv=$9
bb=$runtime/helper/busybox
mount -t overlay overlay -o "lowerdir=$img,upperdir=$upper,workdir=$work,index=off,metacopy=off,redirect_dir=off" "$root"
if [ ! -e "$root/sbin/init" ] && [ ! -L "$root/sbin/init" ]; then echo "fleet: the image has no /sbin/init" >&2; exit 65; fi
for d in proc dev tmp; do [ -d "$root/$d" ] || mkdir -p "$root/$d"; done
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -o bind "$root/proc/sys" "$root/proc/sys"
mount -o remount,bind,ro "$root/proc/sys"
for f in sysrq-trigger kcore; do if [ -e "$root/proc/$f" ]; then mount -o bind /dev/null "$root/proc/$f"; fi; done
if [ -d "$root/sys" ]; then mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"; fi
mount -t tmpfs -o mode=755,size=64m,nosuid tmpfs "$root/dev"
cp -a "$runtime/dev/." "$root/dev/"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$root/dev/pts" || true
mount -o bind "$runtime/helper" "$root/dev/.fleet"
mount -o remount,bind,ro "$root/dev/.fleet"
hostname "$host"
ip link set lo up
i=0
until ip link show eth0 >/dev/null 2>&1; do
  i=$((i+1)); if [ "$i" -gt 2000 ]; then echo "fleet: eth0 never arrived" >&2; exit 66; fi
  usleep 2000
done
ip addr add "$addr" dev eth0
ip link set eth0 up
ip route add default via "$gw" dev eth0
cd "$root"
exec setpriv --inh-caps=+sys_admin --ambient-caps=+sys_admin -- "$setpriv" --bounding-set=${BOUNDING} -- "$bb" sh -c 'pivot_root . . && umount -l . && cd / && echo ready >&3 && exec 3>&- && exec ${GUEST_BUSYBOX} setpriv --inh-caps=-sys_admin --ambient-caps=-sys_admin -- /sbin/init'
`;

export interface LaunchOptions {
  readonly imageDir: string;
  readonly upper: string;
  readonly work: string;
  readonly rootMount: string;
  readonly hostname: string;
  /** From prepareRuntime(): the /dev template and the helper directory. */
  readonly runtimeDir: string;
  readonly cgroupProcs: readonly string[];
  readonly consoleLog: string;
  /** Guest address with prefix length, e.g. 10.213.0.2/16, and its gateway. */
  readonly address: string;
  readonly gateway: string;
  readonly tools: HostTools;
  /** Called once the namespaces exist (with a pid inside them), to move eth0 in; runs while stage 2 mounts. */
  readonly attachNetwork: (nsPid: number) => Promise<void>;
  readonly timeoutMs?: number;
}

export interface Launched {
  /** Host pid of the sandbox's pid 1. */
  readonly initPid: number;
  readonly initStart: string;
  /** Host pid of unshare, the init's parent. */
  readonly unsharePid: number;
}

export async function launchInit(opts: LaunchOptions): Promise<Launched> {
  const log = openSync(opts.consoleLog, 'a');
  let child;
  try {
    child = spawn(
      opts.tools.busybox,
      ['sh', '-c', OUTER, 'outer', String(opts.cgroupProcs.length), ...opts.cgroupProcs, opts.imageDir, opts.upper, opts.work, opts.rootMount, opts.hostname, opts.runtimeDir, opts.address, opts.gateway, opts.tools.setpriv],
      {
        detached: true,
        stdio: ['ignore', log, log, 'pipe'],
        env: { PATH: '/usr/sbin:/usr/bin:/sbin:/bin', STAGE2, UNSHARE: opts.tools.unshare, BB: opts.tools.busybox },
      },
    );
  } finally {
    closeSync(log);
  }
  const unsharePid = child.pid;
  if (unsharePid === undefined) throw sandboxFailed('could not start the sandbox init (spawn failed)');
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
    await Promise.all([ready, waitForNetns(unsharePid).then(() => opts.attachNetwork(unsharePid))]);
  } catch (err) {
    try {
      process.kill(-unsharePid, 'SIGKILL');
    } catch {
      /* gone */
    }
    const tail = (await readFile(opts.consoleLog, 'utf8').catch(() => '')).trim().split('\n').slice(-5).join(' | ');
    throw sandboxFailed(`sandbox init failed to start: ${(err as Error).message}; console: ${tail}`, {}, err);
  } finally {
    (child.stdio[3] as NodeJS.ReadableStream & { destroy?: () => void } | null)?.destroy?.();
    child.unref();
  }
  const initPid = await childOf(unsharePid);
  const initStart = await processStartTime(initPid);
  if (initStart === null) throw sandboxFailed('sandbox init exited right after start; see its console log');
  return { initPid, initStart, unsharePid };
}

/** unshare(1) moves itself into the new namespaces before it forks pid 1: wait until its netns is not ours. */
async function waitForNetns(pid: number): Promise<void> {
  const own = await readlink('/proc/self/ns/net');
  for (let i = 0; i < 2000; i++) {
    const [theirs, exe] = await Promise.all([readlink(`/proc/${pid}/ns/net`).catch(() => null), readlink(`/proc/${pid}/exe`).catch(() => null)]);
    if (theirs === null) throw new Error('the sandbox init exited before its network namespace existed');
    if (theirs !== own && exe !== null && exe.endsWith('/unshare')) return;
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

/**
 * The argv that runs `argv` inside a sandbox: join its cgroups, enter its
 * namespaces and root (nsenter -r: the init's pivoted root), with the
 * sandbox's capability set. -W changes directory inside the namespace, as
 * the guest would (nsenter's -w would open the path on the host).
 */
export function enterArgv(opts: { initPid: number; cgroupProcs: readonly string[]; cwd: string; argv: readonly string[]; tools: HostTools }): string[] {
  // Under busybox sh the loop and the first setpriv are applets: no dynamic binary starts until the bounding-set setpriv.
  const script = `set -e
n=$1; shift
i=0
for f in "$@"; do i=$((i+1)); [ "$i" -gt "$n" ] && break; echo $$ > "$f"; done
shift "$n"
cwd=$1; shift
exec setpriv --inh-caps=+sys_admin,+sys_chroot --ambient-caps=+sys_admin,+sys_chroot -- ${opts.tools.setpriv} --bounding-set=${BOUNDING} -- ${opts.tools.nsenter} -t ${opts.initPid} -m -u -i -n -p -r -W "$cwd" -- ${GUEST_BUSYBOX} setpriv --inh-caps=-sys_admin,-sys_chroot --ambient-caps=-sys_admin,-sys_chroot -- "$@"`;
  return [opts.tools.busybox, 'sh', '-c', script, 'enter', String(opts.cgroupProcs.length), ...opts.cgroupProcs, opts.cwd, ...opts.argv];
}
