import { constants } from 'node:os';
import { createConnection, type Socket } from 'node:net';
import { PassThrough, Writable } from 'node:stream';
import type { ExitStatus, ProcessHandle, SpawnOptions } from '../../backend.js';

/**
 * The host half of the in-guest agent's protocol (guest/fleet-guest-agent.c):
 * one TCP connection to the guest's address per process, authenticated by
 * the per-VM token the seed carried. Frames are type (1 byte) + big-endian
 * length (4 bytes) + payload.
 */

export interface GuestTarget {
  readonly host: string;
  readonly port: number;
  readonly token: string;
}

const MAX_FRAME = 1 << 20;
/** After a SIGKILL frame, how long the exit frame may take before the connection is dropped. */
const KILL_GRACE_MS = 5_000;

function frame(type: string, payload: Buffer | string = Buffer.alloc(0)): Buffer {
  const body = typeof payload === 'string' ? Buffer.from(payload) : payload;
  const hdr = Buffer.alloc(5);
  hdr.write(type, 0, 'latin1');
  hdr.writeUInt32BE(body.length, 1);
  return Buffer.concat([hdr, body]);
}

export function encodeExecRequest(opts: {
  argv: readonly string[];
  env: Readonly<Record<string, string>>;
  cwd: string;
  tty?: { rows: number; cols: number } | undefined;
  stdin: boolean;
}): Buffer {
  const env = Object.entries(opts.env).map(([k, v]) => `${k}=${v}`);
  const fields = [
    String(opts.argv.length),
    ...opts.argv,
    String(env.length),
    ...env,
    opts.cwd,
    opts.tty ? '1' : '0',
    String(opts.tty?.rows ?? 0),
    String(opts.tty?.cols ?? 0),
    opts.stdin ? '1' : '0',
  ];
  if (fields.some((f) => f.includes('\0'))) throw new Error('argv, env and cwd must not contain NUL bytes');
  return Buffer.from(fields.map((f) => `${f}\0`).join(''));
}

function connect(target: GuestTarget, timeoutMs: number): Promise<Socket> {
  return new Promise((resolve, reject) => {
    const sock = createConnection({ host: target.host, port: target.port, noDelay: true });
    const timer = setTimeout(() => {
      sock.destroy();
      reject(new Error(`connecting to the in-guest agent at ${target.host}:${target.port} timed out`));
    }, timeoutMs);
    sock.once('connect', () => {
      clearTimeout(timer);
      sock.off('error', reject);
      resolve(sock);
    });
    sock.once('error', (err) => {
      clearTimeout(timer);
      reject(err);
    });
  });
}

