import { spawn, type ChildProcess } from 'node:child_process';
import { open } from 'node:fs/promises';
import { join } from 'node:path';
import { sandboxFailed } from '../../backend.js';

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
 * the log's errors when it exits first.
 */
export function spawnUntilReady(argv: readonly string[], log: string, what: string): Promise<ChildProcess> {
  return new Promise((resolve, reject) => {
    const [cmd, ...args] = argv;
    if (cmd === undefined) {
      reject(new Error('no command'));
      return;
    }
    const child = spawn(cmd, [...args, '--status-fd', '3'], {
      stdio: ['ignore', 'ignore', 'ignore', 'pipe'],
      env: CRIU_ENV,
    });
    const status = child.stdio[3] as NodeJS.ReadableStream;
    let ready = false;
    status.once('data', () => {
      ready = true;
      resolve(child);
    });
    child.once('error', reject);
    child.once('exit', (code) => {
      if (ready) return;
      void readErrors(log).then((errors) => reject(sandboxFailed(`${what} exited (${String(code)}) before it was ready: ${errors}`)));
    });
  });
}

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
  const child = await spawnUntilReady(argv, log, 'criu lazy-pages');
  const progress = new LogProgress(log);
  let error: string | undefined;
  let finished = false;
  const exited = new Promise<number | null>((resolve) => {
    child.once('exit', (code, signal) => {
      void (async () => {
        await progress.poll().catch(() => undefined);
        finished = true;
        if (code !== 0) error = `criu lazy-pages ended (${signal ?? String(code)}): ${await readErrors(log)}`;
        resolve(code);
      })();
    });
  });
  return {
    exited,
    kill: () => {
      if (!finished) child.kill('SIGKILL');
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
