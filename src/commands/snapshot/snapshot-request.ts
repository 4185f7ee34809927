import { z } from 'zod';
import { ValidationError } from '@fleet/agent-protocol';
import { layerKeySchema, snapshotModeSchema } from '../../domain/snapshot/snapshot.events.js';

/** Metadata keys the service writes itself; a caller may not set them. */
export const RESERVED_METADATA_KEYS = ['comment', 'vm_id', 'mode', 'host_id', 'arch', 'layer_key', 'tenant_id', 'kind'] as const;

const RETENTION_MIN = Date.parse('0001-01-01T00:00:00Z');
const RETENTION_MAX = Date.parse('9999-12-31T23:59:59Z');
const RETENTION_MAX_S = 100 * 366 * 24 * 3600;

export const createSnapshotRequestSchema = z
  .object({
    mode: snapshotModeSchema.default('manual'),
    comment: z.string().max(1024).default(''),
    metadata: z
      .record(z.string().regex(/^[A-Za-z0-9_.-]{1,64}$/, 'a metadata key of 1-64 letters, digits, _ . -'), z.string().max(4096))
      .default({}),
    /** Absolute expiry; or retention_s from now; neither: the fleet default. */
    // Bounded to what a Postgres timestamptz and the event schema both take: one outside (year 0000, say) would be
    // recorded and then stop the snapshots read model at that event.
    retention_until: z.iso
      .datetime({ offset: true })
      .refine((v) => Date.parse(v) >= RETENTION_MIN && Date.parse(v) <= RETENTION_MAX, 'a time between 0001-01-01 and 9999-12-31 (UTC)')
      .optional(),
    retention_s: z.number().int().positive().max(RETENTION_MAX_S, 'at most 100 years').optional(),
    no_lineage: z.boolean().default(false),
    live: z.boolean().default(false),
    diff: z.boolean().default(false),
    keep_paused: z.boolean().default(false),
    shrink: z.boolean().default(false),
    layer_key: layerKeySchema.optional(),
    exports: z
      .array(z.object({ destination: z.string().min(1).max(2048) }))
      .max(16)
      .default([]),
  })
  .strict()
  .superRefine((r, ctx) => {
    for (const k of Object.keys(r.metadata)) {
      if ((RESERVED_METADATA_KEYS as readonly string[]).includes(k))
        ctx.addIssue({ code: 'custom', path: ['metadata', k], message: `"${k}" is reserved: the service sets it` });
    }
    if (r.retention_until !== undefined && r.retention_s !== undefined)
      ctx.addIssue({ code: 'custom', path: ['retention_s'], message: 'give retention_until or retention_s, not both' });
    if (r.diff && !r.live) ctx.addIssue({ code: 'custom', path: ['diff'], message: 'a diff snapshot needs live: true' });
    if (r.keep_paused && !r.diff)
      ctx.addIssue({ code: 'custom', path: ['keep_paused'], message: 'keep_paused applies to a diff snapshot only' });
    if (r.layer_key !== undefined && r.mode !== 'build')
      ctx.addIssue({ code: 'custom', path: ['layer_key'], message: 'a layer is a build artifact: set mode "build" with layer_key' });
  });
export type CreateSnapshotRequest = z.input<typeof createSnapshotRequestSchema>;

export function assertLayerKey(key: string): void {
  if (!layerKeySchema.safeParse(key).success)
    throw new ValidationError(
      `layer key ${JSON.stringify(key.slice(0, 80))} is invalid: use 1-200 letters, digits, ".", "_", ":" or "-"`,
      [{ path: 'params.key', message: 'invalid layer key' }],
      'INVALID_LAYER_KEY',
    );
}
