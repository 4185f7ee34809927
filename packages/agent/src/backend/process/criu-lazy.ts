import { spawn, type ChildProcess } from 'node:child_process';
import { open } from 'node:fs/promises';
import { join } from 'node:path';
import { sandboxFailed } from '../../backend.js';
import { processStartTime } from './exec-util.js';

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
  opts: { detached?: boolean; readyTimeoutMs?: number } = {},
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
    });
    const status = child.stdio[3] as NodeJS.ReadableStream & { unref?: () => void };
    let ready = false;
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(sandboxFailed(`${what} was not ready within ${opts.readyTimeoutMs ?? READY_TIMEOUT_MS} ms`));
    }, opts.readyTimeoutMs ?? READY_TIMEOUT_MS);
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

/** How long a criu daemon or page server may take to say it is ready (it does in milliseconds). */
const READY_TIMEOUT_MS = 10_000;

export async function readErrors(log: string): Promise<string> {
  return (await errorLines(log)).slice(-4).join(' | ') || 'see the criu log';
}

async function errorLines(log: string): Promise<string[]> {
  const text = await readTail(log, 64 * 1024);
  return text.split('\n').filter((l) => /Error/.test(l) && !/RLIMIT_NOFILE/.test(l));
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
 * "zero page at" per zero page, and "UFFD transferred pages" once a task has
 * all of its own. Read incrementally: the log only grows.
 */
class LogProgress {
  private offset = 0;
  private partial = '';
  total = 0;
  resident = 0;
  /** Tasks that registered their userfaultfd, and tasks (forks included) the daemon finished with. */
  tasks = 0;
  completed = 0;

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
        if (m) {
          this.total += Number(m[1]);
          this.tasks += 1;
        } else if (/UFFD transferred pages/.test(l)) this.completed += 1;
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
  const log = join(dir, 'lazy-pages.log');
  const argv = [
    criu.path,
    'lazy-pages',
    '-D',
    dir,
    '-o',
    'lazy-pages.log',
    '-v4',
    ...(pageServer ? ['--page-server', '--address', pageServer.address, '--port', String(pageServer.port)] : []),
  ];
  const child = await spawnUntilReady(argv, log, 'criu lazy-pages', { detached: pageServer === undefined });
  const ended = new Promise<{ code: number | null; how: string }>((resolve) =>
    child.once('exit', (code, signal) => resolve({ code, how: signal ?? String(code) })),
  );
  return watchDaemon(log, ended, () => child.kill('SIGKILL'));
}

/**
 * The daemon of a restore that a previous run of the agent started (it outlives the agent: a restored tree would lose
 * its missing pages with it), found by its pid and start time: its end is seen by polling, and since its exit code
 * is not ours to read, its log says how it ended (an error line, or none).
 */
export function adoptLazyDaemon(pid: number, start: string, dir: string): LazyDaemon {
  const log = join(dir, 'lazy-pages.log');
  const ended = (async () => {
    while ((await processStartTime(pid)) === start) await new Promise((r) => setTimeout(r, 50));
    // Done: no error, and every task that registered was finished with (a daemon killed mid-way leaves some out).
    const seen = new LogProgress(log);
    await seen.poll().catch(() => undefined);
    if ((await errorLines(log)).length > 0) return { code: 1, how: 'errors in its log' };
    if (seen.tasks === 0 || seen.completed < seen.tasks)
      return { code: 1, how: `gone with ${seen.completed} of its ${seen.tasks} tasks' pages all in` };
    return { code: 0, how: 'done' };
  })();
  return watchDaemon(log, ended, () => {
    void processStartTime(pid).then((now) => {
      if (now === start) process.kill(pid, 'SIGKILL');
    });
  });
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
