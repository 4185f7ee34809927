import type { z } from 'zod';
import {
  hostMetricsResponseSchema,
  logsResponseSchema,
  metricsResponseSchema,
  type HostMetricsResponse,
  type LogsResponse,
  type MetricsResponse,
} from '@fleet/agent-protocol';
import type { CallOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** Observability: console log, metrics, logs. */
export class ObserveRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  #bytes(spec: RequestSpec<z.ZodType> & { schema: null }): Promise<Uint8Array> {
    return this.#t.bytes(spec);
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
}
