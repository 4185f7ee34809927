import type { Readable } from 'node:stream';
import type { WebSocket } from '@fastify/websocket';
import { attachStartSchema, clientFrameSchema, execStreamStartSchema, type ExecResult, type ServerFrame } from '@fleet/agent-protocol';
import { AppError, ValidationError } from '@fleet/agent-protocol';
import type { Backend, ProcessHandle } from './backend.js';
import { parse } from './parse.js';

export interface ExecLimits {
  defaultTimeoutMs: number;
  maxTimeoutMs: number;
  outputCapBytes: number;
}

export function effectiveTimeout(requested: number | undefined, limits: ExecLimits): number {
  if (!requested) return limits.defaultTimeoutMs;
  return Math.min(requested, limits.maxTimeoutMs);
}

/** Collects a stream up to `cap` bytes and keeps draining past it, so the guest never blocks on a full pipe. */
function capture(stream: Readable, cap: number): { result: () => { data: Buffer; truncated: boolean } } {
  const chunks: Buffer[] = [];
  let size = 0;
  let truncated = false;
  stream.on('data', (chunk: Buffer) => {
    if (size >= cap) {
      truncated = true;
      return;
    }
    const room = cap - size;
    if (chunk.length > room) {
      chunks.push(chunk.subarray(0, room));
      size = cap;
      truncated = true;
    } else {
      chunks.push(chunk);
      size += chunk.length;
    }
  });
  stream.on('error', () => {});
  return { result: () => ({ data: Buffer.concat(chunks), truncated }) };
}

export interface BufferedExec {
  argv: string[];
  env: Record<string, string>;
  cwd?: string | undefined;
  stdin?: Buffer | undefined;
  timeoutMs: number;
  encoding: 'utf8' | 'base64';
}

/** Runs one command to completion. A non-zero exit and a timeout are results, not errors. */
export async function runBuffered(backend: Backend, name: string, req: BufferedExec, cap: number, abort: AbortSignal): Promise<ExecResult> {
  const started = performance.now();
  const handle = await backend.spawn(name, { argv: req.argv, env: req.env, cwd: req.cwd, stdin: req.stdin !== undefined });
  if (req.stdin !== undefined) {
    handle.stdin.on('error', () => {});
    handle.stdin.end(req.stdin);
  }
  const out = capture(handle.stdout, cap);
  const err = capture(handle.stderr, cap);
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    handle.kill('SIGKILL');
  }, req.timeoutMs);
  const onAbort = () => handle.kill('SIGKILL');
  abort.addEventListener('abort', onAbort, { once: true });
  try {
    const status = await handle.wait();
    const o = out.result();
    const e = err.result();
    return {
      exit_code: status.exitCode ?? -1,
      ...(status.signal ? { signal: status.signal } : {}),
      stdout: o.data.toString(req.encoding),
      stderr: e.data.toString(req.encoding),
      encoding: req.encoding,
      stdout_truncated: o.truncated,
      stderr_truncated: e.truncated,
      timed_out: timedOut,
      duration_ms: Math.round((performance.now() - started) * 100) / 100,
    };
  } finally {
    clearTimeout(timer);
    abort.removeEventListener('abort', onAbort);
  }
}

const START_FRAME_TIMEOUT_MS = 10_000;
// Past this much unsent output the guest's pipe is paused until the client catches up.
const HIGH_WATER = 4 * 1024 * 1024;
// Stdin written while the socket is paused for a full pipe: frames already received still land here.
const STDIN_HARD_CAP = 16 * 1024 * 1024;
// Frames received before the process has started (the start frame and what follows it).
const MAX_EARLY_FRAMES = 256;

function sendFrame(ws: WebSocket, frame: ServerFrame): void {
  if (ws.readyState === ws.OPEN) ws.send(JSON.stringify(frame));
}

