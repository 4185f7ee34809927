import { z } from 'zod';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

/**
 * A VM's health verdict (the seed's HealthStatus), on its own
 * `vmhealth-<vm id>` stream so probes never contend with the VM's lifecycle
 * stream. Only changes of state are recorded: a probe passing every 30 s for
 * a month is one event, not ninety thousand.
 */
export const healthStateSchema = z.enum(['starting', 'healthy', 'unhealthy']);
export type HealthState = z.infer<typeof healthStateSchema>;

export const VM_HEALTH_STREAM_PREFIX = 'vmhealth-';

export const vmHealthChangedSchema = z.object({
  type: z.literal('VmHealthChanged'),
  data: z.object({
    vm_id: idSchema,
    state: healthStateSchema,
    /** When the probe entered `state`. */
    since: z.iso.datetime({ offset: true }),
    /** Consecutive failed attempts; 0 while passing. */
    failures: z.number().int().nonnegative(),
    /** The last failed attempt's detail; empty while passing. */
    message: z.string().max(2000),
  }),
});
export type VmHealthChanged = z.infer<typeof vmHealthChangedSchema>;
export type HealthEvent = VmHealthChanged;

export function isHealthEventType(type: string): type is HealthEvent['type'] {
  return type === 'VmHealthChanged';
}

export function parseHealthEvent(type: string, data: unknown): HealthEvent {
  return parseStoredEvent(vmHealthChangedSchema, type, data);
}
