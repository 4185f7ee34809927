import { z } from 'zod';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

/**
 * Dead letters: work the reconciler gave up retrying on its own (the seed's
 * DeadLetterKind/Record). One `deadletter-<id>` stream per (kind, entity),
 * so the same stuck thing is one record however often it comes back.
 */
export const deadLetterKindSchema = z.enum(['orphan_destroy']);
export type DeadLetterKind = z.infer<typeof deadLetterKindSchema>;

export const DEADLETTER_STREAM_PREFIX = 'deadletter-';

const at = z.iso.datetime({ offset: true });

export const deadLetteredSchema = z.object({
  type: z.literal('DeadLettered'),
  data: z.object({
    id: idSchema,
    kind: deadLetterKindSchema,
    /** What the work was about: for orphan_destroy, the sandbox name on its host. */
    entity_id: z.string().min(1).max(256),
    host_id: idSchema,
    vm_id: z.string().optional(),
    reason: z.string(),
    error_code: z.string().optional(),
    /** Consecutive failed attempts that led here. */
    retry_count: z.number().int().nonnegative(),
    first_failed_at: at,
    at,
  }),
});

export const deadLetterRetryRequestedSchema = z.object({
  type: z.literal('DeadLetterRetryRequested'),
  data: z.object({ id: idSchema, actor: z.string(), at }),
});

export const deadLetterDiscardedSchema = z.object({
  type: z.literal('DeadLetterDiscarded'),
  data: z.object({ id: idSchema, actor: z.string(), note: z.string().max(1000).optional(), at }),
});

export const deadLetterResolvedSchema = z.object({
  type: z.literal('DeadLetterResolved'),
  /** How it ended: the work succeeded, or there was nothing left to do (the sandbox had gone). */
  data: z.object({ id: idSchema, outcome: z.enum(['succeeded', 'gone']), at }),
});

export const deadLetterEventSchema = z.discriminatedUnion('type', [
  deadLetteredSchema,
  deadLetterRetryRequestedSchema,
  deadLetterDiscardedSchema,
  deadLetterResolvedSchema,
]);
export type DeadLetterEvent = z.infer<typeof deadLetterEventSchema>;
export type DeadLetterEventType = DeadLetterEvent['type'];
export const DEADLETTER_EVENT_TYPES: readonly DeadLetterEventType[] = deadLetterEventSchema.options.map((o) => o.shape.type.value);

export function isDeadLetterEventType(type: string): type is DeadLetterEventType {
  return (DEADLETTER_EVENT_TYPES as readonly string[]).includes(type);
}

export function parseDeadLetterEvent(type: string, data: unknown): DeadLetterEvent {
  return parseStoredEvent(deadLetterEventSchema, type, data);
}
