import { spawn, type ChildProcess } from 'node:child_process';
import { accessSync, constants as fsConstants, existsSync } from 'node:fs';
import { chmod, link, lstat, mkdir, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { basename, delimiter, dirname, join } from 'node:path';
import { z } from 'zod';
import { AppError } from '@fleet/agent-protocol';
import { sandboxFailed } from '../../backend.js';
import { CRIU_ENV, LAZY_LOG, spawnUntilReady } from './criu-lazy.js';
import { eachLimited, runTool, sigkill } from './exec-util.js';
import { unescapeMountField } from './storage.js';

/**
 * Memory checkpoints of a sandbox with CRIU (criu.org): the sandbox's whole
 * process tree (its pid, mount, uts, ipc and user namespaces, memory, file
 * descriptors, listening and established TCP sockets, seccomp filters) is
 * dumped from its init, and restored into a fresh pid namespace on this or
 * another host, under the same name or a new one.
 *
 * What the sandbox layout needs from CRIU, and why each option is there:
 * - `--empty-ns net`: the network namespace is not dumped; a restore makes an
 *   empty one and our action script (the helper, fleet-sandbox.c
 *   `cmd_criu_hook`) gives it its eth0 at `setup-namespaces` (veth to the
 *   bridge, address, route and ping range, over rtnetlink from the host). CRIU
 *   cannot recreate a veth whose peer is in the host namespace from inside the
 *   sandbox's user namespace (netlink EPERM), and the address, MAC and veth of
 *   a fork or a moved sandbox are new anyway.
 * - `--external mnt[...]`: /dev/null & co. (and the /proc masks) are binds of
 *   the host's devtmpfs; each is restored from `/dev` + its root in the
 *   source's mountinfo, never from its own mount point (that would bind the
 *   host's /proc/keys into the guest). The masked directories (/proc/acpi,
 *   /sys/firmware, ...) are binds of the sandbox's own empty directory,
 *   restored from its empty directory on the restoring host: as a tmpfs each
 *   would cost a tar and a gzip at every dump (guest frozen) and every restore.
 * - `--external file[mnt:ino]` + `--inherit-fd`: the init's stdout/stderr are
 *   the console FIFO, whose reader lives on the host; a restore hands CRIU a
 *   new FIFO with a new reader, owned by the sandbox's root (CRIU reopens it
 *   from inside the user namespace).
 * - the user namespace is restored from the image; a restore under another
 *   id block rewrites the image's map (rewriteUsernsImage).
 * - `--manage-cgroups=ignore`, with criu started inside the sandbox's cgroups:
 *   the restored tree inherits them, whatever the names are now.
 * - `--tcp-established`: connections survive a same-address restore; a
 *   restore under another address uses `--tcp-close` instead.
 *
 * CRIU 4.1.1 needs a patch on Linux ≥ 6.16 to dump inet sockets at all
 * (scripts/criu/criu-4.1.1-sockopt-6.16.patch); `criuSocketCheck` finds out.
 */

export interface CriuFeatures {
  readonly path: string;
  readonly version: string;
  /** Live snapshots, pause/resume, fork and live moves of running sandboxes. */
  readonly liveSnapshot: boolean;
  /** Post-copy restores (userfaultfd for the restored, user-namespaced tasks). */
  readonly lazyPages: boolean;
  /** Memory dirty tracking (soft-dirty bits) for diff snapshots. */
  readonly memoryDiff: boolean;
  /** Why a feature is off, for the log. */
  readonly notes: readonly string[];
}

export const MEMORY_FILE_PREFIX = 'criu-';
export const CRIU_META = `${MEMORY_FILE_PREFIX}fleet.json`;

/** What a restore needs to know about the dump besides CRIU's own images (criu-fleet.json, hashed like the rest). */
export const criuMetaSchema = z.object({
  /** 2: with empty_mounts (an agent that knows only 1 refuses it rather than restore without them). */
  version: z.union([z.literal(1), z.literal(2)]),
  /** The init's console FIFO as CRIU names it: file[<mnt_id hex>:<inode hex>]. */
  console_id: z.string().regex(/^file\[[0-9a-f]+:[0-9a-f]+\]$/),
  /** External mounts: CRIU key -> the host path they bind (always under /dev). */
  mounts: z.record(
    z.string().regex(/^[A-Za-z0-9_]+$/),
    z
      .string()
      .regex(/^\/dev\/[A-Za-z0-9._-]+$/)
      .refine((p) => !p.includes('..')),
  ),
  /** External mounts that bind the agent's empty directory (masked directories): CRIU keys. */
  empty_mounts: z.array(z.string().regex(/^[A-Za-z0-9_]+$/)).default([]),
  uid_base: z.number().int().positive(),
  ip: z.string(),
  hostname: z.string(),
});
export type CriuMeta = z.infer<typeof criuMetaSchema>;

function findOnPath(name: string): string | null {
  for (const dir of (process.env.PATH ?? '/usr/sbin:/usr/bin:/sbin:/bin').split(delimiter)) {
    const p = join(dir, name);
    try {
      accessSync(p, fsConstants.X_OK);
      return p;
    } catch {
      /* next */
    }
  }
  for (const dir of ['/usr/local/sbin', '/usr/sbin', '/sbin']) if (existsSync(join(dir, name))) return join(dir, name);
  return null;
}

/**
 * CRIU_PATH, else `criu` on PATH; `criu check` must pass. null (with the
 * reason) when there is none, or CRIU_PATH is `off`: the host then answers a
 * live request with a disk checkpoint, as before.
 */
export async function detectCriu(
  envPath = process.env.CRIU_PATH,
  lazyRestore = true,
): Promise<{ features: CriuFeatures | null; reason: string }> {
  if (envPath === 'off') return { features: null, reason: 'CRIU_PATH=off' };
  const path = envPath && envPath.length > 0 ? envPath : findOnPath('criu');
  if (!path) return { features: null, reason: 'no criu on PATH and CRIU_PATH unset' };
  const env = { PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' };
  const check = await runTool(path, ['check'], { env, timeoutMs: 60_000 }).catch((err: unknown) => ({
    code: -1,
    stdout: '',
    stderr: (err as Error).message,
  }));
  if (check.code !== 0) return { features: null, reason: `${path} check failed: ${(check.stderr || check.stdout).trim().slice(-300)}` };
  const version = (await runTool(path, ['--version'], { env }).catch(() => ({ stdout: '' }))).stdout.match(/Version:\s*(\S+)/)?.[1] ?? '';
  const feature = async (f: string): Promise<boolean> =>
    (await runTool(path, ['check', '--feature', f], { env }).catch(() => ({ code: 1 }))).code === 0;
  const notes: string[] = [];
  const uffd = await feature('uffd-noncoop');
  // The restored tasks open their userfaultfd themselves, as root of the sandbox's user namespace: the kernel
  // refuses that unless unprivileged userfaultfd is allowed.
  const unpriv = (await readFile('/proc/sys/vm/unprivileged_userfaultfd', 'utf8').catch(() => '0')).trim() === '1';
  // Or scripts/criu's uffd-dev patch (its service fd's name is in the binary): criu opens /dev/userfaultfd for them.
  const viaDev = !unpriv && existsSync('/dev/userfaultfd') && (await readFile(path).catch(() => Buffer.alloc(0))).includes('UFFD_DEV_OFF');
  if (!uffd) notes.push('lazy pages off: the kernel has no non-cooperative userfaultfd');
  else if (!unpriv && !viaDev)
    notes.push('lazy pages off: vm.unprivileged_userfaultfd is 0 and this criu lacks the /dev/userfaultfd patch (scripts/criu)');
  const dirty = await feature('mem_dirty_track');
  if (!dirty) notes.push('memory diff off: the kernel has no soft-dirty bits');
  const lazyPages = uffd && (unpriv || viaDev);
  // A full restore reads the sandbox's memory into fresh pages: with huge pages only where a program asked for them
  // (`madvise`, the default of many kernels), one page fault per 4 KiB, which on some hosts (virtual machines above
  // all) is most of a resume: docs/host-agent.md, "Transparent huge pages". Restores that page memory in after
  // (lazyRestore) have the kernel install each page instead, with no fault.
  const thp = await transparentHugepages();
  if (thp !== null && thp !== 'always' && !(lazyPages && lazyRestore))
    notes.push(`transparent_hugepage is "${thp}": full restores fault memory in 4 KiB pages; "always" makes resumes and forks faster`);
  const kdat = await installKdatCache(path);
  if (kdat) notes.push(kdat);
  return { features: { path, version, liveSnapshot: true, lazyPages, memoryDiff: dirty, notes }, reason: '' };
}

/** The host's transparent huge page mode (`always`, `madvise`, `never`), or null when the kernel has none. */
export async function transparentHugepages(): Promise<string | null> {
  const text = await readFile('/sys/kernel/mm/transparent_hugepage/enabled', 'utf8').catch(() => null);
  return text?.match(/\[(\w+)\]/)?.[1] ?? null;
}

const TMPFS_MAGIC = 0x01021994;
export const KDAT_CACHE = '/run/criu.kdat';

/**
 * What CRIU probes of the kernel before any dump or restore (its "kerndat":
 * a test veth in a throwaway network namespace, `iptables -L`, vDSO, pagemap,
 * about fifty probes) it keeps in /run/criu.kdat, and loads from there on the
 * next run, but it writes that file only on a tmpfs (so that a reboot into
 * another kernel drops it). Where /run is not a tmpfs (this host; a
 * container) every run probed afresh: 0.1-0.25 s of each resume under load.
 * The agent then has a criu of its own, in a private mount namespace over a
 * fresh tmpfs on /run, probe this kernel once as it starts, and installs the
 * file: CRIU reads it from any filesystem. CRIU checks only the file's size
 * and two magic numbers, yet it holds values of this boot (the zero page's
 * pfn, shmem device numbers): a stale one can make a dump take a real page
 * for the zero page. So the file is kept only while its sidecar (`.id`: the
 * boot id, the kernel release, and the criu binary's path, inode, size and
 * mtime) matches exactly; anything else (another boot, kernel or criu; a
 * clock that was wrong when it was made) makes it again.
 * Answers a note for the log, or null when /run is a tmpfs (CRIU does it itself).
 */
export async function installKdatCache(criuPath: string, target = KDAT_CACHE): Promise<string | null> {
  const { statfs, mkdtemp, copyFile, rename, stat } = await import('node:fs/promises');
  const { tmpdir, release } = await import('node:os');
  const fsType = await statfs(dirname(target)).then(
    (st) => st.type,
    () => null,
  );
  if (fsType === null || fsType === TMPFS_MAGIC) return null;
  const bin = await stat(criuPath).catch(() => null);
  if (!bin) return `no kernel-probe cache for criu: ${criuPath} is gone`;
  const identity = JSON.stringify({
    boot_id: (await readFile('/proc/sys/kernel/random/boot_id', 'utf8')).trim(),
    kernel: release(),
    criu: { path: criuPath, ino: bin.ino, size: bin.size, mtime_ms: bin.mtimeMs },
  });
  const sidecar = `${target}.id`;
  const have = await stat(target).catch(() => null);
  const made = await readFile(sidecar, 'utf8').catch(() => null);
  if (have && have.size > 0 && made === identity) return `criu's kernel probes cached in ${target}, made in this boot by this criu`;
  // The sidecar goes first and comes back last: a crash in between leaves a file that is made again.
  await rm(sidecar, { force: true });
  const work = await mkdtemp(join(tmpdir(), 'criu-kdat-'));
  try {
    const out = join(work, 'criu.kdat');
    const res = await runTool(
      'unshare',
      [
        '--mount',
        '--propagation',
        'private',
        '--',
        '/bin/sh',
        '-c',
        'mount -t tmpfs -o size=1m,mode=0755 tmpfs /run && { "$1" check >/dev/null 2>&1; cp /run/criu.kdat "$2"; }',
        'kdat',
        criuPath,
        out,
      ],
      { env: CRIU_ENV, timeoutMs: 60_000 },
    ).catch((err: unknown) => ({ code: -1, stdout: '', stderr: (err as Error).message }));
    if (res.code !== 0) return `no kernel-probe cache for criu (/run is not a tmpfs): ${res.stderr.trim().slice(-200)}`;
    const tmp = `${target}.fleet-${process.pid}`;
    await copyFile(out, tmp);
    await rename(tmp, target);
    await writeFile(`${sidecar}.fleet-${process.pid}`, identity);
    await rename(`${sidecar}.fleet-${process.pid}`, sidecar);
    return `criu's kernel probes cached in ${target} (/run is not a tmpfs, where criu would keep them itself)`;
  } catch (err) {
    return `no kernel-probe cache for criu: ${(err as Error).message}`;
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

// ---- image rewriting --------------------------------------------------------------

function readVarint(b: Buffer, at: number): [number, number] {
  let v = 0;
  let mul = 1;
  let i = at;
  for (;;) {
    const byte = b[i++];
    if (byte === undefined) throw new Error('truncated varint');
    v += (byte & 0x7f) * mul;
    if (byte < 0x80) return [v, i];
    mul *= 128;
  }
}

function varint(n: number): Buffer {
  const out: number[] = [];
  let v = n;
  while (v >= 0x80) {
    out.push((v % 128) | 0x80);
    v = Math.floor(v / 128);
  }
  out.push(v);
  return Buffer.from(out);
}

interface PbField {
  readonly num: number;
  readonly wire: number;
  readonly raw: Buffer;
  readonly value: number | Buffer;
}

function pbFields(b: Buffer): PbField[] {
  const out: PbField[] = [];
  let at = 0;
  while (at < b.length) {
    const start = at;
    const [key, a1] = readVarint(b, at);
    const wire = key & 7;
    let value: number | Buffer;
    if (wire === 0) [value, at] = readVarint(b, a1);
    else if (wire === 2) {
      const [len, a2] = readVarint(b, a1);
      value = b.subarray(a2, a2 + len);
      at = a2 + len;
    } else if (wire === 5) [value, at] = [b.subarray(a1, a1 + 4), a1 + 4];
    else if (wire === 1) [value, at] = [b.subarray(a1, a1 + 8), a1 + 8];
    else throw new Error(`protobuf wire type ${wire}`);
    out.push({ num: Math.floor(key / 8), wire, raw: b.subarray(start, at), value });
  }
  return out;
}

/**
 * userns-N.img under another id block: each extent's lower_first moves from
 * `from` to `to`. The file is CRIU's image format: 8 bytes of magic, then
 * entries of a little-endian u32 length and a protobuf userns_entry
 * { repeated extent uid_map = 1, gid_map = 2 }, extent { first = 1,
 * lower_first = 2, count = 3 }.
 */
export function rewriteUsernsImage(img: Buffer, from: number, to: number): Buffer {
  const parts: Buffer[] = [img.subarray(0, 8)];
  for (let at = 8; at < img.length;) {
    const len = img.readUInt32LE(at);
    const entry = img.subarray(at + 4, at + 4 + len);
    at += 4 + len;
    const rewritten = Buffer.concat(
      pbFields(entry).map((f) => {
        if ((f.num !== 1 && f.num !== 2) || f.wire !== 2) return f.raw;
        const extent = Buffer.concat(
          pbFields(f.value as Buffer).map((x) => {
            if (x.num !== 2 || x.wire !== 0) return x.raw;
            const lower = x.value as number;
            if (lower < from || lower >= from + 65536)
              throw sandboxFailed(`the checkpoint's id map (${lower}) is not the sandbox's (${from})`);
            return Buffer.concat([varint(2 * 8), varint(lower - from + to)]);
          }),
        );
        return Buffer.concat([varint(f.num * 8 + 2), varint(extent.length), extent]);
      }),
    );
    const l = Buffer.alloc(4);
    l.writeUInt32LE(rewritten.length);
    parts.push(l, rewritten);
  }
  return Buffer.concat(parts);
}

// ---- dump and restore ------------------------------------------------------------

/**
 * The sandbox's mounts CRIU must not dump: binds of the host's devtmpfs (restored from `/dev` + their root), and
 * binds of the sandbox's empty directory (the masked directories), known from mountinfo alone (its device, and a root
 * ending in its name: nothing is looked up through the guest's tree).
 */
export async function externalMounts(
  pid: number,
  emptyDir: string,
): Promise<{
  devices: Array<{ mountpoint: string; source: string }>;
  empty: string[];
  /** Of `empty`, those missing any of ro, nosuid, nodev, noexec. */
  writable: string[];
}> {
  const text = await readFile(`/proc/${pid}/mountinfo`, 'utf8');
  const unescape = (f: string | undefined): string => unescapeMountField(f ?? '');
  const want = await lstat(emptyDir).catch(() => null);
  const wantDev = want ? `${Math.floor(want.dev / 256) & 0xfff}:${(want.dev & 0xff) | ((want.dev >> 12) & 0xfff00)}` : '';
  const devices: Array<{ mountpoint: string; source: string }> = [];
  const empty: string[] = [];
  const writable: string[] = [];
  for (const line of text.split('\n')) {
    const [pre, post] = line.split(' - ');
    if (!pre || !post) continue;
    const f = pre.split(' ');
    const root = unescape(f[3]);
    const mountpoint = unescape(f[4]);
    if (post.split(' ')[0] === 'devtmpfs') devices.push({ mountpoint, source: `/dev${root}` });
    else if (want && f[2] === wantDev && root.endsWith(`/${basename(emptyDir)}`)) {
      empty.push(mountpoint);
      const flags = new Set((f[5] ?? '').split(','));
      if (!['ro', 'nosuid', 'nodev', 'noexec'].every((x) => flags.has(x))) writable.push(mountpoint);
    }
  }
  return { devices, empty, writable };
}

const mountKey = (mountpoint: string): string => `m${mountpoint.replace(/[^A-Za-z0-9]/g, '_')}`;

function freeLoopbackPort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const a = srv.address();
      srv.close(() => (typeof a === 'object' && a ? resolve(a.port) : reject(new Error('no port'))));
    });
  });
}

