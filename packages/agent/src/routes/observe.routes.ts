import { open } from 'node:fs/promises';
import type { FastifyInstance } from 'fastify';
import {
  AGENT_API_PREFIX,
  AppError,
  hostMetricsResponseSchema,
  logsQuerySchema,
  logsResponseSchema,
  metricsQuerySchema,
  metricsResponseSchema,
  type VmInfo,
} from '@fleet/agent-protocol';
import type { Backend } from '../backend.js';
import { sandboxNotFound } from '../backend.js';
import type { SandboxObserver } from '../observe.js';
import { type AgentRouteContext } from './context.js';
import { paramOf, part, queryOf, sandboxName, type Answer, type RouteSchema } from './route-schema.js';

/** Each route's request parts and responses (route-schema.ts). */
export const schemas = {
  metrics: { params: { name: sandboxName }, querystring: part(metricsQuerySchema, 'query'), response: { 200: metricsResponseSchema } },
  hostMetrics: { response: { 200: hostMetricsResponseSchema } },
  logs: { params: { name: sandboxName }, querystring: part(logsQuerySchema, 'query'), response: { 200: logsResponseSchema } },
} satisfies Record<string, RouteSchema>;

/** The OOM facts ride on the VM info the reconciler already lists each cycle. */
export function withOom(info: VmInfo, backend: Backend): VmInfo {
  const oom = backend.observer?.oom(info.name);
  return oom ? { ...info, oom } : info;
}

/** A stopped sandbox's listing says how its init ended (exit code or signal), when the host recorded it. */
export async function withInitExit(info: VmInfo, backend: Backend): Promise<VmInfo> {
  if (info.state !== 'stopped') return info;
  const exit = await backend.observer?.initExit?.(info.name);
  return exit ? { ...info, init_exit: exit } : info;
}

function observerOf(backend: Backend): SandboxObserver {
  if (!backend.observer) throw new AppError('NOT_IMPLEMENTED', 501, 'this backend does not observe its sandboxes');
  return backend.observer;
}

/** Observability: per-sandbox metrics, console logs (also after the sandbox ended, for the retention), host aggregates. */
export function registerObserveRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend } = ctx;

  app.get(`${AGENT_API_PREFIX}/vms/:name/metrics`, (req): Promise<Answer<typeof schemas.metrics, 200>> => {
    const name = paramOf(req, schemas.metrics.params, 'name');
    const q = queryOf(req, schemas.metrics.querystring);
    const observer = observerOf(backend);
    return Promise.resolve({ interval_ms: observer.intervalMs, window: observer.window, samples: observer.metrics(name, q.since) });
  });

  app.get(`${AGENT_API_PREFIX}/host/metrics`, (): Promise<Answer<typeof schemas.hostMetrics, 200>> =>
    Promise.resolve(observerOf(backend).host()),
  );

  // Bytes of the console from an offset over the previous (rotated) file then the current one, so a follower
  // polling with the next offset neither repeats nor skips across a rotation it did not see.
  app.get(`${AGENT_API_PREFIX}/vms/:name/logs`, async (req): Promise<Answer<typeof schemas.logs, 200>> => {
    const name = paramOf(req, schemas.logs.params, 'name');
    const q = queryOf(req, schemas.logs.querystring);
    const logs = await observerOf(backend).logFiles(name);
    if (!logs) throw sandboxNotFound(name);
    const handles = await Promise.all(logs.files.map((f) => open(f, 'r').catch(() => null)));
    try {
      const parts = await Promise.all(handles.map(async (h) => ({ h, size: h ? (await h.stat()).size : 0 })));
      const total = parts.reduce((n, p) => n + p.size, 0);
      let from = q.offset ?? Math.max(0, total - q.tail_bytes);
      // A rotation since the follower's last read shifted the previous file: start again at what is kept.
      if (from > total) from = Math.max(0, total - q.tail_bytes);
      const want = Math.min(q.max_bytes, total - from);
      const out = Buffer.alloc(want);
      let filled = 0;
      let base = 0;
      for (const p of parts) {
        if (filled < want && p.h && from + filled < base + p.size) {
          const at = from + filled - base;
          const n = Math.min(want - filled, p.size - at);
          const { bytesRead } = await p.h.read(out, filled, n, at);
          filled += bytesRead;
        }
        base += p.size;
      }
      return {
        data: out.subarray(0, filled).toString('base64'),
        offset: from,
        next_offset: from + filled,
        size: total,
        ended: logs.ended,
      };
    } finally {
      await Promise.all(handles.map((h) => (h ? h.close() : Promise.resolve())));
    }
  });
}
