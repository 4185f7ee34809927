import { z } from 'zod';
import { assertNever, type DecideContext, type Decider } from '../decider.js';
import { AppError } from '@fleet/agent-protocol';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

/**
 * The per-tenant snapshot quotas (`tenant-<id>`), two pools: `snapshots`
 * (creating/ready/restoring, build artifacts excluded: SNAPSHOT_QUOTA_*)
 * and `builds` (mode "build" artifacts: BUILD_SNAPSHOT_QUOTA_*).
 * Reservations are appended at the revision the usage was computed on, so
 * two concurrent snapshot requests can never both take the last slot: the
 * loser re-reads and is refused. A reservation carries the expected archive
 * size (asked from the agent before archiving), so a snapshot that would not
 * fit is refused before any byte is written; the real size replaces it after,
 * and is refused in turn if the guest grew past the quota in between.
 */

const at = z.iso.datetime({ offset: true });

export const quotaPoolSchema = z.enum(['snapshots', 'builds']);
export type QuotaPool = z.infer<typeof quotaPoolSchema>;

export const quotaReservedSchema = z.object({
  type: z.literal('SnapshotQuotaReserved'),
  data: z.object({
    tenant_id: z.string().min(1),
    snapshot_id: idSchema,
    /** Absent in events written before build snapshots were counted: snapshots. */
    pool: quotaPoolSchema.optional(),
    /** Expected archive size counted until the real one is known; absent: 0. */
    expected_bytes: z.number().int().nonnegative().optional(),
    at,
  }),
});
export const quotaSizedSchema = z.object({
  type: z.literal('SnapshotQuotaSized'),
  data: z.object({ tenant_id: z.string().min(1), snapshot_id: idSchema, size_bytes: z.number().int().nonnegative(), at }),
});
export const quotaReleasedSchema = z.object({
  type: z.literal('SnapshotQuotaReleased'),
  data: z.object({ tenant_id: z.string().min(1), snapshot_id: idSchema, at }),
});

export const tenantEventSchema = z.discriminatedUnion('type', [quotaReservedSchema, quotaSizedSchema, quotaReleasedSchema]);
export type TenantEvent = z.infer<typeof tenantEventSchema>;
export const TENANT_EVENT_TYPES: readonly TenantEvent['type'][] = tenantEventSchema.options.map((o) => o.shape.type.value);

export function isTenantEventType(type: string): type is TenantEvent['type'] {
  return (TENANT_EVENT_TYPES as readonly string[]).includes(type);
}

export function parseTenantEvent(type: string, data: unknown): TenantEvent {
  return parseStoredEvent(tenantEventSchema, type, data);
}

export interface QuotaLimits {
  /** 0 disables. */
  readonly max_count: number;
  /** 0 disables. */
  readonly max_bytes: number;
}

export type TenantCommand =
  | {
      readonly type: 'ReserveSnapshotQuota';
      readonly data: { tenant_id: string; snapshot_id: string; limits: QuotaLimits; pool?: QuotaPool; expected_bytes?: number };
    }
  /** With limits, a size that takes the pool past max_bytes is refused (QUOTA_EXCEEDED) and nothing is appended. */
  | {
      readonly type: 'SizeSnapshotQuota';
      readonly data: { tenant_id: string; snapshot_id: string; size_bytes: number; limits?: QuotaLimits };
    }
  | { readonly type: 'ReleaseSnapshotQuota'; readonly data: { tenant_id: string; snapshot_id: string } };

export interface TenantState {
  /** Pool `snapshots`: snapshot id → bytes counted (the expected size until the agent reports the real one). */
  readonly reservations: ReadonlyMap<string, number>;
  /** Pool `builds`, likewise. */
  readonly builds: ReadonlyMap<string, number>;
}

export const initialTenantState: TenantState = { reservations: new Map(), builds: new Map() };

const poolOf = (s: TenantState, pool: QuotaPool): ReadonlyMap<string, number> => (pool === 'builds' ? s.builds : s.reservations);

export function quotaUsage(s: TenantState, pool: QuotaPool = 'snapshots'): { count: number; bytes: number } {
  const m = poolOf(s, pool);
  let bytes = 0;
  for (const b of m.values()) bytes += b;
  return { count: m.size, bytes };
}

