import { z } from 'zod';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

/**
 * The ingress route table's events (the seed's IngressProxy: Publish,
 * AdoptFrom, Unpublish), on the VM's own stream so a publish is decided
 * against the VM's lifecycle at one revision: a route is never published
 * for a VM whose destroy has already been recorded.
 */

const at = z.iso.datetime({ offset: true });

/** One published guest port: where the ingress sends it now (the host agent's per-sandbox proxy port). */
export const ingressRouteSchema = z.object({
  as: z.string(),
  port: z.number().int().min(1).max(65535),
  public: z.boolean(),
  /** The host-level endpoint, e.g. http://127.0.0.1:41231; never shown to tenants. */
  target: z.string(),
});
export type IngressRoute = z.infer<typeof ingressRouteSchema>;

export const ingressPublishedSchema = z.object({
  type: z.literal('IngressPublished'),
  data: z.object({
    vm_id: idSchema,
    tenant_id: z.string().min(1),
    host_id: idSchema,
    routes: z.array(ingressRouteSchema),
    /** sha256 (hex) of the traffic token: what the proxies compare against; the token itself is only sealed. */
    token_sha256: z.string().regex(/^[0-9a-f]{64}$/),
    /** AES-256-GCM ciphertext of the traffic token, for its owner to read back. */
    token_encrypted: z.string(),
    at,
  }),
});

/** The routes now point at another host (a cold migration), taken over from `adopt_from` by name. */
export const ingressAdoptedSchema = z.object({
  type: z.literal('IngressAdopted'),
  data: z.object({
    vm_id: idSchema,
    adopt_from: z.object({ vm_id: idSchema, host_id: idSchema }),
    host_id: idSchema,
    routes: z.array(ingressRouteSchema),
    at,
  }),
});

export const ingressUnpublishedSchema = z.object({
  type: z.literal('IngressUnpublished'),
  data: z.object({ vm_id: idSchema, at }),
});

export const ingressEventSchema = z.discriminatedUnion('type', [ingressPublishedSchema, ingressAdoptedSchema, ingressUnpublishedSchema]);
export type IngressEvent = z.infer<typeof ingressEventSchema>;
export type IngressPublished = z.infer<typeof ingressPublishedSchema>;
export type IngressAdopted = z.infer<typeof ingressAdoptedSchema>;
export type IngressUnpublished = z.infer<typeof ingressUnpublishedSchema>;
export const INGRESS_EVENT_TYPES: readonly IngressEvent['type'][] = ingressEventSchema.options.map((o) => o.shape.type.value);

export function isIngressEventType(type: string): type is IngressEvent['type'] {
  return (INGRESS_EVENT_TYPES as readonly string[]).includes(type);
}

export function parseIngressEvent(type: string, data: unknown): IngressEvent {
  return parseStoredEvent(ingressEventSchema, type, data);
}