export interface DumpResult {
  readonly meta: CriuMeta;
  /** Lazy dump: the criu process that now holds the pages and serves them on 127.0.0.1:port until they are all fetched. */
  readonly pageServer?: { readonly child: ChildProcess; readonly port: number };
  /** CRIU's statistics: how long the tree was frozen, and pages written. */
  readonly frozenMs: number;
  readonly pagesWritten: number;
}

/** `criu restore` did not finish by its deadline and was killed; `logTail`: the last lines of its log. */
export class RestoreTimedOut extends Error {
  readonly logTail: string;
  constructor(
    readonly deadlineMs: number,
    /** The whole criu log of the killed restore. */
    readonly log: string,
    /** The log of its lazy-pages daemon, if it had one. */
    readonly daemonLog = '',
  ) {
    super(`criu restore did not finish within ${deadlineMs} ms`);
    this.logTail = log.split('\n').filter(Boolean).slice(-8).join(' | ');
  }

  /** The logs to keep: the restore's last 4 MiB (a -v4 log of a large tree can be far more), then the daemon's last 1 MiB. */
  get kept(): string {
    const tail = (text: string, max: number): string => (text.length > max ? text.slice(-max) : text);
    const restore = tail(this.log, 4 * 1024 * 1024);
    return this.daemonLog === '' ? restore : `${restore}\n---- ${LAZY_LOG} ----\n${tail(this.daemonLog, 1024 * 1024)}`;
  }
}

