import { spawn, type ChildProcess } from 'node:child_process';
import { open, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { sandboxFailed } from '../../backend.js';
import { processStartTime, processStartTimeSync, sigkill } from './exec-util.js';

/*
 * Post-copy ("lazy") restore with CRIU: `criu lazy-pages` owns the restored
 * tasks' userfaultfds and fills each missing page on first touch, from the
 * images in its directory or from a page server; then it pushes the rest in
 * the background and exits 0 once every page is resident.
 */

/** The seed's MemoryStatus: chunks are 4 KiB pages. */
export interface MemoryStatus {
  readonly resident_chunks: number;
  readonly total_chunks: number;
  readonly done: boolean;
  readonly error?: string;
}

export interface LazyDaemon {
  /** Settles when the daemon is gone (exit code, null when killed). */
  readonly exited: Promise<number | null>;
  status(): Promise<MemoryStatus>;
  kill(): void;
}

/**
 * CRIU's switch (a "fault" number, the only one 4.1.1 has) for curing its
 * parasite without a hardware breakpoint: compel steps the task to its
 * rt_sigreturn with PTRACE_SYSCALL instead. On this host's virtual machine
 * the breakpoint is sometimes never hit: a dump then hung for good in
 * parasite_fini_seized ("Waiting for <init> to trap", the task already back
 * in its own code), twice in two runs of the memory bench on 2026-12-04,
 * and never in the runs with this set.
 */
export const CRIU_ENV = { PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin', CRIU_FAULT: '130' };

/**
 * Spawns `criu ... --status-fd 3` and answers once CRIU has written its
 * ready byte (the daemon listens, or the page server serves); rejects with
 * the log's errors when it exits first, and kills it when it is not ready
 * in time. `detached`: a process group and session of its own, not held by
 * the agent's event loop, so it outlives the agent (a Ctrl-C or the agent's
 * exit does not reach it).
 */
export function spawnUntilReady(
  argv: readonly string[],
  log: string,
  what: string,
  opts: { detached?: boolean; readyTimeoutMs?: number; cwd?: string } = {},
): Promise<ChildProcess> {
  return new Promise((resolve, reject) => {
    const [cmd, ...args] = argv;
    if (cmd === undefined) {
      reject(new Error('no command'));
      return;
    }
    const child = spawn(cmd, [...args, '--status-fd', '3'], {
      stdio: ['ignore', 'ignore', 'ignore', 'pipe'],
      env: CRIU_ENV,
      detached: opts.detached === true,
      ...(opts.cwd ? { cwd: opts.cwd } : {}),
    });
    const status = child.stdio[3] as NodeJS.ReadableStream & { unref?: () => void };
    let ready = false;
    // Only where readiness is quick (a daemon that listens): a dump's page server is ready once its dump is written.
    const timer =
      opts.readyTimeoutMs === undefined
        ? undefined
        : setTimeout(() => {
            if (opts.detached && child.pid !== undefined) sigkill(-child.pid);
            else child.kill('SIGKILL');
            reject(sandboxFailed(`${what} was not ready within ${opts.readyTimeoutMs} ms`));
          }, opts.readyTimeoutMs);
    status.once('data', () => {
      ready = true;
      clearTimeout(timer);
      if (opts.detached) {
        child.unref();
        status.unref?.();
      }
      resolve(child);
    });
    child.once('error', (err) => {
      clearTimeout(timer);
      reject(err);
    });
    child.once('exit', (code) => {
      clearTimeout(timer);
      if (ready) return;
      void readErrors(log).then((errors) => reject(sandboxFailed(`${what} exited (${String(code)}) before it was ready: ${errors}`)));
    });
  });
}

/** How long a lazy-pages daemon may take to say it listens (it does in milliseconds). */
const DAEMON_READY_MS = 10_000;

/** The daemon's log, in its images directory: its progress, and its errors. */
export const LAZY_LOG = 'lazy-pages.log';

/**
 * The file a local daemon's shell writes criu's exit status to when it ends: how a later run of the agent, which
 * adopts a daemon it did not start, learns how it ended.
 */
export const LAZY_EXIT_FILE = 'lazy-pages.exit';

export async function readErrors(log: string): Promise<string> {
  const text = await readTail(log, 64 * 1024);
  return (
    text
      .split('\n')
      .filter((l) => /Error/.test(l) && !/RLIMIT_NOFILE/.test(l))
      .slice(-4)
      .join(' | ') || 'see the criu log'
  );
}

async function readTail(path: string, bytes: number): Promise<string> {
  const fh = await open(path, 'r').catch(() => null);
  if (!fh) return '';
  try {
    const { size } = await fh.stat();
    const start = Math.max(0, size - bytes);
    const buf = Buffer.alloc(size - start);
    await fh.read(buf, 0, buf.length, start);
    return buf.toString('utf8');
  } finally {
    await fh.close();
  }
}

/**
 * Progress from the daemon's log (-v4): "Found N pages to be handled by
 * UFFD" once per task, then one "uffd_copy: addr/len" per filled run and
 * "zero page at" per zero page. Read incrementally: the log only grows.
 */
class LogProgress {
  private offset = 0;
  private partial = '';
  total = 0;
  resident = 0;

  constructor(private readonly path: string) {}

  async poll(): Promise<void> {
    const fh = await open(this.path, 'r').catch(() => null);
    if (!fh) return;
    try {
      const { size } = await fh.stat();
      if (size <= this.offset) return;
      const buf = Buffer.alloc(size - this.offset);
      await fh.read(buf, 0, buf.length, this.offset);
      this.offset = size;
      const lines = (this.partial + buf.toString('utf8')).split('\n');
      this.partial = lines.pop() ?? '';
      for (const l of lines) {
        let m = /Found (\d+) pages to be handled by UFFD/.exec(l);
        if (m) this.total += Number(m[1]);
        else if ((m = /uffd_copy: 0x[0-9a-f]+\/(\d+)/.exec(l))) this.resident += Math.ceil(Number(m[1]) / 4096);
        else if (/zero page at 0x/.test(l)) this.resident += 1;
      }
    } finally {
      await fh.close();
    }
  }
}

/**
 * Starts `criu lazy-pages` over `dir` (where the restore's images are and
 * its unix socket will be): with `pageServer`, pages come from that address
 * (the source's `criu dump --lazy-pages`), else from the local images.
 */
export async function startLazyDaemon(
  criu: { readonly path: string },
  dir: string,
  pageServer?: { readonly address: string; readonly port: number },
): Promise<LazyDaemon> {
  // Paging from the local images, it must outlive the agent: its restored tree would lose its missing pages with it
  // (a restarted agent adopts it: adoptLazyDaemon). From a page server it ends with the agent's tunnel anyway.
  const log = join(dir, LAZY_LOG);
  const argv = [
    criu.path,
    'lazy-pages',
    '-D',
    dir,
    '-o',
    LAZY_LOG,
    '-v4',
    ...(pageServer ? ['--page-server', '--address', pageServer.address, '--port', String(pageServer.port)] : []),
  ];
  // Local: under a shell of its own session that records criu's exit status beside its log (LAZY_EXIT_FILE).
  const script = `c=0; "$0" "$@" || c=$?; echo $c > ${LAZY_EXIT_FILE}; exit $c`;
  const child = pageServer
    ? await spawnUntilReady(argv, log, 'criu lazy-pages', { readyTimeoutMs: DAEMON_READY_MS })
    : await spawnUntilReady(['/bin/sh', '-c', script, ...argv], log, 'criu lazy-pages', {
        detached: true,
        cwd: dir,
        readyTimeoutMs: DAEMON_READY_MS,
      });
  const ended = new Promise<{ code: number | null; how: string }>((resolve) =>
    child.once('exit', (code, signal) => resolve({ code, how: signal ?? String(code) })),
  );
  const pid = child.pid;
  return watchDaemon(log, ended, () => {
    if (pageServer) child.kill('SIGKILL');
    else if (pid !== undefined) sigkill(-pid);
  });
}

/**
 * The daemon of a restore that a previous run of the agent started (it outlives the agent: a restored tree would lose
 * its missing pages with it), found by its pid and start time: its end is seen by polling, and since its exit code
 * is not ours to read, the status its shell recorded says how it ended (lazyExitStatus).
 */
export function adoptLazyDaemon(pid: number, start: string, dir: string): LazyDaemon {
  const log = join(dir, LAZY_LOG);
  const ended = (async () => {
    // Unref'd: a closed backend does not wait for a daemon it merely watches.
    while ((await processStartTime(pid)) === start) await new Promise((r) => setTimeout(r, 50).unref());
    return lazyExitStatus(dir);
  })();
  return watchDaemon(log, ended, () => {
    if (processStartTimeSync(pid) === start) sigkill(pid);
  });
}

/**
 * How a local daemon that is gone ended, from the status its shell wrote (LAZY_EXIT_FILE; given a moment, as the
 * shell writes it right after criu exits): no file means the shell was killed with it.
 */
export async function lazyExitStatus(dir: string): Promise<{ code: number | null; how: string }> {
  for (let i = 0; i < 20; i++) {
    const text = await readFile(join(dir, LAZY_EXIT_FILE), 'utf8').catch(() => null);
    if (text !== null && /^\d+\n?$/.test(text)) return { code: Number(text.trim()), how: `exit status ${text.trim()}` };
    await new Promise((r) => setTimeout(r, 50));
  }
  return { code: null, how: 'killed: no exit status was written' };
}

function watchDaemon(log: string, ended: Promise<{ code: number | null; how: string }>, kill: () => void): LazyDaemon {
  const progress = new LogProgress(log);
  let error: string | undefined;
  let finished = false;
  const exited = ended.then(async ({ code, how }) => {
    await progress.poll().catch(() => undefined);
    finished = true;
    if (code !== 0) error = `criu lazy-pages ended (${how}): ${await readErrors(log)}`;
    return code;
  });
  return {
    exited,
    kill: () => {
      if (!finished) kill();
    },
    status: async () => {
      if (!finished) await progress.poll().catch(() => undefined);
      const done = finished && error === undefined;
      return {
        resident_chunks: done ? progress.total : Math.min(progress.resident, progress.total),
        total_chunks: progress.total,
        done,
        ...(error !== undefined ? { error } : {}),
      };
    },
  };
}
