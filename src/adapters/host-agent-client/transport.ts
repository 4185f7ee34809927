import WebSocket from 'ws';
import type { z } from 'zod';
import { AGENT_API_PREFIX, type ClientFrame, type ServerFrame, errorBodySchema, serverFrameSchema, AppError } from '@fleet/agent-protocol';
import {
  HostAgentError,
  HostUnreachableError,
  type AgentStream,
  type CallOptions,
  type HostAgentEndpoint,
  type StreamOptions,
} from '../../domain/host-agent.port.js';
import { errorFromAgent, statusForCode } from './agent-errors.js';
import { FrameQueue } from './frame-queue.js';

/** The subset of a pino logger the client uses; it never receives the token. */
export interface ClientLogger {
  warn(obj: Record<string, unknown>, msg: string): void;
  debug(obj: Record<string, unknown>, msg: string): void;
}

export interface HostAgentClientOptions extends HostAgentEndpoint {
  /** Default per-call timeout. Exec calls get their own timeout plus this. */
  timeoutMs?: number;
  /** Attempts for idempotent calls (GET, destroy, delete, prune). */
  attempts?: number;
  /** First backoff; doubles per attempt, with jitter. */
  backoffMs?: number;
  logger?: ClientLogger;
}

export interface RequestSpec<S extends z.ZodType> {
  method: 'GET' | 'POST' | 'PUT' | 'DELETE';
  path: string;
  query?: Record<string, string | undefined>;
  json?: unknown;
  raw?: Uint8Array | AsyncIterable<Uint8Array>;
  schema: S | null;
  idempotent: boolean;
  opts: CallOptions | undefined;
  /** Extra time on top of the call timeout (exec waits for the command). */
  extraTimeoutMs?: number;
}

export const RETRYABLE = new Set(['HOST_UNREACHABLE', 'AGENT_ERROR']);

/** The HTTP/WebSocket plumbing of a HostAgentClient: URLs, auth, timeouts, retries, error mapping, streams. */
export class AgentTransport {
  readonly hostId: string;
  readonly #base: URL;
  readonly #token: string;
  readonly #timeoutMs: number;
  readonly #attempts: number;
  readonly #backoffMs: number;
  readonly #log: ClientLogger | undefined;

  constructor(opts: HostAgentClientOptions) {
    this.hostId = opts.hostId;
    const base = new URL(opts.url);
    // Credentials in a URL would end up in error messages; the bearer token is the only credential.
    base.username = '';
    base.password = '';
    this.#base = base;
    this.#token = opts.token;
    this.#timeoutMs = opts.timeoutMs ?? 30_000;
    this.#attempts = Math.max(1, opts.attempts ?? 3);
    this.#backoffMs = opts.backoffMs ?? 100;
    this.#log = opts.logger;
  }

  // The route groups (./*.ts) reach the plumbing through these, keeping the calls they made inside one class.
  get token(): string {
    return this.#token;
  }

  get timeoutMs(): number {
    return this.#timeoutMs;
  }

  get attempts(): number {
    return this.#attempts;
  }

  get backoffMs(): number {
    return this.#backoffMs;
  }

  url(path: string, query?: Record<string, string | undefined>, ws = false): URL {
    return this.#url(path, query, ws);
  }