function criuError(what: string, log: string): AppError {
  const lines = log
    .split('\n')
    .filter((l) => /Error|Warn/.test(l) && !/RLIMIT_NOFILE|iptables|ip6tables|network-lock will be ignored/.test(l))
    .slice(-6)
    .join(' | ');
  return sandboxFailed(`${what}: ${lines || 'see the criu log'}`);
}

function runCriu(
  argv: readonly string[],
  opts: { cgroupProcs?: readonly string[]; fd3?: number; env?: Record<string, string>; signal?: AbortSignal },
): Promise<number | null> {
  // Inside the sandbox's cgroups first, so what it restores starts there.
  const script = 'n=$1; shift; i=0; for f in "$@"; do i=$((i+1)); [ "$i" -gt "$n" ] && break; echo $$ > "$f"; done; shift "$n"; exec "$@"';
  const cg = opts.cgroupProcs ?? [];
  return new Promise((resolve, reject) => {
    const child = spawn('/bin/sh', ['-c', script, 'criu', String(cg.length), ...cg, ...argv], {
      stdio: ['ignore', 'ignore', 'ignore', ...(opts.fd3 !== undefined ? [opts.fd3] : [])],
      env: { ...CRIU_ENV, ...(opts.env ?? {}) },
    });
    child.once('error', reject);
    child.once('close', (code) => resolve(code));
    opts.signal?.addEventListener('abort', () => child.kill('SIGKILL'), { once: true });
  });
}

