import { request as httpRequest } from 'node:http';
import { request as httpsRequest } from 'node:https';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { z } from 'zod';
import { AGENT_API_PREFIX, type AgentSpec, type StartAgentResponse, startAgentResponseSchema, AppError } from '@fleet/agent-protocol';
import { type CallOptions, type EnvdRequest, type EnvdResponse } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** The guest side: the envd relay and the in-guest agent. */
export class EnvdRoutes {
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

  #transportError(err: unknown, what: string, timeoutMs: number, callerSignal?: AbortSignal): AppError {
    return this.#t.transportError(err, what, timeoutMs, callerSignal);
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
}