function sendError(ws: WebSocket, err: unknown): void {
  const code = err instanceof AppError ? err.code : 'AGENT_ERROR';
  const message = err instanceof AppError && err.status < 500 ? err.message : err instanceof AppError ? err.message : 'internal error';
  sendFrame(ws, { type: 'error', code, message });
  ws.close(1011, code.slice(0, 100));
}

/**
 * One listener from the first moment: frames that arrive while the process
 * is still being spawned (a client may send stdin right behind its start
 * frame, even in the same TCP segment) are queued, never dropped.
 */
class Inbox {
  #queue: Buffer[] = [];
  #waiter: ((d: Buffer | null) => void) | null = null;
  #closed = false;
  #deliver: ((d: Buffer) => void) | null = null;

  constructor(ws: WebSocket) {
    ws.on('message', (data: Buffer) => {
      if (this.#deliver) this.#deliver(data);
      else if (this.#waiter) {
        const w = this.#waiter;
        this.#waiter = null;
        w(data);
      } else if (this.#queue.length >= MAX_EARLY_FRAMES) {
        sendFrame(ws, {
          type: 'error',
          code: 'FRAME_QUEUE_FULL',
          message: `more than ${MAX_EARLY_FRAMES} frames sent before the process started`,
        });
        ws.close(4008, 'FRAME_QUEUE_FULL');
      } else this.#queue.push(data);
    });
    ws.on('close', () => {
      this.#closed = true;
      this.#waiter?.(null);
      this.#waiter = null;
    });
  }

  next(timeoutMs: number): Promise<Buffer | null> {
    const queued = this.#queue.shift();
    if (queued) return Promise.resolve(queued);
    if (this.#closed) return Promise.resolve(null);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.#waiter = null;
        reject(new ValidationError(`send a start frame within ${timeoutMs} ms`));
      }, timeoutMs);
      this.#waiter = (d) => {
        clearTimeout(timer);
        resolve(d);
      };
    });
  }

  /** From now on every frame (queued ones first) goes to `fn`. */
  drainTo(fn: (d: Buffer) => void): void {
    for (const d of this.#queue.splice(0)) fn(d);
    this.#deliver = fn;
  }
}

async function waitForStart(inbox: Inbox): Promise<unknown> {
  const data = await inbox.next(START_FRAME_TIMEOUT_MS);
  if (data === null) throw new ValidationError('closed before the start frame');
  try {
    return JSON.parse(data.toString('utf8'));
  } catch {
    throw new ValidationError('the start frame must be a JSON object');
  }
}

/**
 * One websocket session: a start frame, then stdin/eof/resize/signal frames
 * from the client and stdout/stderr/exit frames from the agent. The process
 * is killed when the socket closes, so a vanished client leaves nothing
 * running.
 */