export class QuotaExceededError extends AppError {
  constructor(
    tenantId: string,
    what: 'count' | 'bytes',
    limits: QuotaLimits,
    usage: { count: number; bytes: number },
    opts: { pool?: QuotaPool; needed_bytes?: number } = {},
  ) {
    const pool = opts.pool ?? 'snapshots';
    const limit = what === 'count' ? limits.max_count : limits.max_bytes;
    const used = what === 'count' ? usage.count : usage.bytes;
    const builds = pool === 'builds';
    const needs = what === 'bytes' && opts.needed_bytes ? `, this one needs ${opts.needed_bytes}` : '';
    super(
      'QUOTA_EXCEEDED',
      429,
      builds
        ? `build snapshot quota exceeded for tenant ${tenantId}: ${what === 'count' ? `${used} of ${limit} build snapshots` : `${used} of ${limit} bytes`} in use${needs}; delete a layer to make room`
        : `snapshot quota exceeded for tenant ${tenantId}: ${what === 'count' ? `${used} of ${limit} snapshots` : `${used} of ${limit} bytes`} in use${needs} (creating, ready or restoring; build artifacts not counted); delete a snapshot to make room`,
      {
        tenant_id: tenantId,
        pool,
        limit_kind: what,
        limit,
        usage: { count: usage.count, bytes: usage.bytes },
        max_count: limits.max_count,
        max_bytes: limits.max_bytes,
        ...(opts.needed_bytes !== undefined ? { needed_bytes: opts.needed_bytes } : {}),
      },
    );
  }
}

export function decideTenant(command: TenantCommand, state: TenantState, ctx: DecideContext): TenantEvent[] {
  const at = ctx.now.toISOString();
  const { tenant_id, snapshot_id } = command.data;
  switch (command.type) {
    case 'ReserveSnapshotQuota': {
      if (state.reservations.has(snapshot_id) || state.builds.has(snapshot_id)) return [];
      const pool = command.data.pool ?? 'snapshots';
      const expected = command.data.expected_bytes ?? 0;
      const usage = quotaUsage(state, pool);
      const l = command.data.limits;
      if (l.max_count > 0 && usage.count + 1 > l.max_count) throw new QuotaExceededError(tenant_id, 'count', l, usage, { pool });
      if (l.max_bytes > 0 && (usage.bytes >= l.max_bytes || usage.bytes + expected > l.max_bytes))
        throw new QuotaExceededError(tenant_id, 'bytes', l, usage, { pool, needed_bytes: expected });
      const data = {
        tenant_id,
        snapshot_id,
        ...(pool === 'builds' ? { pool } : {}),
        ...(expected > 0 ? { expected_bytes: expected } : {}),
        at,
      };
      return [{ type: 'SnapshotQuotaReserved', data }];
    }
    case 'SizeSnapshotQuota': {
      const pool: QuotaPool = state.builds.has(snapshot_id) ? 'builds' : 'snapshots';
      const cur = poolOf(state, pool).get(snapshot_id);
      const size = command.data.size_bytes;
      if (cur === undefined || cur === size) return [];
      const l = command.data.limits;
      if (l && l.max_bytes > 0 && size > cur) {
        const usage = quotaUsage(state, pool);
        const others = { count: usage.count - 1, bytes: usage.bytes - cur };
        if (others.bytes + size > l.max_bytes) throw new QuotaExceededError(tenant_id, 'bytes', l, others, { pool, needed_bytes: size });
      }
      return [{ type: 'SnapshotQuotaSized', data: { tenant_id, snapshot_id, size_bytes: size, at } }];
    }
    case 'ReleaseSnapshotQuota':
      if (!state.reservations.has(snapshot_id) && !state.builds.has(snapshot_id)) return [];
      return [{ type: 'SnapshotQuotaReleased', data: { tenant_id, snapshot_id, at } }];
    default:
      return assertNever(command, 'tenant command');
  }
}

export function evolveTenant(state: TenantState, event: TenantEvent): TenantState {
  const snapshots = new Map(state.reservations);
  const builds = new Map(state.builds);
  const id = event.data.snapshot_id;
  switch (event.type) {
    case 'SnapshotQuotaReserved':
      (event.data.pool === 'builds' ? builds : snapshots).set(id, event.data.expected_bytes ?? 0);
      break;
    case 'SnapshotQuotaSized':
      if (snapshots.has(id)) snapshots.set(id, event.data.size_bytes);
      if (builds.has(id)) builds.set(id, event.data.size_bytes);
      break;
    case 'SnapshotQuotaReleased':
      snapshots.delete(id);
      builds.delete(id);
      break;
    default:
      return assertNever(event, 'tenant event');
  }
  return { reservations: snapshots, builds };
}

export const tenantDecider: Decider<TenantCommand, TenantEvent, TenantState> = {
  decide: decideTenant,
  evolve: evolveTenant,
  initialState: initialTenantState,
};
