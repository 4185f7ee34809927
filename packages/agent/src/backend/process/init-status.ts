import { constants } from 'node:os';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { InitExit } from '@fleet/agent-protocol';
import { sleep } from './exec-util.js';

/**
 * How a sandbox's init ended, as its parent recorded it: the helper's `start`
 * (fleet-sandbox.c), the reaper, writes `<init host pid> <start ticks> running` into the
 * sandbox directory's init.status, then `exited <code>` or `signaled <signo>`
 * in place of `running`. The reaper outlives the agent, so the record is
 * there after an agent restart. The pid and start time tie it to one init: a
 * sandbox restored in place (a new init without a reaper) never reads the
 * previous init's record.
 */
export const INIT_STATUS_FILE = 'init.status';

const SIGNAL_NAMES = new Map<number, string>(Object.entries(constants.signals).map(([name, n]) => [n, name]));

type Parsed = { readonly pid: number; readonly start: string } & (
  { readonly kind: 'running' } | { readonly kind: 'exited' | 'signaled'; readonly n: number }
);

export function parseInitStatus(text: string): Parsed | undefined {
  const [pid, start, kind, n, ...rest] = text.trim().split(/\s+/);
  if (!pid || !/^\d+$/.test(pid) || !start || !/^\d+$/.test(start) || rest.length > 0) return undefined;
  if (kind === 'running' && n === undefined) return { pid: Number(pid), start, kind };
  if ((kind === 'exited' || kind === 'signaled') && n !== undefined && /^\d{1,3}$/.test(n))
    return { pid: Number(pid), start, kind, n: Number(n) };
  return undefined;
}

export function initExitOf(p: Parsed): InitExit | undefined {
  if (p.kind === 'running') return undefined;
  if (p.kind === 'exited') return { exit_code: p.n };
  return { exit_signal: SIGNAL_NAMES.get(p.n) ?? `SIG${p.n}` };
}

/**
 * The ended init's status, or undefined when there is no record of this init
 * (a sandbox started before the reaper existed, or restored from a
 * checkpoint). Called once the init is gone: a record still `running` is the
 * reaper about to write, waited for up to `waitMs`.
 */
export async function readInitExit(sandboxDir: string, initPid: number, initStart: string, waitMs = 1000): Promise<InitExit | undefined> {
  const deadline = Date.now() + waitMs;
  for (;;) {
    const text = await readFile(join(sandboxDir, INIT_STATUS_FILE), 'utf8').catch(() => null);
    const p = text === null ? undefined : parseInitStatus(text);
    if (!p || p.pid !== initPid || p.start !== initStart) return undefined;
    if (p.kind !== 'running') return initExitOf(p);
    if (Date.now() >= deadline) return undefined;
    await sleep(10);
  }
}
