import { z } from 'zod';
import { idSchema } from '../ids.js';
import { parseStoredEvent } from '../stored-event.js';

/**
 * The steps of a cold migration, written to the VM's own stream so it reads
 * as one story (the VM decider ignores them; only VmMigrated moves the VM).
 * `switch` is VmMigrated itself, never a step event of its own.
 */
export const migrationStepSchema = z.enum(['snapshot', 'place', 'move', 'boot', 'switch', 'destroy_source', 'cleanup']);
export type MigrationStep = z.infer<typeof migrationStepSchema>;
export const MIGRATION_STEPS: readonly MigrationStep[] = migrationStepSchema.options;

const at = z.iso.datetime({ offset: true });

export const migrationEventSchema = z.discriminatedUnion('type', [
  z.object({
    type: z.literal('VmMigrationStarted'),
    data: z.object({
      vm_id: idSchema,
      from_host_id: idSchema,
      target_host_id: idSchema.optional(),
      live: z.boolean(),
      /** Post-copy: the VM switches to the target before its memory is there; `destroy_source` waits until every page is. */
      lazy: z.boolean().optional(),
      at,
    }),
  }),
  z.object({
    type: z.literal('VmMigrationStepCompleted'),
    data: z.object({
      vm_id: idSchema,
      step: migrationStepSchema,
      detail: z.record(z.string(), z.string()),
      /** A live migration's `boot` step: from the source's freeze to the processes running on the target. */
      downtime_ms: z.number().int().nonnegative().optional(),
      at,
    }),
  }),
  z.object({
    type: z.literal('VmMigrationFailed'),
    data: z.object({ vm_id: idSchema, step: migrationStepSchema, error: z.string(), error_code: z.string().optional(), at }),
  }),
]);
export type MigrationEvent = z.infer<typeof migrationEventSchema>;
export type MigrationEventType = MigrationEvent['type'];
export const MIGRATION_EVENT_TYPES: readonly MigrationEventType[] = migrationEventSchema.options.map((o) => o.shape.type.value);

export function parseMigrationEvent(type: string, data: unknown): MigrationEvent {
  return parseStoredEvent(migrationEventSchema, type, data);
}

export function isMigrationEventType(type: string): type is MigrationEventType {
  return (MIGRATION_EVENT_TYPES as readonly string[]).includes(type);
}