/** dump_stats_entry: frozen_time = 2 (µs), pages_written = 7. */
async function dumpStats(dir: string): Promise<{ frozenMs: number; pagesWritten: number }> {
  try {
    const b = await readFile(join(dir, 'stats-dump'));
    const len = b.readUInt32LE(8);
    const top = pbFields(b.subarray(12, 12 + len));
    const dump = top.find((f) => f.num === 1)?.value;
    if (!(dump instanceof Buffer)) return { frozenMs: 0, pagesWritten: 0 };
    const f = pbFields(dump);
    const num = (n: number): number => {
      const v = f.find((x) => x.num === n)?.value;
      return typeof v === 'number' ? v : 0;
    };
    return { frozenMs: Math.round(num(2) / 100) / 10, pagesWritten: num(7) };
  } catch {
    return { frozenMs: 0, pagesWritten: 0 };
  }
}

/**
 * Waits (bounded) until the sandbox's init leads its own session. It starts
 * in the session of its reaper, outside its pid namespace, and an init
 * (busybox's among them) calls setsid() as it starts; CRIU refuses a tree
 * whose session leader is outside its pid namespace, so a checkpoint taken
 * the instant after a create would fail for that moment alone.
 */
async function ownSession(initPid: number, timeoutMs = 3000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const stat = await readFile(`/proc/${initPid}/stat`, 'utf8').catch(() => '');
    // Fields after the command's closing parenthesis: state, ppid, pgrp, session.
    const session = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[3]);
    if (!stat || session === initPid || Date.now() > deadline) return;
    await new Promise((r) => setTimeout(r, 20));
  }
}

