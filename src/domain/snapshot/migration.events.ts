import { z } from 'zod';
import type { Decider } from '../decider.js';
import { idSchema } from '../ids.js';

/**
 * The steps of a cold migration, written to the VM's own stream so it reads
 * as one story (the VM decider ignores them; only VmMigrated moves the VM).
 */
export const migrationStepSchema = z.enum(['snapshot', 'place', 'move', 'boot', 'switch', 'destroy_source', 'cleanup']);
export type MigrationStep = z.infer<typeof migrationStepSchema>;

const at = z.iso.datetime({ offset: true });

export const migrationEventSchema = z.discriminatedUnion('type', [
  z.object({ type: z.literal('VmMigrationStarted'), data: z.object({ vm_id: idSchema, from_host_id: idSchema, target_host_id: idSchema.optional(), live: z.boolean(), at }) }),
  z.object({ type: z.literal('VmMigrationStepCompleted'), data: z.object({ vm_id: idSchema, step: migrationStepSchema, detail: z.record(z.string(), z.string()), at }) }),
  z.object({ type: z.literal('VmMigrationFailed'), data: z.object({ vm_id: idSchema, step: migrationStepSchema, error: z.string(), error_code: z.string().optional(), at }) }),
]);
export type MigrationEvent = z.infer<typeof migrationEventSchema>;

type Omit_at<E> = E extends { type: infer T; data: infer D } ? { type: T; data: Omit<D, 'at'> } : never;
export type MigrationCommand = Omit_at<MigrationEvent>;

/** Records a step as it happened: no state to check, the flow owns the order. */
export const migrationRecorder: Decider<MigrationCommand, MigrationEvent, null> = {
  decide: (c, _s, ctx) => [{ ...c, data: { ...c.data, at: ctx.now.toISOString() } } as MigrationEvent],
  evolve: (s) => s,
  initialState: null,
};