  call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#call(spec);
  }

  bytes(spec: RequestSpec<z.ZodType> & { schema: null }): Promise<Uint8Array> {
    return this.#bytes(spec);
  }

  stream(path: string, start: object, opts?: StreamOptions): Promise<AgentStream> {
    return this.#stream(path, start, opts);
  }

  transportError(err: unknown, what: string, timeoutMs: number, callerSignal?: AbortSignal): AppError {
    return this.#transportError(err, what, timeoutMs, callerSignal);
  }

  errorFromResponse(status: number, bytes: Uint8Array, what: string): AppError {
    return this.#errorFromResponse(status, bytes, what);
  }

  // ---- plumbing ---------------------------------------------------------------

  #url(path: string, query?: Record<string, string | undefined>, ws = false): URL {
    const url = new URL(this.#base.href.replace(/\/$/, '') + AGENT_API_PREFIX + path);
    for (const [k, v] of Object.entries(query ?? {})) if (v !== undefined) url.searchParams.set(k, v);
    if (ws) url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
    return url;
  }

  async #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return (await this.#withRetries(spec)) as z.infer<S>;
  }

  async #bytes(spec: RequestSpec<z.ZodType> & { schema: null }): Promise<Uint8Array> {
    return (await this.#withRetries(spec)) as Uint8Array;
  }

  async #withRetries(spec: RequestSpec<z.ZodType>): Promise<unknown> {
    const attempts = spec.idempotent ? this.#attempts : 1;
    let lastErr: unknown;
    for (let attempt = 1; attempt <= attempts; attempt++) {
      try {
        return await this.#once(spec);
      } catch (err) {
        lastErr = err;
        const retry = attempt < attempts && err instanceof AppError && RETRYABLE.has(err.code) && !spec.opts?.signal?.aborted;
        if (!retry) throw err;
        const delay = this.#backoffMs * 2 ** (attempt - 1) * (0.5 + Math.random());
        this.#log?.warn(
          { host_id: this.hostId, method: spec.method, path: spec.path, attempt, code: err.code, delay_ms: Math.round(delay) },
          'host agent call failed; retrying',
        );
        await sleep(delay, spec.opts?.signal);
      }
    }
    throw lastErr;
  }

  async #once(spec: RequestSpec<z.ZodType>): Promise<unknown> {
    // An explicit per-call timeout bounds the whole call; the default stretches by the command's own timeout.
    const timeoutMs = spec.opts?.timeoutMs ?? this.#timeoutMs + (spec.extraTimeoutMs ?? 0);
    const signals = [AbortSignal.timeout(timeoutMs)];
    if (spec.opts?.signal) signals.push(spec.opts.signal);
    const signal = AbortSignal.any(signals);
    const url = this.#url(spec.path, spec.query);
    const what = `${spec.method} ${AGENT_API_PREFIX}${spec.path} on host ${this.hostId}`;
    const headers: Record<string, string> = { authorization: `Bearer ${this.#token}` };
    let body: string | Uint8Array | AsyncIterable<Uint8Array> | undefined;
    if (spec.raw) {
      headers['content-type'] = 'application/octet-stream';
      body = spec.raw;
    } else if (spec.json !== undefined) {
      headers['content-type'] = 'application/json';
      body = JSON.stringify(spec.json);
    }
    let res: Response;
    try {
      // A streamed body goes out as it is read (half duplex: the answer comes after it).
      const streamed = body !== undefined && typeof body !== 'string' && !(body instanceof Uint8Array);
      res = await fetch(url, {
        method: spec.method,
        headers,
        body: body as RequestInit['body'],
        signal,
        ...(streamed ? { duplex: 'half' } : {}),
      });
    } catch (err) {
      throw this.#transportError(err, what, timeoutMs, spec.opts?.signal);
    }
    let bytes: Uint8Array;
    try {
      bytes = new Uint8Array(await res.arrayBuffer());
    } catch (err) {
      throw this.#transportError(err, what, timeoutMs, spec.opts?.signal);
    }
    if (!res.ok) throw this.#errorFromResponse(res.status, bytes, what);
    if (spec.schema === null) return bytes;
    let json: unknown;
    try {
      json = JSON.parse(Buffer.from(bytes).toString('utf8'));
    } catch {
      throw new HostAgentError(`${what} answered ${res.status} with a body that is not JSON`, { host_id: this.hostId });
    }
    const parsed = spec.schema.safeParse(json);
    if (!parsed.success) {
      throw new HostAgentError(
        `${what} answered a body that does not match the protocol: ${parsed.error.issues[0]?.message ?? 'invalid'}`,
        {
          host_id: this.hostId,
        },
      );
    }
    return parsed.data;
  }

  #transportError(err: unknown, what: string, timeoutMs: number, callerSignal?: AbortSignal): AppError {
    if (callerSignal?.aborted)
      return new HostUnreachableError(`${what} was cancelled`, { host_id: this.hostId, cancelled: true }, { cause: err });
    const name = (err as { name?: string }).name;
    if (name === 'TimeoutError' || name === 'AbortError') {
      return new HostUnreachableError(
        `${what} timed out after ${timeoutMs} ms`,
        { host_id: this.hostId, timeout_ms: timeoutMs },
        { cause: err },
      );
    }
    const cause = (err as { cause?: { code?: string; message?: string } }).cause;
    const reason = cause?.code ?? cause?.message ?? (err as { message?: string }).message ?? 'network error';
    return new HostUnreachableError(`${what} failed: ${reason}`, { host_id: this.hostId }, { cause: err });
  }

  #errorFromResponse(status: number, bytes: Uint8Array, what: string): AppError {
    let body: z.infer<typeof errorBodySchema> | undefined;
    try {
      const parsed = errorBodySchema.safeParse(JSON.parse(Buffer.from(bytes).toString('utf8')));
      if (parsed.success) body = parsed.data;
    } catch {
      /* not JSON: classified by status below */
    }
    return errorFromAgent(status, body, what, this.hostId);
  }

  #stream(path: string, start: object, opts?: StreamOptions): Promise<AgentStream> {
    const url = this.#url(path, undefined, true);
    const what = `websocket ${AGENT_API_PREFIX}${path} on host ${this.hostId}`;
    const connectTimeoutMs = opts?.connectTimeoutMs ?? this.#timeoutMs;
    const hostId = this.hostId;
    return new Promise<AgentStream>((resolve, reject) => {
      const ws = new WebSocket(url, { headers: { authorization: `Bearer ${this.#token}` }, perMessageDeflate: false });
      // Frames the relay has not taken yet: past the mark the agent's socket is not read, so TCP pushes back to the agent.
      const queue = new FrameQueue({ pause: () => ws.pause(), resume: () => ws.resume() });
      let settled = false;
      const fail = (err: AppError) => {
        if (!settled) {
          settled = true;
          clearTimeout(timer);
          reject(err);
        } else {
          queue.fail(err);
        }
        ws.terminate();
      };
      const timer = setTimeout(
        () => fail(new HostUnreachableError(`${what} did not start within ${connectTimeoutMs} ms`, { host_id: hostId })),
        connectTimeoutMs,
      );
      const onAbort = () => fail(new HostUnreachableError(`${what} was cancelled`, { host_id: hostId, cancelled: true }));
      opts?.signal?.addEventListener('abort', onAbort, { once: true });

      const stream: AgentStream = {
        frames: queue,
        send: (frame: ClientFrame) => {
          if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame));
        },
        write: (data: Uint8Array | string) => {
          const b64 = (typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data)).toString('base64');
          if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'stdin', data: b64 }));
        },
        close: () => {
          opts?.signal?.removeEventListener('abort', onAbort);
          queue.end();
          if (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING) ws.close(1000);
        },
        bufferedAmount: () => ws.bufferedAmount,
      };

      ws.on('unexpected-response', (_req, res) => {
        const chunks: Buffer[] = [];
        res.on('data', (c: Buffer) => chunks.push(c));
        res.on('end', () => fail(this.#errorFromResponse(res.statusCode ?? 502, Buffer.concat(chunks), what)));
        res.on('error', () => fail(new HostUnreachableError(`${what} failed during the handshake`, { host_id: hostId })));
      });
      ws.on('open', () => ws.send(JSON.stringify(start)));
      ws.on('message', (data: WebSocket.RawData) => {
        let frame: ServerFrame;
        try {
          // binaryType 'nodebuffer' (the default): every message arrives as one Buffer.
          frame = serverFrameSchema.parse(JSON.parse((data as Buffer).toString()));
        } catch {
          fail(new HostAgentError(`${what} sent a frame that does not match the protocol`, { host_id: hostId }));
          return;
        }
        if (!settled) {
          if (frame.type === 'error') {
            fail(
              errorFromAgent(
                frame.code === 'VALIDATION_FAILED' ? 400 : statusForCode(frame.code),
                { code: frame.code, message: frame.message },
                what,
                hostId,
              ),
            );
            return;
          }
          settled = true;
          clearTimeout(timer);
          resolve(stream);
        }
        if (!queue.push(frame)) {
          fail(
            new AppError('FRAME_QUEUE_FULL', 502, `${what}: more than ${FrameQueue.HARD_CAP} frames were waiting for the relay`, {
              host_id: hostId,
            }),
          );
          return;
        }
        if (frame.type === 'exit' || frame.type === 'error') queue.end();
      });
      ws.on('error', (err) =>
        fail(
          new HostUnreachableError(
            `${what} failed: ${(err as NodeJS.ErrnoException).code ?? err.message}`,
            { host_id: hostId },
            { cause: err },
          ),
        ),
      );
      ws.on('close', () => {
        opts?.signal?.removeEventListener('abort', onAbort);
        if (!settled) fail(new HostUnreachableError(`${what} closed before the process started`, { host_id: hostId }));
        else if (!queue.ended) queue.fail(new HostUnreachableError(`${what} closed before the process exited`, { host_id: hostId }));
      });
    });
  }
}

export async function readAtMost(res: Response, max: number): Promise<Uint8Array> {
  const chunks: Uint8Array[] = [];
  let n = 0;
  const reader = (res.body as ReadableStream<Uint8Array> | null)?.getReader();
  if (!reader) return new Uint8Array();
  try {
    while (n < max) {
      const r = await reader.read();
      if (r.done) break;
      chunks.push(r.value);
      n += r.value.byteLength;
    }
  } finally {
    await reader.cancel().catch(() => undefined);
  }
  return Buffer.concat(chunks).subarray(0, max);
}

export function seg(s: string): string {
  return encodeURIComponent(s);
}

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener(
      'abort',
      () => {
        clearTimeout(t);
        resolve();
      },
      { once: true },
    );
  });
}