/** Starts one guest process; resolves once the request is sent (the guest agent answers only with output and the exit frame). */
export async function guestSpawn(
  target: GuestTarget,
  opts: SpawnOptions & { env: Readonly<Record<string, string>> },
  connectTimeoutMs = 10_000,
): Promise<ProcessHandle> {
  const request = encodeExecRequest({ argv: opts.argv, env: opts.env, cwd: opts.cwd ?? '/', tty: opts.tty, stdin: opts.stdin });
  const sock = await connect(target, connectTimeoutMs);
  sock.write(frame('A', target.token));
  sock.write(frame('X', request));

  const stdout = new PassThrough();
  const stderr = new PassThrough();
  let exit: ExitStatus | undefined;
  let settle!: (s: ExitStatus) => void;
  const exited = new Promise<ExitStatus>((resolve) => (settle = resolve));
  let buf: Buffer = Buffer.alloc(0);
  const push = (stream: PassThrough, data: Buffer): void => {
    if (!stream.write(data)) {
      sock.pause();
      stream.once('drain', () => sock.resume());
    }
  };
  sock.on('data', (chunk: Buffer) => {
    buf = buf.length ? Buffer.concat([buf, chunk]) : chunk;
    while (buf.length >= 5) {
      const len = buf.readUInt32BE(1);
      if (len > MAX_FRAME) {
        sock.destroy(new Error('in-guest agent sent an oversized frame'));
        return;
      }
      if (buf.length < 5 + len) break;
      const type = String.fromCharCode(buf.readUInt8(0));
      const payload = buf.subarray(5, 5 + len);
      buf = buf.subarray(5 + len);
      if (type === 'O') push(stdout, payload);
      else if (type === 'e') push(stderr, payload);
      else if (type === 'Z') {
        const [code, sig] = payload.toString().split(' ').map(Number);
        const signal = sig ? ((Object.entries(constants.signals).find(([, n]) => n === sig)?.[0] ?? 'SIGKILL') as NodeJS.Signals) : null;
        exit = { exitCode: signal ? null : (code ?? null), signal };
        sock.end();
      }
    }
  });
  const finish = (): void => {
    stdout.end();
    stderr.end();
    // The connection went away without an exit frame: the VM stopped or the guest agent died under the process.
    settle(exit ?? { exitCode: null, signal: 'SIGKILL' });
  };
  sock.on('close', finish);
  sock.on('error', () => undefined);

  const stdin = new Writable({
    write(chunk: Buffer, _enc, cb) {
      if (sock.destroyed) {
        cb();
        return;
      }
      // The guest agent takes at most MAX_FRAME per frame.
      for (let off = 0; off < chunk.length; off += MAX_FRAME) sock.write(frame('I', chunk.subarray(off, off + MAX_FRAME)));
      if (sock.writableNeedDrain) sock.once('drain', () => cb());
      else cb();
    },
    final(cb) {
      if (!sock.destroyed) sock.write(frame('E'));
      cb();
    },
  });
  stdin.on('error', () => undefined);
  if (!opts.stdin) stdin.end();

  return {
    stdout,
    stderr,
    stdin,
    resize(rows: number, cols: number) {
      if (opts.tty && !sock.destroyed) sock.write(frame('R', `${rows} ${cols}`));
    },
    kill(signal: NodeJS.Signals = 'SIGKILL') {
      if (sock.destroyed) return;
      sock.write(frame('S', String(constants.signals[signal])));
      // A guest that cannot take the signal (hung, or its agent stuck) must not hold the caller: hang up, which
      // the guest agent answers by killing the process group once it reads again.
      if (signal === 'SIGKILL') setTimeout(() => sock.destroy(), KILL_GRACE_MS).unref();
    },
    async wait() {
      const status = await exited;
      await Promise.all([ended(stdout), ended(stderr)]);
      return status;
    },
  };
}

function ended(stream: PassThrough): Promise<void> {
  if (stream.readableEnded) return Promise.resolve();
  return new Promise((resolve) => {
    stream.once('end', resolve);
    stream.once('close', resolve);
    // Nobody reads it: let it flow so 'end' can fire.
    if (stream.listenerCount('data') === 0 && !stream.readableFlowing) stream.resume();
  });
}

/** Runs a command to completion, collecting its output (for the backend's own use: file checks, probes). */
export async function guestRun(
  target: GuestTarget,
  argv: readonly string[],
  opts: { input?: Buffer; timeoutMs?: number; connectTimeoutMs?: number } = {},
): Promise<{ code: number | null; stdout: Buffer; stderr: Buffer }> {
  const h = await guestSpawn(
    target,
    { argv, env: { PATH: '/usr/sbin:/usr/bin:/sbin:/bin' }, stdin: opts.input !== undefined },
    opts.connectTimeoutMs,
  );
  const out: Buffer[] = [];
  const err: Buffer[] = [];
  h.stdout.on('data', (d: Buffer) => out.push(d));
  h.stderr.on('data', (d: Buffer) => err.push(d));
  if (opts.input !== undefined) h.stdin.end(opts.input);
  const timer = setTimeout(() => h.kill('SIGKILL'), opts.timeoutMs ?? 30_000);
  try {
    const st = await h.wait();
    return { code: st.exitCode, stdout: Buffer.concat(out), stderr: Buffer.concat(err) };
  } finally {
    clearTimeout(timer);
  }
}
