import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { ForbiddenError, ValidationError } from '@fleet/agent-protocol';
import type { VmLifecycle } from '../../commands/vm/vm-lifecycle.js';
import { idSchema } from '../../domain/ids.js';
import { FEED_EVENT_NAMES } from '../../domain/vm/vm.feed.js';
import { metadataSchema, timeoutSecondsSchema } from '../../domain/vm/vm.lifecycle.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import { queryVmEvents, VM_EVENTS_RETENTION_DAYS } from '../../projections/vm-events/vm-events.projection.js';
import { requireAdmin } from './auth.js';
import { commandMeta, positionSchema, problemResponses, problemSchema, waitForPosition } from './common.js';
import { decodeCursor, encodeCursor, pageQuery } from './pagination.js';
import { actorOf, fromState, vmSchema } from './vms.routes.js';

export interface LifecycleRoutesDeps {
  readonly lifecycle: VmLifecycle;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly readYourWritesTimeoutMs: number;
  /** Longest `GET /v1/vms/:id/wait` (seconds). */
  readonly maxWaitS?: number | undefined;
}

const DEFAULT_MAX_WAIT_S = 300;

const environmentEventSchema = z
  .object({ id: z.string(), event: z.string(), vm_id: z.string(), state: z.string(), updated_at: z.string() })
  .loose();

/**
 * Lifecycle routes beside vms.routes.ts: PATCH a VM's timeout and metadata,
 * wait for a state, the paged JSON read of lifecycle events, and the
 * operator's drain of a host (its VMs end with reason `evicted`).
 */
export function lifecycleRoutes(deps: LifecycleRoutesDeps) {
  const maxWaitS = deps.maxWaitS ?? DEFAULT_MAX_WAIT_S;
  // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a plugin returns a promise
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const params = z.object({ id: z.string().min(1).max(64) });

    app.patch(
      '/v1/vms/:id',
      {
        schema: {
          tags: ['vms'],
          summary: 'Set a running VM’s timeout from now (timeout_s) and/or replace its metadata',
          params,
          body: z
            .object({ timeout_s: timeoutSecondsSchema.optional(), metadata: metadataSchema.optional() })
            .strict()
            .refine((b) => b.timeout_s !== undefined || b.metadata !== undefined, 'give timeout_s, metadata or both'),
          response: { 200: vmSchema.extend({ position: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.lifecycle.update(req.params.id, req.body, actorOf(req));
        return { ...fromState(r.vm), position: r.position ?? null };
      },
    );

    app.get(
      '/v1/vms/:id/wait',
      {
        schema: {
          tags: ['vms'],
          summary: 'Wait until the VM is running, or has ended (state=destroyed); 408 WAIT_TIMEOUT after timeout_s',
          params,
          querystring: z.object({
            state: z.enum(['running', 'destroyed']),
            timeout_s: z.coerce.number().int().min(1).max(maxWaitS).default(60),
          }),
          response: { 200: vmSchema, 408: problemSchema, ...problemResponses },
        },
      },
      async (req) => {
        const gone = new AbortController();
        const onClose = (): void => gone.abort();
        req.raw.once('close', onClose);
        try {
          const vm = await deps.lifecycle.wait(req.params.id, req.query.state, req.query.timeout_s * 1000, actorOf(req), gone.signal);
          return fromState(vm);
        } finally {
          req.raw.off('close', onClose);
        }
      },
    );

    app.get(
      '/v1/vm-events',
      {
        schema: {
          tags: ['events'],
          summary: `VM lifecycle events as paged JSON, oldest first (kept ${VM_EVENTS_RETENTION_DAYS} days)`,
          querystring: z.object({
            ...pageQuery,
            type: z.string().max(512).optional(),
            vm_id: idSchema.optional(),
            since: z.iso.datetime({ offset: true }).optional(),
            tenant: z.string().min(1).max(200).optional(),
            after: positionSchema.optional(),
          }),
          response: {
            200: z.object({ events: z.array(environmentEventSchema), next_cursor: z.string().nullable() }),
            ...problemResponses,
          },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        let tenantId: string | undefined;
        if (req.caller.admin) tenantId = req.query.tenant;
        else {
          if (req.query.tenant !== undefined && req.query.tenant !== req.caller.tenantId)
            throw new ForbiddenError('a tenant key reads its own events only; leave out tenant= or use the admin key');
          tenantId = req.caller.tenantId;
        }
        const events = req.query.type?.split(',').map((t) => t.trim());
        const unknown = events?.filter((t) => !FEED_EVENT_NAMES.includes(t)) ?? [];
        if (unknown.length > 0)
          throw new ValidationError(`unknown event type ${unknown.join(', ')}: one of ${FEED_EVENT_NAMES.join(', ')}`, [
            { path: 'querystring.type', message: 'unknown event type' },
          ]);
        const after = decodeCursor(req.query.cursor, positionSchema);
        const rows = await queryVmEvents(deps.pool, {
          tenantId,
          vmId: req.query.vm_id,
          events,
          since: req.query.since !== undefined ? new Date(req.query.since) : undefined,
          after,
          limit: req.query.limit,
        });
        const last = rows.at(-1);
        return {
          events: rows as Array<z.infer<typeof environmentEventSchema>>,
          next_cursor: rows.length === req.query.limit && last ? encodeCursor(last.id) : null,
        };
      },
    );

    app.post(
      '/v1/hosts/:id/drain',
      {
        // Admin only, checked before the body is read (as the host routes do for their whole scope).
        // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
        onRequest: async (req) => requireAdmin(req.caller),
        schema: {
          tags: ['hosts'],
          summary: 'Drain a host: cordon it, then destroy its running VMs with reason evicted',
          params: z.object({ id: idSchema }),
          response: {
            200: z.object({
              host_id: z.string(),
              evicted: z.array(z.string()),
              pending: z.array(z.string()),
              failed: z.array(z.object({ vm_id: z.string(), code: z.string(), message: z.string() })),
            }),
            ...problemResponses,
          },
        },
      },
      async (req) => deps.lifecycle.drain(req.params.id, commandMeta(req)),
    );
  };
}
