import type { FastifyRequest } from 'fastify';
import { z } from 'zod';
import type { CommandMeta } from '../../commands/command-handler.js';
import { parsePositionPair } from '../../domain/event-store.port.js';
import type { ProjectionRunner } from '../../projections/runner.js';

export const problemSchema = z
  .object({
    type: z.string(),
    title: z.string(),
    status: z.number(),
    code: z.string(),
    detail: z.string(),
    instance: z.string().optional(),
    errors: z.array(z.object({ path: z.string(), message: z.string() })).optional(),
  })
  .loose();

/** Documented for OpenAPI; the error handler produces them. */
export const problemResponses = {
  400: problemSchema,
  401: problemSchema,
  403: problemSchema,
  404: problemSchema,
  409: problemSchema,
  413: problemSchema,
  429: problemSchema,
  503: problemSchema,
} as const;

/** A position as returned by a command (`<16 hex>-<16 hex>`). */
export const positionSchema = z.string().refine((v) => {
  try {
    parsePositionPair(v);
    return true;
  } catch {
    return false;
  }
}, 'a position as returned by a command response');

/**
 * Where a NUL character (U+0000) sits in a request value, as `querystring.a.b`; undefined when there is none.
 * Postgres text and jsonb refuse it: one reaching a query fails it (a 500), one stored in an event stops
 * every read model that copies that string, for good.
 */
export function nulPath(value: unknown, path: string): string | undefined {
  if (typeof value === 'string') return value.includes('\0') ? path : undefined;
  if (value === null || typeof value !== 'object' || Buffer.isBuffer(value)) return undefined;
  for (const [k, v] of Object.entries(value)) {
    const where = k.includes('\0') ? `${path}.${JSON.stringify(k)}` : nulPath(v, `${path}.${k}`);
    if (where) return where;
  }
  return undefined;
}

export function commandMeta(req: FastifyRequest): CommandMeta {
  return { correlationId: req.id, tenantId: req.caller.tenantId, actor: req.caller.actor };
}

/** Read-your-writes: a query carrying `?after=<position>` waits (bounded) until every read model has applied it. */
export async function waitForPosition(runner: ProjectionRunner, position: string | undefined, timeoutMs: number): Promise<void> {
  if (position) await runner.waitFor(position, timeoutMs);
}
