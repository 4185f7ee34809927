import { encodeGuestEnv } from '../../native/helper.js';
import { invalidSpec, type ProcessHandle, type SpawnOptions } from '../../backend.js';
import { envKeyRe } from '../spec-rules.js';
import { spawnPiped, spawnPty } from './guest-process.js';
import { enterArgv, type EnterOp } from './launch.js';
import type { SandboxHost } from './sandbox-host.js';
import type { SandboxRecord } from './sandbox-state.js';

const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

/** Linux's MAX_ARG_STRLEN (32 pages), NUL included. */
const MAX_ARG_STRLEN = 32 * 4096;
/** Well under ARG_MAX (a quarter of the 8 MiB default stack), pointers included. */
const MAX_EXEC_BYTES = 1024 * 1024;

/**
 * The helper's exec carries argv and the hex-encoded guest environment (twice
 * the bytes): over the kernel's limits it fails with E2BIG, which is the
 * caller's input, so a 400 naming the limit rather than a failed exec.
 */
function checkExecSize(argv: readonly string[], hostEnv: Record<string, string>): Record<string, string> {
  let total = 0;
  for (const [what, s] of [
    ...argv.map((a) => ['argv', a] as const),
    ...Object.entries(hostEnv).map(([k, v]) => ['env', `${k}=${v}`] as const),
  ]) {
    const bytes = Buffer.byteLength(s) + 1;
    if (bytes > MAX_ARG_STRLEN) {
      throw invalidSpec(
        `an ${what} entry is too long: at most ${what === 'env' ? Math.floor((MAX_ARG_STRLEN - 16) / 2) : MAX_ARG_STRLEN - 1} bytes each`,
        [{ path: what, message: 'entry too long' }],
      );
    }
    total += bytes + 8;
  }
  if (total > MAX_EXEC_BYTES)
    throw invalidSpec(`argv and env together are too large: at most about ${MAX_EXEC_BYTES / 2} bytes of environment`, [
      { path: 'env', message: 'too large' },
    ]);
  return hostEnv;
}

export async function spawnInSandbox(host: SandboxHost, name: string, opts: SpawnOptions): Promise<ProcessHandle> {
  const record = host.must(name);
  if (!Array.isArray(opts.argv) || opts.argv.length === 0 || opts.argv.some((a) => typeof a !== 'string' || a.includes('\0'))) {
    throw invalidSpec('argv must be a non-empty list of strings without NUL bytes', [{ path: 'argv', message: 'invalid argv' }]);
  }
  const env: Record<string, string> = { PATH: DEFAULT_PATH, HOME: '/root', HOSTNAME: name, ...record.state.env, ...(opts.env ?? {}) };
  for (const [k, v] of Object.entries(env)) {
    if (!envKeyRe.test(k) || v.includes('\0'))
      throw invalidSpec(`environment variable "${k}" is invalid`, [{ path: `env.${k}`, message: 'invalid name or value' }]);
  }
  const cwd = opts.cwd ?? '/';
  if (!cwd.startsWith('/') || cwd.includes('\0'))
    throw invalidSpec('cwd must be an absolute guest path', [{ path: 'cwd', message: 'must start with /' }]);
  if (opts.tty) {
    if (env.TERM === undefined) env.TERM = 'xterm-256color';
    const size = { rows: clampSize(opts.tty.rows, 24), cols: clampSize(opts.tty.cols, 80) };
    const argv = await enterSandbox(host, record, { op: 'exec', argv: opts.argv }, cwd, size);
    return spawnPty(argv, checkExecSize(argv, encodeGuestEnv(env)), size, host.opts.pty);
  }
  const argv = await enterSandbox(host, record, { op: 'exec', argv: opts.argv }, cwd);
  const hostEnv = checkExecSize(argv, encodeGuestEnv(env));
  if (host.spawner?.ready) return host.spawner.spawn(argv.slice(1), hostEnv, opts.stdin);
  return spawnPiped(argv, hostEnv, opts.stdin);
}

/** The helper's argv for `op` inside a running sandbox (its host environment is fixed: see spawnPiped). */
export async function enterSandbox(
  host: SandboxHost,
  record: SandboxRecord,
  op: EnterOp,
  cwd = '/',
  winsize?: { rows: number; cols: number },
): Promise<string[]> {
  await host.assertRunning(record);
  const s = record.state;
  return enterArgv({
    initPid: s.init_pid,
    initStart: s.init_start,
    cgroupProcs: host.cgroups.procsFiles(s.name),
    cwd,
    netRaw: s.net_raw,
    ...(winsize ? { winsize } : {}),
    op,
    tools: host.tools,
  });
}

function clampSize(n: number, fallback: number): number {
  return Number.isInteger(n) && n > 0 && n <= 1000 ? n : fallback;
}