/**
 * Dumps the tree of `initPid` into `dir` (created empty). leaveRunning: a
 * live snapshot (with `freezerDir`, the cgroup the caller already froze: it
 * stays frozen afterwards, so the caller's rootfs copy is of the same
 * instant); else the tree is gone afterwards.
 */
export async function dumpTree(
  criu: CriuFeatures,
  opts: {
    initPid: number;
    dir: string;
    leaveRunning: boolean;
    freezerDir?: string;
    uidBase: number;
    ip: string;
    hostname: string;
    /** The sandbox's empty directory (SandboxHost.emptyDir): binds of it are the masked directories. */
    emptyDir: string;
    lazy?: boolean;
  },
): Promise<DumpResult> {
  await mkdir(opts.dir, { recursive: true, mode: 0o700 });
  await ownSession(opts.initPid);
  const { devices: mounts, empty } = await externalMounts(opts.initPid, opts.emptyDir);
  const mntId = (await readFile(`/proc/${opts.initPid}/fdinfo/1`, 'utf8')).match(/^mnt_id:\s*(\d+)/m)?.[1];
  const { stat } = await import('node:fs/promises');
  const ino = (await stat(`/proc/${opts.initPid}/fd/1`)).ino;
  if (!mntId) throw sandboxFailed('could not read the console descriptor of the sandbox init');
  const consoleId = `file[${Number(mntId).toString(16)}:${ino.toString(16)}]`;
  const meta: CriuMeta = {
    version: 2,
    console_id: consoleId,
    mounts: Object.fromEntries(mounts.map((m) => [mountKey(m.mountpoint), m.source])),
    empty_mounts: empty.map(mountKey),
    uid_base: opts.uidBase,
    ip: opts.ip,
    hostname: opts.hostname,
  };
  criuMetaSchema.parse(meta);
  const argv = [
    criu.path,
    'dump',
    '-t',
    String(opts.initPid),
    '-D',
    opts.dir,
    '-o',
    'dump.log',
    '--tcp-established',
    '--file-locks',
    '--ext-unix-sk',
    '--empty-ns',
    'net',
    '--network-lock',
    'nftables',
    ...[...mounts.map((m) => m.mountpoint), ...empty].flatMap((mp) => ['--external', `mnt[${mp}]:${mountKey(mp)}`]),
    '--external',
    consoleId,
    ...(opts.leaveRunning ? ['--leave-running'] : []),
    ...(opts.freezerDir ? ['--freeze-cgroup', opts.freezerDir] : []),
  ];
  if (opts.lazy) {
    // Loopback only: the page server has no authentication; the agent tunnels it to the one granted target.
    // criu takes no port 0: a port the kernel just handed out (and took back) is free but for a tiny race.
    const port = await freeLoopbackPort();
    // Its log outlives the images directory (the checkpoint writer empties that while the pages are still served).
    const log = `${opts.dir}.lazy-dump.log`;
    const lazyArgv = argv.map((a) => (a === 'dump.log' ? log : a));
    const child = await spawnUntilReady(
      [...lazyArgv, '--lazy-pages', '--address', '127.0.0.1', '--port', String(port)],
      log,
      'criu dump --lazy-pages',
    );
    child.once('exit', (code) => {
      if (code === 0) void rm(log, { force: true });
    });
    return { meta, frozenMs: 0, pagesWritten: 0, pageServer: { child, port } };
  }
  const code = await runCriu(argv, {});
  if (code !== 0) {
    const log = await readFile(join(opts.dir, 'dump.log'), 'utf8').catch(() => '');
    throw criuError('criu dump failed', log);
  }
  return { meta, ...(await dumpStats(opts.dir)) };
}

