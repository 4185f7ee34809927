import { randomBytes, randomUUID } from 'node:crypto';
import type { FastifyInstance, FastifyRequest } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { AppError, ForbiddenError, NotFoundError } from '@fleet/agent-protocol';
import type { EventStore } from '../../domain/event-store.port.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import { idSchema } from '../../domain/ids.js';
import { WEBHOOK_EVENT_TYPES, webhookEventTypeSchema, webhookSecretContext, webhookStream } from '../../domain/webhook/webhook.events.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import {
  getWebhook,
  listDeliveries,
  listWebhooks,
  retryDeadDelivery,
  type WebhookRow,
} from '../../projections/webhooks/webhooks.queries.js';
import { assertAllowedTarget } from '../webhooks/target-guard.js';
import { problemResponses } from './common.js';

export interface WebhookRoutesDeps {
  readonly store: EventStore;
  readonly pool: Pool;
  readonly secrets: SecretBox;
  /** The webhook consumer's runner: a create is answered once it knows the webhook. */
  readonly runner: ProjectionRunner;
  readonly allowPrivate: boolean;
  readonly maxPerTenant: number;
  readonly readYourWritesTimeoutMs: number;
}

const webhookOut = z.object({
  id: z.string(),
  tenant_id: z.string(),
  url: z.string(),
  event_types: z.array(z.string()),
  created_at: z.string(),
});

const deliveryOut = z.object({
  id: z.string(),
  vm_id: z.string(),
  event: z.string(),
  position: z.string(),
  status: z.enum(['pending', 'delivered', 'dead', 'cancelled']),
  attempts: z.number(),
  next_attempt_at: z.string().nullable(),
  last_status: z.number().nullable(),
  last_error: z.string().nullable(),
  created_at: z.string(),
  delivered_at: z.string().nullable(),
});

const params = z.object({ id: idSchema });

function toOut(w: WebhookRow): z.infer<typeof webhookOut> {
  return { id: w.id, tenant_id: w.tenant_id, url: w.url, event_types: w.event_types, created_at: w.created_at.toISOString() };
}

/**
 * `/v1/webhooks`: a tenant's signed webhooks (docs/webhooks.md). The
 * subscription is an event on `webhook-<id>`; the secret is returned once,
 * at creation, and kept sealed with the token-encryption key. Another
 * tenant's webhook is a 404.
 */
