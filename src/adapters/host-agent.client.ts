import { request as httpRequest } from 'node:http';
import { request as httpsRequest } from 'node:https';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import WebSocket from 'ws';
import type { z } from 'zod';
import {
  AGENT_API_PREFIX,
  type AgentSpec,
  type PauseVmRequest,
  type RestoreVmRequest,
  type ArtifactMove,
  type ArtifactMoved,
  type AttachStart,
  type CapacityResponse,
  type Checkpoint,
  type ClientFrame,
  type CreateCheckpointRequest,
  type LayerUsageResponse,
  type CreateVmRequest,
  type DestroyVmResponse,
  type ExecRequest,
  type ExecResult,
  type ExecStreamStart,
  type GrantResponse,
  type NetworkReassertResponse,
  type PruneResponse,
  type ServerFrame,
  type StartAgentResponse,
  type UploadResponse,
  type VmInfo,
  type AgentEgress,
  type EgressStatus,
  egressStatusSchema,
  artifactMovedSchema,
  capacityResponseSchema,
  checkpointSchema,
  pauseVmResponseSchema,
  deleteCheckpointResponseSchema,
  destroyVmResponseSchema,
  errorBodySchema,
  execResultSchema,
  grantResponseSchema,
  layerUsageResponseSchema,
  listCheckpointsResponseSchema,
  listVmsResponseSchema,
  networkReassertResponseSchema,
  pruneResponseSchema,
  serverFrameSchema,
  startAgentResponseSchema,
  uploadResponseSchema,
  vmInfoSchema,
} from '@fleet/agent-protocol';
import { AppError, ConflictError, NotFoundError, ValidationError, type FieldError } from '@fleet/agent-protocol';
import {
  hostMetricsResponseSchema,
  logsResponseSchema,
  metricsResponseSchema,
  type HostMetricsResponse,
  type LogsResponse,
  type MetricsResponse,
} from '@fleet/agent-protocol';
import {
  HostAgentError,
  HostCapacityError,
  HostUnreachableError,
  type AgentStream,
  type CallOptions,
  type FileDownload,
  type HostAgent,
  type HostAgentConnector,
  type HostAgentEndpoint,
  type StreamOptions,
  type EnvdRequest,
  type EnvdResponse,
} from '../domain/host-agent.port.js';

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

interface RequestSpec<S extends z.ZodType> {
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

const RETRYABLE = new Set(['HOST_UNREACHABLE', 'AGENT_ERROR']);

/** Typed client for one host agent. Implements the control plane's HostAgent port. */
export class HostAgentClient implements HostAgent {
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

  capacity(opts?: CallOptions): Promise<CapacityResponse> {
    return this.#call({ method: 'GET', path: '/capacity', schema: capacityResponseSchema, idempotent: true, opts });
  }

