import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { sandboxFailed } from '../../backend.js';

export interface RunResult {
  readonly stdout: string;
  readonly stderr: string;
  readonly code: number | null;
}

/**
 * A long-lived small process that forks host tools for the agent (the
 * helper's `serve`: guest-process.ts Spawner), so a tool costs a fork of that
 * process instead of a fork of Node (6-7 ms here, and a stall of the agent's
 * event loop, against about 3 ms).
 */
export interface HostRunner {
  readonly ready: boolean;
  /** The runner's request for `cmd args` (a bare name or a path), or undefined when it does not run that. */
  request(cmd: string, args: readonly string[]): string[] | undefined;
  /** Rejects only when the request could not be started (then nothing ran). */
  run(request: readonly string[], opts: { input?: string; timeoutMs?: number }): Promise<RunResult>;
}

const runners = new Set<HostRunner>();

/** Registers a runner runTool may use (several backends in one process: any ready one does). */
export function addHostRunner(r: HostRunner): () => void {
  runners.add(r);
  return () => void runners.delete(r);
}

/**
 * Runs a host tool with a bounded time; never throws for a non-zero exit.
 * A tool a ready runner allows (ip, nft, mount, …, resolved in the fixed
 * /usr/sbin:/usr/bin:/sbin:/bin, not the agent's PATH; and the helper's
 * mount-root) goes through it, with the same fixed environment; anything
 * else, an explicit env, or a runner that cannot start it is spawned by Node
 * as before.
 */
export async function runTool(
  cmd: string,
  args: readonly string[],
  opts: { input?: string; timeoutMs?: number; env?: NodeJS.ProcessEnv } = {},
): Promise<RunResult> {
  if (opts.env === undefined) {
    for (const r of runners) {
      const request = r.ready ? r.request(cmd, args) : undefined;
      if (request === undefined) continue;
      try {
        return await r.run(request, opts);
      } catch {
        break; // not started (the runner died or is restarting): spawned below
      }
    }
  }
  return spawnTool(cmd, args, opts);
}

function spawnTool(
  cmd: string,
  args: readonly string[],
  opts: { input?: string; timeoutMs?: number; env?: NodeJS.ProcessEnv },
): Promise<RunResult> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: opts.env ?? { PATH: process.env.PATH ?? '/usr/sbin:/usr/bin:/sbin:/bin' },
    });
    let stdout = '';
    let stderr = '';
    child.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d));
    child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), opts.timeoutMs ?? 30_000);
    child.on('error', (err) => {
      clearTimeout(timer);
      reject(err);
    });
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ stdout, stderr, code });
    });
    child.stdin.on('error', () => undefined);
    child.stdin.end(opts.input ?? '');
  });
}

/** Runs a host tool and throws SANDBOX_FAILED (naming the tool and its stderr) on failure. */
export async function mustRun(cmd: string, args: readonly string[], opts: { input?: string; timeoutMs?: number } = {}): Promise<string> {
  let res: RunResult;
  try {
    res = await runTool(cmd, args, opts);
  } catch (err) {
    throw sandboxFailed(`could not run ${cmd}: ${(err as Error).message}`, { cmd }, err);
  }
  if (res.code !== 0) {
    throw sandboxFailed(`${cmd} ${args.slice(0, 4).join(' ')} failed (exit ${res.code}): ${res.stderr.trim().slice(0, 500)}`, { cmd });
  }
  return res.stdout;
}

/** Serializes async work per key (a sandbox name, a bridge). */
export class KeyedMutex {
  private readonly tails = new Map<string, Promise<unknown>>();

  async run<T>(key: string, fn: () => Promise<T>): Promise<T> {
    const prev = this.tails.get(key) ?? Promise.resolve();
    const next = prev.then(fn, fn);
    const tail = next.catch(() => undefined);
    this.tails.set(key, tail);
    try {
      return await next;
    } finally {
      if (this.tails.get(key) === tail) this.tails.delete(key);
    }
  }
}

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/**
 * `fn` over `items`, at most `limit` at a time (a checkpoint's fifty-odd files: the thread pool has four threads, and
 * other sandboxes' file work waits behind them); every call started has settled before it answers, and it rejects
 * with the first failure (so a caller's cleanup never races calls still in flight).
 */
export async function eachLimited<T, R>(items: readonly T[], limit: number, fn: (item: T) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array<R>(items.length);
  let next = 0;
  let failed: { err: unknown } | undefined;
  const worker = async (): Promise<void> => {
    while (failed === undefined && next < items.length) {
      const i = next++;
      try {
        out[i] = await fn(items[i] as T);
      } catch (err) {
        failed ??= { err };
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  if (failed) throw failed.err;
  return out;
}

/** Start time (clock ticks since boot) of a pid, or null if it is gone: guards against pid reuse. */
export async function processStartTime(pid: number): Promise<string | null> {
  if (!Number.isInteger(pid) || pid <= 0) return null;
  return startTimeOf(await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => null));
}

/** processStartTime, for a caller that cannot wait (an agent closing). */
export function processStartTimeSync(pid: number): string | null {
  if (!Number.isInteger(pid) || pid <= 0) return null;
  try {
    return startTimeOf(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return null;
  }
}

function startTimeOf(stat: string | null): string | null {
  if (stat === null) return null;
  // comm may contain spaces and parens: fields are counted after the last ')'.
  const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  if (rest[0] === 'Z' || rest[0] === 'X') return null;
  return rest[19] ?? null;
}

/** SIGKILL to a pid (a negative one: its process group) that may be gone already. */
export function sigkill(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    /* gone */
  }
}
