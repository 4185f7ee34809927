import { z } from 'zod';
import { checkpointIdSchema, sha256HexSchema } from '@fleet/agent-protocol';
import { idSchema } from '../ids.js';
import { parseStoredEvent } from '../stored-event.js';

/**
 * A VM's standby checkpoints (the seed's CheckpointInterval), on a
 * `vmstandby-<vm id>` stream of their own: a background tick never contends
 * with the VM's lifecycle, and the stream's expected revision is what keeps
 * two control-plane replicas from checkpointing the same VM twice.
 */
export const VM_STANDBY_STREAM_PREFIX = 'vmstandby-';

const at = z.iso.datetime({ offset: true });
const bytes = z.number().int().nonnegative();

export const standbyStartedSchema = z.object({
  type: z.literal('StandbyCheckpointStarted'),
  data: z.object({
    vm_id: idSchema,
    checkpoint_id: checkpointIdSchema,
    host_id: idSchema,
    standby_host_id: idSchema,
    /** Another replica may take over after this (the one that started it died mid-way). */
    until: at,
    at,
  }),
});

export const standbyTakenSchema = z.object({
  type: z.literal('StandbyCheckpointTaken'),
  data: z.object({
    vm_id: idSchema,
    checkpoint_id: checkpointIdSchema,
    host_id: idSchema,
    standby_host_id: idSchema,
    digest: sha256HexSchema,
    files: z.record(z.string(), sha256HexSchema),
    /** How long the VM was frozen for the dump. */
    pause_ms: bytes,
    /** Fetched by the standby host from the VM's host. */
    moved_bytes: bytes,
    /** Taken from the previous standby copy on the same host instead (files with the same sha256). */
    reused_bytes: bytes,
    /** The copy this one replaces (removed from its host afterwards), absent for the first. */
    supersedes: z.object({ checkpoint_id: checkpointIdSchema, standby_host_id: idSchema }).optional(),
    at,
  }),
});

export const standbyFailedSchema = z.object({
  type: z.literal('StandbyCheckpointFailed'),
  data: z.object({
    vm_id: idSchema,
    checkpoint_id: checkpointIdSchema,
    error: z.string().max(2000),
    error_code: z.string().optional(),
    at,
  }),
});

export const standbyDroppedSchema = z.object({
  type: z.literal('StandbyCheckpointDropped'),
  data: z.object({
    vm_id: idSchema,
    checkpoint_id: checkpointIdSchema,
    standby_host_id: idSchema,
    /** vm_gone: destroyed or failed; standby_unfit: its host can no longer take the VM (unregistered, no CRIU, or it runs the VM now). */
    reason: z.enum(['vm_gone', 'standby_unfit']),
    at,
  }),
});

export const standbyEventSchema = z.discriminatedUnion('type', [
  standbyStartedSchema,
  standbyTakenSchema,
  standbyFailedSchema,
  standbyDroppedSchema,
]);
export type StandbyEvent = z.infer<typeof standbyEventSchema>;

const TYPES: ReadonlySet<string> = new Set(standbyEventSchema.options.map((o) => o.shape.type.value));

export function isStandbyEventType(type: string): type is StandbyEvent['type'] {
  return TYPES.has(type);
}

export function parseStandbyEvent(type: string, data: unknown): StandbyEvent {
  return parseStoredEvent(standbyEventSchema, type, data);
}