export async function runSession(
  backend: Backend,
  name: string,
  ws: WebSocket,
  mode: 'exec' | 'attach',
  limits: ExecLimits,
  log: { warn(obj: object, msg: string): void },
): Promise<void> {
  let handle: ProcessHandle;
  let timeoutMs: number | undefined;
  const inbox = new Inbox(ws);
  try {
    const raw = await waitForStart(inbox);
    if (mode === 'exec') {
      const start = parse(execStreamStartSchema, raw, 'exec start frame');
      timeoutMs = effectiveTimeout(start.timeout_ms, limits);
      handle = await backend.spawn(name, { argv: start.argv, env: start.env, cwd: start.cwd, stdin: true });
    } else {
      const start = parse(attachStartSchema, raw, 'attach start frame');
      const argv = start.cmd.length > 0 ? start.cmd : ['/bin/sh', '-l'];
      handle = await backend.spawn(name, {
        argv,
        env: start.tty ? { TERM: 'xterm-256color', ...start.env } : start.env,
        stdin: true,
        ...(start.tty ? { tty: { rows: start.rows, cols: start.cols } } : {}),
      });
    }
  } catch (err) {
    sendError(ws, err);
    return;
  }
  sendFrame(ws, { type: 'started' });

  let exited = false;
  let timedOut = false;
  const timer = timeoutMs
    ? setTimeout(() => {
        timedOut = true;
        handle.kill('SIGKILL');
      }, timeoutMs)
    : undefined;

  // Output: past HIGH_WATER bytes unsent to the client, both pipes are paused (the guest then blocks on a
  // full pipe) until the socket has drained to a quarter of it.
  let outputPaused = false;
  const outputs = [handle.stdout, handle.stderr];
  const pauseOutput = (): void => {
    if (outputPaused) return;
    outputPaused = true;
    for (const o of outputs) o.pause();
    const poll = setInterval(() => {
      if (ws.bufferedAmount > HIGH_WATER / 4 && ws.readyState === ws.OPEN) return;
      clearInterval(poll);
      outputPaused = false;
      for (const o of outputs) o.resume();
    }, 10);
  };
  const pump = (stream: Readable, type: 'stdout' | 'stderr') => {
    stream.on('data', (chunk: Buffer) => {
      sendFrame(ws, { type, data: chunk.toString('base64') });
      if (ws.bufferedAmount > HIGH_WATER) pauseOutput();
    });
    stream.on('error', () => {});
  };
  pump(handle.stdout, 'stdout');
  pump(handle.stderr, 'stderr');
  handle.stdin.on('error', () => {});

  // Input: a process that does not read its stdin stops the socket being read (TCP pushes back to the
  // sender) until the pipe drains; frames still arriving meanwhile are held up to a hard cap.
  let inputPaused = false;
  const resumeInput = (): void => {
    if (!inputPaused) return;
    inputPaused = false;
    handle.stdin.off('drain', resumeInput);
    handle.stdin.off('close', resumeInput);
    if (ws.readyState === ws.OPEN) ws.resume();
  };
  const writeStdin = (data: Buffer): void => {
    if (handle.stdin.destroyed || handle.stdin.writableEnded) return;
    if (handle.stdin.writableLength > STDIN_HARD_CAP) {
      sendFrame(ws, {
        type: 'error',
        code: 'FRAME_QUEUE_FULL',
        message: `more than ${STDIN_HARD_CAP} bytes of stdin are waiting for the process to read them`,
      });
      ws.close(4008, 'FRAME_QUEUE_FULL');
      return;
    }
    if (!handle.stdin.write(data) && !inputPaused) {
      inputPaused = true;
      ws.pause();
      handle.stdin.once('drain', resumeInput);
      handle.stdin.once('close', resumeInput);
    }
  };

  inbox.drainTo((data: Buffer) => {
    let frame;
    try {
      frame = clientFrameSchema.parse(JSON.parse(data.toString('utf8')));
    } catch {
      // A bad frame mid-session is reported, not fatal: the process keeps running.
      sendFrame(ws, { type: 'error', code: 'VALIDATION_FAILED', message: 'frames must be {type: stdin|eof|resize|signal, …}' });
      return;
    }
    switch (frame.type) {
      case 'stdin':
        writeStdin(Buffer.from(frame.data, 'base64'));
        break;
      case 'eof':
        handle.stdin.end();
        break;
      case 'resize':
        handle.resize(frame.rows, frame.cols);
        break;
      case 'signal':
        handle.kill(frame.signal);
        break;
      default: {
        const _exhaustive: never = frame;
      }
    }
  });
  ws.on('close', () => {
    if (!exited) handle.kill('SIGKILL');
  });
  // The client may have gone while the process was being spawned: its 'close' has already fired.
  if (ws.readyState !== ws.OPEN) handle.kill('SIGKILL');

  try {
    const status = await handle.wait();
    exited = true;
    sendFrame(ws, {
      type: 'exit',
      code: status.exitCode ?? -1,
      ...(status.signal ? { signal: status.signal } : {}),
      timed_out: timedOut,
    });
    ws.close(1000);
  } catch (err) {
    exited = true;
    log.warn({ err, sandbox: name }, 'session wait failed');
    sendError(ws, err);
  } finally {
    if (timer) clearTimeout(timer);
  }
}
