import { z } from 'zod';
import { idSchema } from '../ids.js';
import { parseStoredEvent } from '../stored-event.js';

/**
 * A tenant's webhook subscription, one stream per webhook (`webhook-<id>`).
 * The subscription is an event so the deliveries it causes are a pure
 * function of the log: a webhook receives exactly the events recorded after
 * it was created and before it was deleted, on every replay.
 */

/** What a subscription may ask for: the lifecycle events the webhook consumer carries (see webhook-outbox.projection.ts). */
export const WEBHOOK_EVENT_TYPES = [
  'vm.requested',
  'vm.placed',
  'vm.booting',
  'vm.booted',
  'vm.destroying',
  'vm.destroyed',
  'vm.failed',
  'vm.migrated',
  'vm.oom_killed',
] as const;
export const webhookEventTypeSchema = z.enum(WEBHOOK_EVENT_TYPES);
export type WebhookEventType = z.infer<typeof webhookEventTypeSchema>;

const at = z.iso.datetime({ offset: true });

export const webhookCreatedSchema = z.object({
  type: z.literal('WebhookCreated'),
  data: z.object({
    webhook_id: idSchema,
    tenant_id: z.string().min(1),
    url: z.url(),
    event_types: z.array(webhookEventTypeSchema).min(1),
    /** AES-256-GCM ciphertext of the signing secret (context `webhook-secret:<id>`); never the clear secret. */
    secret_sealed: z.string(),
    at,
  }),
});

export const webhookDeletedSchema = z.object({
  type: z.literal('WebhookDeleted'),
  data: z.object({ webhook_id: idSchema, at }),
});

export const webhookEventSchema = z.discriminatedUnion('type', [webhookCreatedSchema, webhookDeletedSchema]);
export type WebhookEvent = z.infer<typeof webhookEventSchema>;

export const webhookStream = (id: string): string => `webhook-${id}`;
export const webhookSecretContext = (id: string): string => `webhook-secret:${id}`;

export function parseWebhookEvent(type: string, data: unknown): WebhookEvent {
  return parseStoredEvent(webhookEventSchema, type, data);
}
