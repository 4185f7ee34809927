import { z } from 'zod';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

export const snapshotModeSchema = z.enum(['manual', 'build', 'checkpoint', 'migrate']);
export type SnapshotMode = z.infer<typeof snapshotModeSchema>;
export const snapshotStateSchema = z.enum(['creating', 'ready', 'failed', 'restoring', 'deleted']);
export type SnapshotState = z.infer<typeof snapshotStateSchema>;
/** Empty reads as disk (seed SnapshotKind). */
export const snapshotKindSchema = z.enum(['disk', 'live']);
export type SnapshotKind = z.infer<typeof snapshotKindSchema>;
export const exportStatusSchema = z.enum(['pending', 'running', 'done', 'failed']);
export type ExportStatus = z.infer<typeof exportStatusSchema>;
export const snapshotDeleteReasonSchema = z.enum(['client', 'retention', 'idle', 'lru', 'migrate', 'fork']);
export type SnapshotDeleteReason = z.infer<typeof snapshotDeleteReasonSchema>;

/** Layer keys are derived client-side from a recipe: an opaque, URL-safe token. */
export const layerKeySchema = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$/, 'a layer key of 1-200 letters, digits, ".", "_", ":" or "-"');
export const digestSchema = z.string().regex(/^[0-9a-f]{64}$/, 'a lowercase hex sha256');

const at = z.iso.datetime({ offset: true });

export const exportRecordSchema = z.object({
  destination: z.string().min(1).max(2048),
  status: exportStatusSchema,
  requested_at: at,
  updated_at: at,
  last_error: z.string().optional(),
});
export type ExportRecord = z.infer<typeof exportRecordSchema>;

/** What was asked of the agent; the kind actually produced is in SnapshotTaken. */
export const agentAskSchema = z.object({ live: z.boolean(), diff: z.boolean(), keep_paused: z.boolean(), shrink: z.boolean() });

export const snapshotRequestedSchema = z.object({
  type: z.literal('SnapshotRequested'),
  data: z.object({
    snapshot_id: idSchema,
    vm_id: idSchema,
    tenant_id: z.string().min(1),
    task_id: z.string().optional(),
    host_id: idSchema,
    arch: z.string(),
    mode: snapshotModeSchema,
    comment: z.string(),
    metadata: z.record(z.string(), z.string()),
    retention_until: at.optional(),
    parent_snapshot_id: idSchema.optional(),
    layer_key: layerKeySchema.optional(),
    ask: agentAskSchema,
    /** Whether a quota reservation on tenant-<id> backs this snapshot (build artifacts are not counted). */
    quota_counted: z.boolean(),
    at,
  }),
});

export const snapshotTakenSchema = z.object({
  type: z.literal('SnapshotTaken'),
  data: z.object({
    snapshot_id: idSchema,
    digest: z.string(),
    size_bytes: z.number().int().nonnegative(),
    /** From the agent's answer, never from the request. */
    kind: snapshotKindSchema,
    files: z.record(z.string(), z.string()).optional(),
    /** How long the guest was frozen for it (a live snapshot's pause window), as the agent measured it. */
    pause_ms: z.number().int().nonnegative().optional(),
    at,
  }),
});

export const snapshotFailedSchema = z.object({
  type: z.literal('SnapshotFailed'),
  data: z.object({ snapshot_id: idSchema, error: z.string(), error_code: z.string().optional(), at }),
});

/** A copy of the artifact committed on another host (agent-to-agent pull, digest verified there). */
export const artifactMovedSchema = z.object({
  type: z.literal('SnapshotArtifactMoved'),
  data: z.object({
    snapshot_id: idSchema,
    from_host_id: idSchema,
    to_host_id: idSchema,
    size_bytes: z.number().int().nonnegative(),
    kind: snapshotKindSchema,
    duration_ms: z.number().int().nonnegative(),
    at,
  }),
});

export const artifactMoveFailedSchema = z.object({
  type: z.literal('SnapshotArtifactMoveFailed'),
  data: z.object({
    snapshot_id: idSchema,
    from_host_id: idSchema,
    to_host_id: idSchema,
    error: z.string(),
    error_code: z.string().optional(),
    at,
  }),
});

/** A host's copy removed (GC, or the delete that follows SnapshotDeleted). */
export const artifactDroppedSchema = z.object({
  type: z.literal('SnapshotArtifactDropped'),
  data: z.object({ snapshot_id: idSchema, host_id: idSchema, at }),
});

/** A cache hit or a boot from it: what idle collection and LRU eviction read. */
export const snapshotUsedSchema = z.object({
  type: z.literal('SnapshotUsed'),
  data: z.object({ snapshot_id: idSchema, at }),
});

export const snapshotDeletedSchema = z.object({
  type: z.literal('SnapshotDeleted'),
  data: z.object({ snapshot_id: idSchema, reason: snapshotDeleteReasonSchema, forced: z.boolean(), at }),
});

export const exportRequestedSchema = z.object({
  type: z.literal('SnapshotExportRequested'),
  data: z.object({ snapshot_id: idSchema, destination: z.string().min(1).max(2048), at }),
});

export const exportUpdatedSchema = z.object({
  type: z.literal('SnapshotExportUpdated'),
  data: z.object({
    snapshot_id: idSchema,
    destination: z.string().min(1).max(2048),
    status: exportStatusSchema,
    error: z.string().optional(),
    at,
  }),
});

export const snapshotEventSchema = z.discriminatedUnion('type', [
  snapshotRequestedSchema,
  snapshotTakenSchema,
  snapshotFailedSchema,
  artifactMovedSchema,
  artifactMoveFailedSchema,
  artifactDroppedSchema,
  snapshotUsedSchema,
  snapshotDeletedSchema,
  exportRequestedSchema,
  exportUpdatedSchema,
]);
export type SnapshotEvent = z.infer<typeof snapshotEventSchema>;
export type SnapshotEventType = SnapshotEvent['type'];
export const SNAPSHOT_EVENT_TYPES: readonly SnapshotEventType[] = snapshotEventSchema.options.map((o) => o.shape.type.value);

export function isSnapshotEventType(type: string): type is SnapshotEventType {
  return (SNAPSHOT_EVENT_TYPES as readonly string[]).includes(type);
}

export function parseSnapshotEvent(type: string, data: unknown): SnapshotEvent {
  return parseStoredEvent(snapshotEventSchema, type, data);
}

export const SNAPSHOT_STREAM_PREFIX = 'snapshot-';
export const TENANT_STREAM_PREFIX = 'tenant-';