export function webhookRoutes(deps: WebhookRoutesDeps) {
  const visible = async (req: FastifyRequest, id: string): Promise<WebhookRow> => {
    const w = await getWebhook(deps.pool, id);
    if (!w || w.deleted_at !== null || (!req.caller.admin && w.tenant_id !== req.caller.tenantId))
      throw new NotFoundError('WEBHOOK_NOT_FOUND', `webhook ${id} does not exist`, { webhook_id: id });
    return w;
  };

  return (scope: FastifyInstance): void => {
    const app = scope.withTypeProvider<ZodTypeProvider>();

    app.post(
      '/v1/webhooks',
      {
        schema: {
          tags: ['webhooks'],
          summary: "Subscribe a URL to the tenant's VM lifecycle events; the answer carries the signing secret, the only time it is shown",
          body: z
            .object({
              url: z.string().min(1).max(2048),
              /** Default: every type. */
              event_types: z.array(webhookEventTypeSchema).min(1).max(WEBHOOK_EVENT_TYPES.length).optional(),
            })
            .strict(),
          response: { 201: webhookOut.extend({ secret: z.string(), position: z.string() }), ...problemResponses },
        },
      },
      async (req, reply) => {
        const tenant = req.caller.tenantId;
        const url = await assertAllowedTarget(req.body.url, deps.allowPrivate);
        if ((await listWebhooks(deps.pool, tenant)).length >= deps.maxPerTenant)
          throw new AppError('WEBHOOK_LIMIT_REACHED', 409, `a tenant has at most ${deps.maxPerTenant} webhooks (WEBHOOK_MAX_PER_TENANT)`, {
            limit: deps.maxPerTenant,
          });
        const id = `wh-${randomBytes(8).toString('hex')}`;
        const secret = `whsec_${randomBytes(32).toString('base64url')}`;
        const at = new Date().toISOString();
        const eventTypes = [...new Set(req.body.event_types ?? WEBHOOK_EVENT_TYPES)];
        const appended = await deps.store.append(
          webhookStream(id),
          [
            {
              id: randomUUID(),
              type: 'WebhookCreated',
              data: {
                webhook_id: id,
                tenant_id: tenant,
                url: url.toString(),
                event_types: eventTypes,
                secret_sealed: deps.secrets.seal(secret, webhookSecretContext(id)),
                at,
              },
              metadata: { correlationId: req.id, tenantId: tenant, actor: req.caller.actor, recordedAt: at },
            },
          ],
          'no_stream',
        );
        await deps.runner.waitFor(appended.position, deps.readYourWritesTimeoutMs);
        return reply.status(201).send({
          id,
          tenant_id: tenant,
          url: url.toString(),
          event_types: eventTypes,
          created_at: at,
          secret,
          position: appended.position,
        });
      },
    );

    app.get(
      '/v1/webhooks',
      { schema: { tags: ['webhooks'], summary: "The caller's webhooks", response: { 200: z.object({ webhooks: z.array(webhookOut) }) } } },
      async (req) => ({ webhooks: (await listWebhooks(deps.pool, req.caller.admin ? undefined : req.caller.tenantId)).map(toOut) }),
    );

    app.get(
      '/v1/webhooks/:id',
      {
        schema: {
          tags: ['webhooks'],
          summary: 'One webhook (never its secret)',
          params,
          response: { 200: webhookOut, ...problemResponses },
        },
      },
      async (req) => toOut(await visible(req, req.params.id)),
    );

    app.delete(
      '/v1/webhooks/:id',
      {
        schema: {
          tags: ['webhooks'],
          summary: 'Delete a webhook: nothing more is sent to it, pending retries included',
          params,
          response: { 200: z.object({ id: z.string(), deleted: z.literal(true) }), ...problemResponses },
        },
      },
      async (req) => {
        const w = await visible(req, req.params.id);
        const at = new Date().toISOString();
        const appended = await deps.store.append(
          webhookStream(w.id),
          [
            {
              id: randomUUID(),
              type: 'WebhookDeleted',
              data: { webhook_id: w.id, at },
              metadata: { correlationId: req.id, tenantId: w.tenant_id, actor: req.caller.actor, recordedAt: at },
            },
          ],
          'stream_exists',
        );
        await deps.runner.waitFor(appended.position, deps.readYourWritesTimeoutMs);
        return { id: w.id, deleted: true as const };
      },
    );

    app.get(
      '/v1/webhooks/:id/deliveries',
      {
        schema: {
          tags: ['webhooks'],
          summary: 'Deliveries of a webhook, newest first (status pending, delivered, dead, cancelled)',
          params,
          querystring: z.object({
            status: z.enum(['pending', 'delivered', 'dead', 'cancelled']).optional(),
            limit: z.coerce.number().int().min(1).max(500).default(100),
            /** The `next_cursor` of the previous page. */
            cursor: z
              .string()
              .regex(/^\d{1,18}$/, 'a cursor from a previous page')
              .optional(),
          }),
          response: { 200: z.object({ deliveries: z.array(deliveryOut), next_cursor: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        const w = await visible(req, req.params.id);
        const rows = await listDeliveries(deps.pool, w.id, {
          status: req.query.status,
          limit: req.query.limit,
          beforeSeq: req.query.cursor,
        });
        return {
          deliveries: rows.map((d) => ({
            id: d.id,
            vm_id: d.vm_id,
            event: d.event_type,
            position: d.position,
            status: d.status as 'pending' | 'delivered' | 'dead' | 'cancelled',
            attempts: d.attempts,
            next_attempt_at: d.status === 'pending' ? d.next_attempt_at.toISOString() : null,
            last_status: d.last_status,
            last_error: d.last_error,
            created_at: d.created_at.toISOString(),
            delivered_at: d.delivered_at?.toISOString() ?? null,
          })),
          next_cursor: rows.length === req.query.limit ? (rows.at(-1)?.seq ?? null) : null,
        };
      },
    );

    app.post(
      '/v1/webhooks/:id/deliveries/:delivery_id/retry',
      {
        schema: {
          tags: ['webhooks'],
          summary: 'Operator (admin key): send a dead delivery again, from attempt one',
          params: params.extend({ delivery_id: z.string().min(1).max(200) }),
          response: { 200: z.object({ id: z.string(), status: z.literal('pending') }), ...problemResponses },
        },
      },
      async (req) => {
        if (!req.caller.admin) throw new ForbiddenError('retrying a dead delivery is an operator action: use the admin key');
        const w = await visible(req, req.params.id);
        if (!(await retryDeadDelivery(deps.pool, w.id, req.params.delivery_id)))
          throw new AppError(
            'DELIVERY_NOT_DEAD',
            409,
            `delivery ${req.params.delivery_id} of webhook ${w.id} is not dead (or does not exist)`,
          );
        return { id: req.params.delivery_id, status: 'pending' as const };
      },
    );
  };
}