  createVm(req: CreateVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: '/vms', json: req, schema: vmInfoSchema, idempotent: false, opts });
  }

  getVm(name: string, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}`, schema: vmInfoSchema, idempotent: true, opts });
  }

  async listVms(prefix = '', opts?: CallOptions): Promise<VmInfo[]> {
    const res = await this.#call({ method: 'GET', path: '/vms', query: { prefix }, schema: listVmsResponseSchema, idempotent: true, opts });
    return res.vms;
  }

  destroyVm(name: string, opts?: CallOptions & { force?: boolean }): Promise<DestroyVmResponse> {
    return this.#call({
      method: 'DELETE',
      path: `/vms/${seg(name)}`,
      query: { force: opts?.force ? 'true' : undefined },
      schema: destroyVmResponseSchema,
      idempotent: true,
      opts,
    });
  }

  /** The tail of the sandbox's serial-style init log (not part of the HostAgent port). */
  async consoleLog(name: string, tailBytes?: number, opts?: CallOptions): Promise<string> {
    const bytes = await this.#bytes({
      method: 'GET',
      path: `/vms/${seg(name)}/console`,
      query: { tail_bytes: tailBytes === undefined ? undefined : String(tailBytes) },
      schema: null,
      idempotent: true,
      opts,
    });
    return Buffer.from(bytes).toString('utf8');
  }

  /** Resource samples of a sandbox after `sinceMs` (observability; not part of the HostAgent port). */
  metrics(name: string, sinceMs = 0, opts?: CallOptions): Promise<MetricsResponse> {
    return this.#call({
      method: 'GET',
      path: `/vms/${seg(name)}/metrics`,
      query: { since: String(sinceMs) },
      schema: metricsResponseSchema,
      idempotent: true,
      opts,
    });
  }

  /** Aggregates over every sandbox of the host. */
  hostMetrics(opts?: CallOptions): Promise<HostMetricsResponse> {
    return this.#call({ method: 'GET', path: '/host/metrics', schema: hostMetricsResponseSchema, idempotent: true, opts });
  }

  /** The console log from a byte offset (or its tail); readable after the sandbox ended, for the agent's retention. */
  logs(name: string, q: { offset?: number; tailBytes?: number; maxBytes?: number }, opts?: CallOptions): Promise<LogsResponse> {
    return this.#call({
      method: 'GET',
      path: `/vms/${seg(name)}/logs`,
      query: {
        offset: q.offset === undefined ? undefined : String(q.offset),
        tail_bytes: q.tailBytes === undefined ? undefined : String(q.tailBytes),
        max_bytes: q.maxBytes === undefined ? undefined : String(q.maxBytes),
      },
      schema: logsResponseSchema,
      idempotent: true,
      opts,
    });
  }

  exec(name: string, req: ExecRequest, opts?: CallOptions): Promise<ExecResult> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/exec`,
      json: req,
      schema: execResultSchema,
      idempotent: false,
      opts,
      // The agent's default exec timeout is 30 s; the call must outlive the command it waits for.
      extraTimeoutMs: req.timeout_ms || 30_000,
    });
  }

  execStream(name: string, start: ExecStreamStart, opts?: StreamOptions): Promise<AgentStream> {
    return this.#stream(`/vms/${seg(name)}/exec`, start, opts);
  }

  attach(name: string, start: AttachStart, opts?: StreamOptions): Promise<AgentStream> {
    return this.#stream(`/vms/${seg(name)}/attach`, start, opts);
  }

  upload(
    name: string,
    path: string,
    data: Uint8Array | AsyncIterable<Uint8Array>,
    opts?: CallOptions & { mode?: string },
  ): Promise<UploadResponse> {
    return this.#call({
      method: 'PUT',
      path: `/vms/${seg(name)}/files`,
      query: { path, mode: opts?.mode },
      raw: data,
      schema: uploadResponseSchema,
      idempotent: false,
      opts,
    });
  }

  /** The whole file in memory, for small files (tests, tools): refused above `maxBytes` (default 64 MiB) before transfer. */
  async download(name: string, path: string, opts?: CallOptions & { maxBytes?: number }): Promise<Uint8Array> {
    const file = await this.openDownload(name, path, { ...opts, maxBytes: opts?.maxBytes ?? 64 * 1024 * 1024 });
    const chunks: Uint8Array[] = [];
    for await (const c of file.body) chunks.push(c);
    return Buffer.concat(chunks);
  }

  async openDownload(name: string, path: string, opts?: CallOptions & { maxBytes?: number }): Promise<FileDownload> {
    const maxBytes = opts?.maxBytes;
    const what = `GET ${AGENT_API_PREFIX}/vms/${seg(name)}/files on host ${this.hostId}`;
    // Retried only up to the answer's head: once bytes flow, a failure ends the body and the reader decides.
    let lastErr: unknown;
    for (let attempt = 1; attempt <= this.#attempts; attempt++) {
      try {
        return await this.#openDownloadOnce(name, path, maxBytes, what, opts);
      } catch (err) {
        lastErr = err;
        if (!(attempt < this.#attempts && err instanceof AppError && RETRYABLE.has(err.code) && !opts?.signal?.aborted)) throw err;
        await sleep(this.#backoffMs * 2 ** (attempt - 1) * (0.5 + Math.random()), opts?.signal);
      }
    }
    throw lastErr;
  }

  async #openDownloadOnce(
    name: string,
    path: string,
    maxBytes: number | undefined,
    what: string,
    opts?: CallOptions,
  ): Promise<FileDownload> {
    const headTimeoutMs = opts?.timeoutMs ?? this.#timeoutMs;
    const abort = new AbortController();
    const headTimer = setTimeout(() => abort.abort(Object.assign(new Error('head timeout'), { name: 'TimeoutError' })), headTimeoutMs);
    const onCallerAbort = (): void => abort.abort();
    opts?.signal?.addEventListener('abort', onCallerAbort, { once: true });
    const url = this.#url(`/vms/${seg(name)}/files`, { path, max_bytes: maxBytes === undefined ? undefined : String(maxBytes) });
    let res: Response;
    try {
      res = await fetch(url, { headers: { authorization: `Bearer ${this.#token}` }, signal: abort.signal });
    } catch (err) {
      opts?.signal?.removeEventListener('abort', onCallerAbort);
      throw this.#transportError(
        (abort.signal.reason as Error | undefined)?.name === 'TimeoutError' ? abort.signal.reason : err,
        what,
        headTimeoutMs,
        opts?.signal,
      );
    } finally {
      clearTimeout(headTimer);
    }
    const done = (): void => opts?.signal?.removeEventListener('abort', onCallerAbort);
    if (!res.ok) {
      // An error answer is small; read at most 64 KiB of it.
      const bytes = await readAtMost(res, 64 * 1024).catch(() => new Uint8Array());
      done();
      throw this.#errorFromResponse(res.status, bytes, what);
    }
    const size = Number(res.headers.get('content-length') ?? Number.NaN);
    if (!Number.isSafeInteger(size) || size < 0) {
      abort.abort();
      done();
      throw new HostAgentError(`${what} did not announce the file's size`, { host_id: this.hostId });
    }
    if (maxBytes !== undefined && size > maxBytes) {
      abort.abort();
      done();
      throw fileTooLarge(size, maxBytes);
    }
    const hostId = this.hostId;
    const body = res.body;
    async function* bytes(): AsyncGenerator<Uint8Array> {
      if (!body) return;
      const reader = (body as ReadableStream<Uint8Array>).getReader();
      let seen = 0;
      try {
        for (;;) {
          let r: Awaited<ReturnType<typeof reader.read>>;
          try {
            r = await reader.read();
          } catch (err) {
            throw new HostUnreachableError(`${what} broke after ${seen} of ${size} bytes`, { host_id: hostId }, { cause: err });
          }
          if (r.done) break;
          seen += r.value.byteLength;
          if (seen > size) throw new HostAgentError(`${what} sent more than the ${size} bytes it announced`, { host_id: hostId });
          yield r.value;
        }
        if (seen < size) throw new HostUnreachableError(`${what} ended after ${seen} of ${size} bytes`, { host_id: hostId });
      } finally {
        abort.abort();
        done();
      }
    }
    return {
      size,
      body: bytes(),
      cancel: () => {
        abort.abort();
        done();
      },
    };
  }

  setEgress(name: string, egress: AgentEgress, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'PUT', path: `/vms/${seg(name)}/egress`, json: egress, schema: vmInfoSchema, idempotent: true, opts });
  }

  egressStatus(name: string, opts?: CallOptions): Promise<EgressStatus> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}/egress`, schema: egressStatusSchema, idempotent: true, opts });
  }

  /** A plain node:http exchange, not fetch: fetch would decompress a gzip answer and a relay must pass bytes through as sent. */
  envd(name: string, req: EnvdRequest): Promise<EnvdResponse> {
    const base = this.#url(`/vms/${seg(name)}/envd`);
    const url = new URL(base.href + req.path);
    const what = `${req.method} ${AGENT_API_PREFIX}/vms/${seg(name)}/envd on host ${this.hostId}`;
    const send = url.protocol === 'https:' ? httpsRequest : httpRequest;
    return new Promise<EnvdResponse>((resolve, reject) => {
      const out = send(
        url,
        { method: req.method, headers: { ...req.headers, authorization: `Bearer ${this.#token}` }, signal: req.signal },
        (res) => resolve({ status: res.statusCode ?? 502, headers: res.headers as Record<string, string | string[]>, body: res }),
      );
      out.on('error', (err) => reject(this.#transportError(err, what, this.#timeoutMs, req.signal)));
      if (req.body) pipeline(Readable.from(req.body), out).catch(() => out.destroy());
      else out.end();
    });
  }

  startAgent(name: string, spec: AgentSpec, opts?: CallOptions): Promise<StartAgentResponse> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/agent`,
      json: spec,
      schema: startAgentResponseSchema,
      idempotent: false,
      opts,
    });
  }

  checkpoint(name: string, req: CreateCheckpointRequest, opts?: CallOptions): Promise<Checkpoint> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/checkpoints`,
      json: req,
      schema: checkpointSchema,
      idempotent: false,
      opts,
    });
  }

  layerUsage(name: string, opts?: CallOptions): Promise<LayerUsageResponse> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}/layer-usage`, schema: layerUsageResponseSchema, idempotent: true, opts });
  }

  async listCheckpoints(opts?: CallOptions): Promise<Checkpoint[]> {
    const res = await this.#call({ method: 'GET', path: '/checkpoints', schema: listCheckpointsResponseSchema, idempotent: true, opts });
    return res.checkpoints;
  }

  deleteCheckpoint(id: string, opts?: CallOptions): Promise<{ id: string; deleted: boolean }> {
    return this.#call({
      method: 'DELETE',
      path: `/checkpoints/${seg(id)}`,
      schema: deleteCheckpointResponseSchema,
      idempotent: true,
      opts,
    });
  }

  grantArtifact(snapshotId: string, ttlSeconds?: number, opts?: CallOptions): Promise<GrantResponse> {
    return this.#call({
      method: 'POST',
      path: '/artifacts/grants',
      json: { snapshot_id: snapshotId, ttl_s: ttlSeconds },
      schema: grantResponseSchema,
      idempotent: false,
      opts,
    });
  }

  pullArtifact(move: ArtifactMove, opts?: CallOptions): Promise<ArtifactMoved> {
    // A pull moves gigabytes: its bound is the caller's, defaulting to 30 minutes, not the short per-call default.
    const callOpts: CallOptions = { ...opts, timeoutMs: opts?.timeoutMs ?? 30 * 60_000 };
    return this.#call({
      method: 'POST',
      path: '/artifacts/pull',
      json: move,
      schema: artifactMovedSchema,
      idempotent: false,
      opts: callOpts,
    });
  }

  pauseVm(name: string, req: PauseVmRequest = {}, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }> {
    // A second pause answers the first's checkpoint: safe to retry.
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/pause`,
      json: req,
      schema: pauseVmResponseSchema,
      idempotent: true,
      opts,
    });
  }

  resumeVm(name: string, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: `/vms/${seg(name)}/resume`, json: {}, schema: vmInfoSchema, idempotent: true, opts });
  }

  restoreVm(name: string, req: RestoreVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: `/vms/${seg(name)}/restore`, json: req, schema: vmInfoSchema, idempotent: false, opts });
  }

  prune(opts?: CallOptions): Promise<PruneResponse> {
    return this.#call({ method: 'POST', path: '/prune', schema: pruneResponseSchema, idempotent: true, opts });
  }

  reassertNetwork(opts?: CallOptions): Promise<NetworkReassertResponse> {
    return this.#call({ method: 'POST', path: '/network/reassert', schema: networkReassertResponseSchema, idempotent: true, opts });
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

/** Builds clients for hosts; the control plane keeps one per host. */
export class HostAgentClientFactory implements HostAgentConnector {
  constructor(private readonly defaults: Omit<HostAgentClientOptions, keyof HostAgentEndpoint> = {}) {}
  connect(endpoint: HostAgentEndpoint): HostAgentClient {
    return new HostAgentClient({ ...this.defaults, ...endpoint });
  }
}

/** Maps an agent's error answer back to the AppError subclass the control plane understands. */
export function errorFromAgent(
  status: number,
  body: { code: string; message: string; details?: Record<string, unknown> } | undefined,
  what: string,
  hostId: string,
): AppError {
  const code = body?.code;
  const message = body?.message ?? `HTTP ${status}`;
  const details: Record<string, unknown> = { ...(body?.details ?? {}), host_id: hostId };
  if (code === 'HOST_CAPACITY_EXHAUSTED') return new HostCapacityError(`host ${hostId} refused for capacity: ${message}`, details);
  if (status >= 500 || !code) {
    return new HostAgentError(`${what} failed with ${status}${code ? ` ${code}` : ''}: ${message}`, {
      ...details,
      agent_code: code,
      agent_status: status,
    });
  }
  // The agent refusing our token means the host is misregistered, not that the control plane's caller is unauthorized.
  if (status === 401 && code === 'UNAUTHORIZED') {
    return new HostAgentError(`${what} was refused: the host agent did not accept the control plane's token`, {
      ...details,
      agent_code: code,
      agent_status: status,
    });
  }
  if (status === 404) return new NotFoundError(code, message, details);
  if (status === 409) return new ConflictError(code, message, details);
  if (status === 400 && code === 'VALIDATION_FAILED') {
    const fields = Array.isArray(details.fields) ? (details.fields as FieldError[]) : [];
    return new ValidationError(message, fields, code);
  }
  return new AppError(code, status, message, details);
}

function statusForCode(code: string): number {
  if (code.endsWith('_NOT_FOUND')) return 404;
  if (code === 'VM_NOT_RUNNING' || code === 'VM_EXISTS') return 409;
  if (code === 'HOST_CAPACITY_EXHAUSTED') return 409;
  if (code === 'AGENT_ERROR') return 500;
  return 400;
}

export function fileTooLarge(size: number, maxBytes: number): AppError {
  return new AppError(
    'FILE_TOO_LARGE',
    413,
    `the file is ${size} bytes, more than the ${maxBytes} bytes a transfer may move (FILE_MAX_BYTES)`,
    { size_bytes: size, max_bytes: maxBytes },
  );
}

async function readAtMost(res: Response, max: number): Promise<Uint8Array> {
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

function seg(s: string): string {
  return encodeURIComponent(s);
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
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

/**
 * A push-based async iterable of frames with an error/end state, and flow control: above HIGH frames
 * waiting the source is paused, at LOW it is resumed; HARD_CAP (frames that still arrived while paused)
 * refuses more.
 */
class FrameQueue implements AsyncIterable<ServerFrame> {
  static readonly HIGH = 32;
  static readonly LOW = 8;
  static readonly HARD_CAP = 1024;
  #items: ServerFrame[] = [];
  #waiters: Array<{ resolve: (r: IteratorResult<ServerFrame>) => void; reject: (e: unknown) => void }> = [];
  #error: Error | undefined;
  #paused = false;
  ended = false;

  constructor(private readonly source: { pause(): void; resume(): void }) {}

  /** False when the queue is over its hard cap (the frame is dropped). */
  push(frame: ServerFrame): boolean {
    if (this.ended) return true;
    const w = this.#waiters.shift();
    if (w) {
      w.resolve({ value: frame, done: false });
      return true;
    }
    if (this.#items.length >= FrameQueue.HARD_CAP) return false;
    this.#items.push(frame);
    if (!this.#paused && this.#items.length >= FrameQueue.HIGH) {
      this.#paused = true;
      this.source.pause();
    }
    return true;
  }

  #taken(): void {
    if (this.#paused && this.#items.length <= FrameQueue.LOW) {
      this.#paused = false;
      this.source.resume();
    }
  }

  end(): void {
    if (this.ended) return;
    this.ended = true;
    for (const w of this.#waiters.splice(0)) w.resolve({ value: undefined, done: true });
  }

  fail(err: Error): void {
    if (this.ended) return;
    this.#error = err;
    this.ended = true;
    for (const w of this.#waiters.splice(0)) w.reject(err);
  }

  [Symbol.asyncIterator](): AsyncIterator<ServerFrame> {
    return {
      next: () => {
        const item = this.#items.shift();
        if (item) {
          this.#taken();
          return Promise.resolve({ value: item, done: false });
        }
        if (this.#error !== undefined) {
          const err = this.#error;
          this.#error = undefined;
          return Promise.reject(err);
        }
        if (this.ended) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve, reject) => this.#waiters.push({ resolve, reject }));
      },
      return: () => Promise.resolve({ value: undefined, done: true }),
    };
  }
}
