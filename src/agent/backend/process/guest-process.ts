import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { readFile, readlink } from 'node:fs/promises';
import { constants as osConstants } from 'node:os';
import { PassThrough, Writable } from 'node:stream';
import { featureMissing, invalidSpec, sandboxFailed, type ExitStatus, type ProcessHandle } from '../../backend.js';
import { runTool } from './exec-util.js';

/**
 * A process running inside a sandbox, seen from the host. The argv is the
 * helper's (launch.ts enterArgv), started in its own process group, so
 * kill() reaches the helper and the guest process together; the helper
 * re-raises its child's fatal signal, so the exit status is the guest's.
 * `hostEnv` is the whole environment of the host-side process: fixed
 * values and the hex-encoded guest environment (encodeGuestEnv), never a
 * tenant's variable as such.
 */

type PtyModule = typeof import('node-pty');
let ptyModule: Promise<PtyModule | null> | undefined;

/** node-pty is an optional dependency (native build): without it a TTY spawn is HOST_FEATURE_MISSING. */
function loadPty(): Promise<PtyModule | null> {
  ptyModule ??= import('node-pty').then(
    (m) => ((m as { default?: PtyModule }).default ?? m) as PtyModule,
    () => null,
  );
  return ptyModule;
}

const signalNames = new Map<number, NodeJS.Signals>(
  Object.entries(osConstants.signals).map(([name, num]) => [num, name as NodeJS.Signals]),
);

export function spawnPiped(argv: readonly string[], hostEnv: Record<string, string>, withStdin: boolean): ProcessHandle {
  const [cmd, ...args] = argv;
  const child = spawn(cmd!, args, { detached: true, stdio: [withStdin ? 'pipe' : 'ignore', 'pipe', 'pipe'], env: hostEnv });
  const stdin = child.stdin ?? endedWritable();
  stdin.on('error', () => undefined);
  const exited = new Promise<ExitStatus>((resolve, reject) => {
    child.once('error', (err) => reject(sandboxFailed(`could not start the process: ${err.message}`, {}, err)));
    child.once('close', (code, signal) => resolve({ exitCode: code, signal }));
  });
  exited.catch(() => undefined);
  // 'close' waits for EOF on the pipes, and a guest process that left the group (setsid) can hold them open
  // for ever: once the helper is gone and a kill was asked for (a timeout, a client gone), stop waiting.
  let gone = false;
  let killed = false;
  const letGo = (): void => {
    if (!gone || !killed) return;
    setTimeout(() => {
      for (const s of [child.stdout, child.stderr, child.stdin]) s?.destroy();
    }, 200).unref();
  };
  child.once('exit', () => {
    gone = true;
    letGo();
  });
  return {
    stdout: child.stdout!,
    stderr: child.stderr!,
    stdin,
    resize: () => undefined,
    kill: (signal = 'SIGKILL') => {
      killGroup(child.pid, signal);
      if (signal === 'SIGKILL' && !killed) {
        killed = true;
        letGo();
      }
    },
    wait: () => exited,
  };
}

/**
 * A TTY process: node-pty when it is installed (an optional native module),
 * else script(1) from util-linux, which makes the pty itself. With script,
 * resizes go through `stty -F` on the pty's slave, which makes the kernel
 * signal SIGWINCH to the foreground process exactly as a terminal would.
 */
