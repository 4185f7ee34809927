import { spawn, type ChildProcess } from 'node:child_process';
import { connect } from 'node:net';
import { existsSync } from 'node:fs';
import { readFile, readlink } from 'node:fs/promises';
import { constants as osConstants } from 'node:os';
import { PassThrough, Writable } from 'node:stream';
import { featureMissing, invalidSpec, sandboxFailed, type ExitStatus, type ProcessHandle } from '../../backend.js';
import { finished } from 'node:stream/promises';
import { addHostRunner, runTool, type HostRunner, type RunResult } from './exec-util.js';

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
    (m) => (m as { default?: PtyModule }).default ?? m,
    () => null,
  );
  return ptyModule;
}

const signalNames = new Map<number, NodeJS.Signals>(
  Object.entries(osConstants.signals).map(([name, num]) => [num, name as NodeJS.Signals]),
);

export function spawnPiped(argv: readonly string[], hostEnv: Record<string, string>, withStdin: boolean): ProcessHandle {
  const [cmd, ...args] = argv;
  if (cmd === undefined) throw new TypeError('an empty argv names no command');
  const child = spawn(cmd, args, { detached: true, stdio: [withStdin ? 'pipe' : 'ignore', 'pipe', 'pipe'], env: hostEnv });
  const { stdout, stderr } = child;
  if (!stdout || !stderr) throw new TypeError('spawned with piped output, yet no stdout/stderr');
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
    stdout,
    stderr,
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
export async function spawnPty(
  argv: readonly string[],
  hostEnv: Record<string, string>,
  size: { rows: number; cols: number },
  impl: 'auto' | 'script' = 'auto',
): Promise<ProcessHandle> {
  const pty = impl === 'script' ? null : await loadPty();
  if (!pty) return spawnScriptPty(argv, hostEnv);
  const [cmd, ...args] = argv;
  if (cmd === undefined) throw new TypeError('an empty argv names no command');
  const term = pty.spawn(cmd, args, { name: 'xterm-256color', cols: size.cols, rows: size.rows, cwd: '/', env: hostEnv, encoding: null });
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
        term.write(chunk);
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
  if (!existsSync('/usr/bin/script'))
    throw featureMissing('pty', 'a TTY needs node-pty (npm install with build-essential and python3) or script(1) from util-linux');
  // script runs "$SHELL -c command" on the host: a fixed shell and PATH, and only absolute paths in the command (the helper sizes the pty).
  const command = `exec ${argv.map(shq).join(' ')}`;
  // One exec argument for the whole argv: over MAX_ARG_STRLEN the exec would fail with E2BIG.
  if (Buffer.byteLength(command) >= 32 * 4096)
    throw invalidSpec('argv is too long for a TTY through script(1): at most 128 KiB in all', [{ path: 'argv', message: 'too long' }]);
  const child = spawn('/usr/bin/script', ['-q', '-e', '-f', '-c', command, '/dev/null'], {
    detached: true,
    stdio: ['pipe', 'pipe', 'pipe'],
    env: { ...hostEnv, PATH: HOST_PATH, SHELL: '/bin/sh' },
  });
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
        if (tty?.startsWith('/dev/pts/'))
          await runTool('/usr/bin/stty', ['-F', tty, 'rows', String(Math.max(1, rows)), 'cols', String(Math.max(1, cols))]).catch(
            () => undefined,
          );
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

/**
 * The helper's `serve` mode (fleet-sandbox.c): one long-lived process per
 * agent that forks a relay per exec, which runs the helper's `enter` with the
 * same arguments and environment the agent would have spawned it with. Node
 * forking itself for every exec cost most of an exec's time. While it is not
 * running (not yet started, died and being restarted) `ready` is false and
 * callers spawn the helper directly.
 */
export class Spawner implements HostRunner {
  private child: ChildProcess | undefined;
  private closed = false;
  private up = false;

  private constructor(
    private readonly helper: string,
    readonly socketPath: string,
    private readonly onError: (err: Error) => void,
  ) {}

  /** Host tools the spawner may run (`run`), by bare name and by path: fixed at its start. */
  private readonly tools = new Map<string, string>();
  private unregister: () => void = () => undefined;

  /** Starts the spawner and waits for it to listen; null when the socket path is too long for a unix socket. */
  static async start(helper: string, socketPath: string, onError: (err: Error) => void): Promise<Spawner | null> {
    if (Buffer.byteLength(socketPath) >= 100) return null;
    const s = new Spawner(helper, socketPath, onError);
    for (const name of RUNNER_TOOLS) {
      const path = ['/usr/sbin', '/usr/bin', '/sbin', '/bin'].map((d) => `${d}/${name}`).find((p) => existsSync(p));
      if (path) s.tools.set(name, path).set(path, path);
    }
    await s.launch();
    s.unregister = addHostRunner(s);
    return s;
  }

  request(cmd: string, args: readonly string[]): string[] | undefined {
    if (cmd === this.helper) return args[0] === 'mount-root' ? [...args] : undefined;
    const path = this.tools.get(cmd);
    return path === undefined ? undefined : ['run', path, ...args];
  }

  /** A host tool or the helper's mount-root, forked by the spawner; rejects only when it could not be started. */
  run(request: readonly string[], opts: { input?: string; timeoutMs?: number } = {}): Promise<RunResult> {
    return runThrough(this.socketPath, request, opts);
  }

  get ready(): boolean {
    return this.up && !this.closed;
  }

  private launch(): Promise<void> {
    return new Promise((resolve, reject) => {
      const allow = [...new Set(this.tools.values())].flatMap((p) => ['--allow', p]);
      const child = spawn(this.helper, ['serve', this.socketPath, ...allow], { stdio: ['ignore', 'pipe', 'pipe'], env: {} });
      this.child = child;
      let stderr = '';
      child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr = (stderr + d).slice(-500)));
      child.stdout.setEncoding('utf8').once('data', () => {
        this.up = true;
        resolve();
      });
      child.once('error', reject);
      child.once('exit', (code, signal) => {
        const was = this.up;
        this.up = false;
        if (!was) {
          reject(new Error(`the exec spawner exited (${signal ?? code}) before it listened: ${stderr.trim()}`));
          return;
        }
        if (this.closed) return;
        this.onError(new Error(`the exec spawner exited (${signal ?? code}): ${stderr.trim()}; restarting it`));
        this.restart(200);
      });
    });
  }

  /** A failed restart is retried every 5 s; meanwhile execs spawn the helper. */
  private restart(delayMs: number): void {
    setTimeout(() => {
      if (this.closed) return;
      this.launch().catch((err: unknown) => {
        this.onError(err as Error);
        this.restart(5000);
      });
    }, delayMs).unref();
  }

  close(): void {
    this.closed = true;
    this.unregister();
    this.child?.kill('SIGKILL');
  }

  /** `enterArgs`: the helper's argv after its path (`enter …`); `hostEnv`: FLEET_E<n> only (encodeGuestEnv). */
  spawn(enterArgs: readonly string[], hostEnv: Record<string, string>, withStdin: boolean): ProcessHandle {
    return spawnViaSpawner(this.socketPath, enterArgs, hostEnv, withStdin);
  }
}

