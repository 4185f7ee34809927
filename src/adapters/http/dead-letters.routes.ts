import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import type { Reconciler } from '../../commands/reconcile/reconciler.js';
import type { DeadLetterState } from '../../domain/deadletter/deadletter.decider.js';
import { NotFoundError } from '@fleet/agent-protocol';
import { idSchema } from '../../domain/ids.js';
import { getDeadLetter, listDeadLetters } from '../../projections/dead-letters/dead-letters.queries.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import { adminOnly } from './auth.js';
import { commandMeta, positionSchema, problemResponses, waitForPosition } from './common.js';
import { cursorTime, decodeCursor, encodeCursor, pageQuery } from './pagination.js';

const deadLetterSchema = z.object({
  id: z.string(),
  kind: z.string(),
  entity_id: z.string(),
  host_id: z.string(),
  vm_id: z.string().nullable(),
  state: z.string(),
  reason: z.string(),
  error_code: z.string().nullable(),
  retry_count: z.number(),
  first_seen_at: z.string(),
  last_seen_at: z.string(),
  updated_at: z.string(),
  resolution: z.string().nullable(),
  actor: z.string().nullable(),
});

const actionResult = z.object({
  id: z.string(),
  state: z.string(),
  kind: z.string(),
  entity_id: z.string(),
  host_id: z.string(),
  retry_count: z.number(),
  /** Set when a retry was attempted and failed again: the reconciler keeps retrying. */
  error: z.object({ code: z.string(), message: z.string() }).optional(),
});

const summarySchema = z.record(z.string(), z.union([z.number(), z.string()]));

export interface DeadLetterRoutesDeps {
  readonly reconciler: Reconciler;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly readYourWritesTimeoutMs: number;
  /** Whether this replica holds the reconciler lease right now. */
  readonly isLeader: () => boolean;
  readonly intervalMs: number;
}

function shape(id: string, s: DeadLetterState, error?: { code: string; message: string }): z.infer<typeof actionResult> {
  if (s.status === 'none') throw new NotFoundError('DEAD_LETTER_NOT_FOUND', `dead letter ${id} does not exist`, { id });
  return {
    id,
    state: s.status,
    kind: s.kind,
    entity_id: s.entity_id,
    host_id: s.host_id,
    retry_count: s.retry_count,
    ...(error ? { error } : {}),
  };
}

/** Dead letters and the reconciler's last cycle: admin only. */
export function deadLetterRoutes(deps: DeadLetterRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    adminOnly(scope);
    const params = z.object({ id: idSchema });

    app.get(
      '/v1/dead-letters',
      {
        schema: {
          tags: ['reconciler'],
          summary: 'List dead letters (work the reconciler stopped retrying), newest first',
          querystring: z.object({
            ...pageQuery,
            state: z.enum(['open', 'retrying', 'discarded', 'resolved']).optional(),
            after: positionSchema.optional(),
          }),
          response: { 200: z.object({ dead_letters: z.array(deadLetterSchema), next_cursor: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const after = decodeCursor(req.query.cursor, z.object({ last_seen_at: cursorTime, id: z.string() }));
        const rows = await listDeadLetters(deps.pool, { state: req.query.state, limit: req.query.limit, after });
        const last = rows.at(-1);
        return {
          dead_letters: rows,
          next_cursor: rows.length === req.query.limit && last ? encodeCursor({ last_seen_at: last.last_seen_at, id: last.id }) : null,
        };
      },
    );

    app.get(
      '/v1/dead-letters/:id',
      {
        schema: { tags: ['reconciler'], summary: 'Get a dead letter', params, response: { 200: deadLetterSchema, ...problemResponses } },
      },
      async (req) => {
        const row = await getDeadLetter(deps.pool, req.params.id);
        if (!row) throw new NotFoundError('DEAD_LETTER_NOT_FOUND', `dead letter ${req.params.id} does not exist`);
        return row;
      },
    );

    app.post(
      '/v1/dead-letters/:id/retry',
      {
        schema: {
          tags: ['reconciler'],
          summary: 'Retry now; on success the dead letter is resolved, on failure it stays `retrying` and the reconciler keeps trying',
          params,
          response: { 200: actionResult, ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.reconciler.retryDeadLetter(req.params.id, commandMeta(req));
        return shape(req.params.id, r.state, r.error);
      },
    );

    app.post(
      '/v1/dead-letters/:id/discard',
      {
        schema: {
          tags: ['reconciler'],
          summary: 'Discard: the reconciler never touches this work again (the operator has taken it over)',
          params,
          body: z.object({ note: z.string().max(1000).optional() }).optional(),
          response: { 200: actionResult, ...problemResponses },
        },
      },
      async (req) => {
        const s = await deps.reconciler.discardDeadLetter(req.params.id, req.body?.note, commandMeta(req));
        return shape(req.params.id, s);
      },
    );

    app.get(
      '/v1/reconciler',
      {
        schema: {
          tags: ['reconciler'],
          summary: "This replica's view of the reconciler: whether it holds the lease, and its last cycle's summary",
          response: {
            200: z.object({ leader: z.boolean(), interval_ms: z.number(), last_summary: summarySchema.nullable() }),
            ...problemResponses,
          },
        },
      },
      () => {
        const last = deps.reconciler.lastSummary;
        return { leader: deps.isLeader(), interval_ms: deps.intervalMs, last_summary: last ? { ...last } : null };
      },
    );
  };
}