export interface RestoreTarget {
  /** The overlay root, mounted (in the agent's namespace) for the time of the restore. */
  readonly root: string;
  readonly cgroupProcs: readonly string[];
  readonly veth: string;
  readonly bridge: string;
  readonly mac: string;
  readonly ip: string;
  readonly prefixLen: number;
  readonly gateway: string;
  readonly hostname: string;
  /** Write end of the new console FIFO (launch.ts openConsoleWriter). */
  readonly consoleFd: number;
  /** CRIU's action script: the sandbox helper (fleet-sandbox.c `cmd_criu_hook`), which also detaches `root` once the tree runs. */
  readonly hook: string;
  /** The sandbox's empty directory on this host (SandboxHost.emptyDir), bound over the masked directories. */
  readonly emptyDir: string;
}

/** What pages a lazy restore's memory in (a `criu lazy-pages` daemon): its end, and a way to end it. */
export interface Pager {
  readonly exited: Promise<unknown>;
  kill(): void;
}

/**
 * Restores the tree dumped in `imagesDir` (a checkpoint directory: CRIU's
 * files under MEMORY_FILE_PREFIX) as `target`; answers the host pid of the restored init. The images
 * are read through a scratch directory of hard links, so the checkpoint's
 * files (and their digests) are never touched.
 */