/** The host tools a spawner runs for runTool: those on a sandbox's create and destroy path. */
const RUNNER_TOOLS = ['ip', 'nft', 'mount', 'umount', 'losetup'];

/** A `run` or `mount-root` through the spawner, collected; rejects only when it could not be started. */
async function runThrough(socketPath: string, args: readonly string[], opts: { input?: string; timeoutMs?: number }): Promise<RunResult> {
  const h = spawnViaSpawner(socketPath, args, {}, true);
  let stdout = '';
  let stderr = '';
  h.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d));
  h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
  const timer = setTimeout(() => h.kill('SIGKILL'), opts.timeoutMs ?? 30_000);
  h.stdin.end(opts.input ?? '');
  try {
    const st = await h.wait();
    await Promise.all([finished(h.stdout), finished(h.stderr)]).catch(() => undefined);
    return { stdout, stderr, code: st.exitCode };
  } finally {
    clearTimeout(timer);
  }
}

/** One exec through a spawner's socket (see Spawner; the protocol is in fleet-sandbox.c). */
export function spawnViaSpawner(
  socketPath: string,
  enterArgs: readonly string[],
  hostEnv: Record<string, string>,
  withStdin: boolean,
): ProcessHandle {
  const strings = [...enterArgs, ...Object.entries(hostEnv).map(([k, v]) => `${k}=${v}`)];
  const body = Buffer.concat([Buffer.alloc(8), ...strings.map((a) => Buffer.from(`${a}\0`, 'utf8'))]);
  body.writeUInt32LE(enterArgs.length, 0);
  body.writeUInt32LE(strings.length - enterArgs.length, 4);
  const head = Buffer.alloc(4);
  head.writeUInt32LE(body.length, 0);

  const sock = connect({ path: socketPath, allowHalfOpen: true });
  sock.write(Buffer.concat([head, body]));
  if (!withStdin) sock.end();
  const stdout = new PassThrough();
  const stderr = new PassThrough();
  let pgid: number | undefined;
  let pendingSignal: NodeJS.Signals | undefined;
  let status: ExitStatus | undefined;
  let gone = false;
  let failure: Error | undefined;
  let settle: ((st: ExitStatus) => void) | undefined;
  const signalGroup = (signal: NodeJS.Signals): void => {
    if (gone || status) return;
    if (pgid === undefined) pendingSignal = signal;
    else killGroup(pgid, signal);
  };
  let buf: Buffer = Buffer.alloc(0);
  const resumeSock = (): void => {
    if (!stdout.writableNeedDrain && !stderr.writableNeedDrain) sock.resume();
  };
  stdout.on('drain', resumeSock);
  stderr.on('drain', resumeSock);
  sock.on('data', (chunk: Buffer) => {
    buf = buf.length === 0 ? chunk : Buffer.concat([buf, chunk]);
    while (buf.length >= 5) {
      const len = buf.readUInt32LE(1);
      if (buf.length < 5 + len) break;
      const type = String.fromCharCode(buf.readUInt8(0));
      const payload = buf.subarray(5, 5 + len);
      buf = buf.subarray(5 + len);
      if (type === 'P') {
        pgid = payload.readUInt32LE(0);
        if (pendingSignal) killGroup(pgid, pendingSignal);
      } else if (type === 'O' || type === 'R') {
        if (!(type === 'O' ? stdout : stderr).write(payload)) sock.pause();
      } else if (type === 'X') {
        const code = payload.readInt32LE(0);
        const sig = payload.readInt32LE(4);
        status = sig ? { exitCode: null, signal: signalNames.get(sig) ?? 'SIGKILL' } : { exitCode: code, signal: null };
        // Every output frame came before the status: the caller has it all now, without waiting for the close.
        stdout.end();
        stderr.end();
        settle?.(status);
        // The relay leaves once this side closes: only now may its pid be reused (status is set: no more signals).
        sock.end();
      }
    }
  });
  // The relay is gone (its status sent, or its group killed): nothing more to send it.
  sock.on('end', () => sock.end());
  sock.on('error', (err) => {
    if (pgid === undefined) failure = err;
  });
  const exited = new Promise<ExitStatus>((resolve, reject) => {
    settle = resolve;
    sock.once('close', () => {
      gone = true;
      if (!stdout.writableEnded) stdout.end();
      if (!stderr.writableEnded) stderr.end();
      if (status) resolve(status);
      else if (failure) reject(sandboxFailed(`could not start the process: ${failure.message}`, {}, failure));
      // The relay died without a status: its group was killed (as a spawned helper's would be).
      else resolve({ exitCode: null, signal: 'SIGKILL' });
    });
  });
  exited.catch(() => undefined);
  const stdin = withStdin
    ? new Writable({
        write(chunk: Buffer, _enc, cb) {
          if (sock.writableEnded || sock.destroyed) {
            cb();
            return;
          }
          sock.write(chunk, () => cb());
        },
        final(cb) {
          if (!sock.writableEnded && !sock.destroyed) sock.end();
          cb();
        },
      })
    : endedWritable();
  stdin.on('error', () => undefined);
  return { stdout, stderr, stdin, resize: () => undefined, kill: (signal = 'SIGKILL') => signalGroup(signal), wait: () => exited };
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