export async function spawnPty(argv: readonly string[], hostEnv: Record<string, string>, size: { rows: number; cols: number }, impl: 'auto' | 'script' = 'auto'): Promise<ProcessHandle> {
  const pty = impl === 'script' ? null : await loadPty();
  if (!pty) return spawnScriptPty(argv, hostEnv);
  const [cmd, ...args] = argv;
  const term = pty.spawn(cmd!, args, { name: 'xterm-256color', cols: size.cols, rows: size.rows, cwd: '/', env: hostEnv, encoding: null } as Parameters<PtyModule['spawn']>[2]);
  const stdout = new PassThrough();
  const stderr = new PassThrough();
  stderr.end();
  // The pty is paused while its reader is behind (the session pauses `stdout`), or the PassThrough grows without end.
  stdout.on('drain', () => term.resume());
  term.onData((d: string | Buffer) => {
    if (!stdout.write(typeof d === 'string' ? Buffer.from(d, 'utf8') : d)) term.pause();
  });
  const exited = new Promise<ExitStatus>((resolve) => {
    term.onExit(({ exitCode, signal }) => {
      // Let the last output drain from the pty before ending the stream.
      setTimeout(() => {
        stdout.end();
        resolve(signal ? { exitCode: null, signal: signalNames.get(signal) ?? 'SIGKILL' } : { exitCode, signal: null });
      }, 20);
    });
  });
  const stdin = new Writable({
    write(chunk: Buffer, _enc, cb) {
      try {
        term.write(chunk as unknown as string);
        cb();
      } catch (err) {
        cb(err as Error);
      }
    },
  });
  stdin.on('error', () => undefined);
  return {
    stdout,
    stderr,
    stdin,
    resize: (rows, cols) => {
      try {
        term.resize(Math.max(1, cols), Math.max(1, rows));
      } catch {
        /* exited */
      }
    },
    kill: (signal = 'SIGKILL') => killGroup(term.pid, signal),
    wait: () => exited,
  };
}

const HOST_PATH = '/usr/sbin:/usr/bin:/sbin:/bin';
const shq = (a: string): string => `'${a.replace(/'/g, `'\\''`)}'`;

function spawnScriptPty(argv: readonly string[], hostEnv: Record<string, string>): ProcessHandle {
  if (!existsSync('/usr/bin/script')) throw featureMissing('pty', 'a TTY needs node-pty (npm install with build-essential and python3) or script(1) from util-linux');
  // script runs "$SHELL -c command" on the host: a fixed shell and PATH, and only absolute paths in the command (the helper sizes the pty).
  const command = `exec ${argv.map(shq).join(' ')}`;
  // One exec argument for the whole argv: over MAX_ARG_STRLEN the exec would fail with E2BIG.
  if (Buffer.byteLength(command) >= 32 * 4096) throw invalidSpec('argv is too long for a TTY through script(1): at most 128 KiB in all', [{ path: 'argv', message: 'too long' }]);
  const child = spawn('/usr/bin/script', ['-q', '-e', '-f', '-c', command, '/dev/null'], { detached: true, stdio: ['pipe', 'pipe', 'pipe'], env: { ...hostEnv, PATH: HOST_PATH, SHELL: '/bin/sh' } });
  child.stdin.on('error', () => undefined);
  const exited = new Promise<ExitStatus>((resolve, reject) => {
    child.once('error', (err) => reject(sandboxFailed(`could not start script(1): ${err.message}`, {}, err)));
    child.once('close', (code, signal) => resolve({ exitCode: code, signal }));
  });
  exited.catch(() => undefined);
  // The process inside the pty leads its own session: find it through script's children.
  const inner = async (): Promise<number | null> => {
    const text = await readFile(`/proc/${child.pid}/task/${child.pid}/children`, 'utf8').catch(() => '');
    const pid = Number(text.trim().split(/\s+/)[0]);
    return Number.isInteger(pid) && pid > 0 ? pid : null;
  };
  return {
    stdout: child.stdout,
    stderr: child.stderr,
    stdin: child.stdin,
    resize: (rows, cols) => {
      void (async () => {
        const pid = await inner();
        if (!pid) return;
        const tty = await readlink(`/proc/${pid}/fd/0`).catch(() => null);
        if (tty?.startsWith('/dev/pts/')) await runTool('/usr/bin/stty', ['-F', tty, 'rows', String(Math.max(1, rows)), 'cols', String(Math.max(1, cols))]).catch(() => undefined);
      })();
    },
    kill: (signal = 'SIGKILL') => {
      void inner().then((pid) => {
        if (pid) killGroup(pid, signal);
        killGroup(child.pid, signal);
      });
    },
    wait: () => exited,
  };
}

function killGroup(pid: number | undefined, signal: NodeJS.Signals): void {
  if (pid === undefined) return;
  try {
    process.kill(-pid, signal);
  } catch {
    try {
      process.kill(pid, signal);
    } catch {
      /* already gone */
    }
  }
}

function endedWritable(): Writable {
  const w = new Writable({ write: (_c, _e, cb) => cb() });
  w.end();
  return w;
}
