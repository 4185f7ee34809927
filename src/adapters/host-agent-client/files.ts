import type { z } from 'zod';
import { AGENT_API_PREFIX, type UploadResponse, uploadResponseSchema, AppError } from '@fleet/agent-protocol';
import { HostAgentError, HostUnreachableError, type CallOptions, type FileDownload } from '../../domain/host-agent.port.js';
import { type AgentTransport, RETRYABLE, readAtMost, seg, sleep, type RequestSpec } from './transport.js';
import { fileTooLarge } from './agent-errors.js';

/** Files in a sandbox: upload, download (retried up to the answer's head). */
export class FileRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  get hostId(): string {
    return this.#t.hostId;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  #url(path: string, query?: Record<string, string | undefined>, ws = false): URL {
    return this.#t.url(path, query, ws);
  }

  get #token(): string {
    return this.#t.token;
  }

  get #timeoutMs(): number {
    return this.#t.timeoutMs;
  }

  get #attempts(): number {
    return this.#t.attempts;
  }

  get #backoffMs(): number {
    return this.#t.backoffMs;
  }

  #transportError(err: unknown, what: string, timeoutMs: number, callerSignal?: AbortSignal): AppError {
    return this.#t.transportError(err, what, timeoutMs, callerSignal);
  }

  #errorFromResponse(status: number, bytes: Uint8Array, what: string): AppError {
    return this.#t.errorFromResponse(status, bytes, what);
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
}