export async function restoreTree(
  criu: CriuFeatures,
  imagesDir: string,
  meta: CriuMeta,
  /** The id block the tree is restored into (the target's, known before the rest of it). */
  uidBase: number,
  /** Awaited once the images and any daemon are ready: the caller mounts the root meanwhile. */
  targetReady: RestoreTarget | Promise<RestoreTarget>,
  scratch: string,
  lazy?: (dir: string) => Promise<Pager | undefined>,
  deadlineMs?: number,
  /** criu's most detailed log (-v4, with timestamps): a retry of a restore that hung. */
  verbose = false,
): Promise<number> {
  let keepScratch = false;
  await rm(scratch, { recursive: true, force: true });
  await mkdir(scratch, { recursive: true, mode: 0o700 });
  // Searchable by the restored tasks (the sandbox's root is not host root): its parent stays closed to host users.
  await chmod(scratch, 0o755);
  try {
    const images = (await readdir(imagesDir)).filter((name) => name.startsWith(MEMORY_FILE_PREFIX) && name !== CRIU_META);
    await eachLimited(images, 8, async (name) => {
      const f = name.slice(MEMORY_FILE_PREFIX.length);
      if (f.startsWith('userns-') && meta.uid_base !== uidBase) {
        await writeFile(join(scratch, f), rewriteUsernsImage(await readFile(join(imagesDir, name)), meta.uid_base, uidBase));
      } else await link(join(imagesDir, name), join(scratch, f));
      // Readable by the restored tasks (a pulled checkpoint's files are 0600); the checkpoint directory stays 0700.
      await chmod(join(scratch, f), 0o644);
    });
    // Lazy: memory comes from a `criu lazy-pages` daemon that reads the images in scratch until every page is in.
    const daemon = lazy ? await lazy(scratch) : undefined;
    let target: RestoreTarget;
    try {
      target = await targetReady;
    } catch (err) {
      daemon?.kill();
      throw err;
    }
    // A restore waits on pages that will never come once the daemon is gone: it must not outlive it.
    const abort = new AbortController();
    void daemon?.exited.then((code) => {
      if (code !== 0) abort.abort();
    });
    const pidfile = join(scratch, 'restored.pid');
    const sameAddress = meta.ip === target.ip;
    const argv = [
      criu.path,
      'restore',
      '-D',
      scratch,
      '-o',
      'restore.log',
      ...(verbose ? ['-v4'] : []),
      '--root',
      target.root,
      '--restore-detached',
      '--pidfile',
      pidfile,
      sameAddress ? '--tcp-established' : '--tcp-close',
      '--file-locks',
      '--ext-unix-sk',
      '--manage-cgroups=ignore',
      '--empty-ns',
      'net',
      '--action-script',
      target.hook,
      ...Object.entries(meta.mounts).flatMap(([key, source]) => ['--external', `mnt[${key}]:${source}`]),
      ...meta.empty_mounts.flatMap((key) => ['--external', `mnt[${key}]:${target.emptyDir}`]),
      '--inherit-fd',
      `fd[3]:${meta.console_id}`,
      ...(daemon ? ['--lazy-pages'] : []),
    ];
    // A restore that never ends (seen now and then on this VM: criu asleep on a futex, waiting for a restored task)
    // is killed at the deadline; the caller removes what it left in the sandbox's cgroups and may try again.
    const deadline = { passed: false };
    const timer =
      deadlineMs === undefined
        ? undefined
        : setTimeout(() => {
            deadline.passed = true;
            abort.abort();
          }, deadlineMs);
    const code = await runCriu(argv, {
      cgroupProcs: target.cgroupProcs,
      fd3: target.consoleFd,
      signal: abort.signal,
      env: {
        FLEET_VETH: target.veth,
        FLEET_BRIDGE: target.bridge,
        FLEET_MAC: target.mac,
        FLEET_IP: target.ip,
        FLEET_PREFIX: String(target.prefixLen),
        FLEET_GW: target.gateway,
        FLEET_ROOT: target.root,
        FLEET_EMPTY_DIR: target.emptyDir,
        FLEET_HOSTNAME: target.hostname,
      },
    }).finally(() => clearTimeout(timer));
    if (code !== 0) {
      daemon?.kill();
      const log = await readFile(join(scratch, 'restore.log'), 'utf8').catch(() => '');
      if (deadline.passed) {
        const daemonLog = daemon ? await readFile(join(scratch, LAZY_LOG), 'utf8').catch(() => '') : '';
        throw new RestoreTimedOut(deadlineMs ?? 0, log, daemonLog);
      }
      throw criuError('criu restore failed', log);
    }
    let pid = 0;
    try {
      pid = Number((await readFile(pidfile, 'utf8')).trim());
      if (!Number.isInteger(pid) || pid <= 0) throw sandboxFailed('criu restore wrote no pid');
      if (daemon) {
        keepScratch = true;
        void daemon.exited.finally(() => rm(scratch, { recursive: true, force: true }).catch(() => undefined));
      }
      return pid;
    } catch (err) {
      // The tree runs: without its daemon its missing pages would fault in as zeros, so it goes too.
      if (pid > 0) sigkill(pid);
      daemon?.kill();
      throw err;
    }
  } finally {
    if (!keepScratch) await rm(scratch, { recursive: true, force: true }).catch(() => undefined);
  }
}
