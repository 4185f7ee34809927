import { z } from 'zod';
import { assertNever, type DecideContext, type Decider } from '../decider.js';
import { AppError } from '../errors.js';
import { parseStoredEvent } from '../stored-event.js';
import { idSchema } from '../ids.js';

/**
 * The per-tenant snapshot quota (`tenant-<id>`). Reservations are appended
 * at the revision the usage was computed on, so two concurrent snapshot
 * requests can never both take the last slot: the loser re-reads and is
 * refused. Only snapshots that count (creating/ready/restoring, build
 * artifacts excluded) are ever reserved here.
 */

const at = z.iso.datetime({ offset: true });

export const quotaReservedSchema = z.object({
  type: z.literal('SnapshotQuotaReserved'),
  data: z.object({ tenant_id: z.string().min(1), snapshot_id: idSchema, at }),
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
  | { readonly type: 'ReserveSnapshotQuota'; readonly data: { tenant_id: string; snapshot_id: string; limits: QuotaLimits } }
  | { readonly type: 'SizeSnapshotQuota'; readonly data: { tenant_id: string; snapshot_id: string; size_bytes: number } }
  | { readonly type: 'ReleaseSnapshotQuota'; readonly data: { tenant_id: string; snapshot_id: string } };

export interface TenantState {
  /** snapshot id → bytes counted (0 until the agent reports the size). */
  readonly reservations: ReadonlyMap<string, number>;
}

export const initialTenantState: TenantState = { reservations: new Map() };

export function quotaUsage(s: TenantState): { count: number; bytes: number } {
  let bytes = 0;
  for (const b of s.reservations.values()) bytes += b;
  return { count: s.reservations.size, bytes };
}

export class QuotaExceededError extends AppError {
  constructor(tenantId: string, what: 'count' | 'bytes', limits: QuotaLimits, usage: { count: number; bytes: number }) {
    const limit = what === 'count' ? limits.max_count : limits.max_bytes;
    const used = what === 'count' ? usage.count : usage.bytes;
    super(
      'QUOTA_EXCEEDED',
      429,
      `snapshot quota exceeded for tenant ${tenantId}: ${what === 'count' ? `${used} of ${limit} snapshots` : `${used} of ${limit} bytes`} in use (creating, ready or restoring; build artifacts not counted); delete a snapshot to make room`,
      { tenant_id: tenantId, limit_kind: what, limit, usage: { count: usage.count, bytes: usage.bytes }, max_count: limits.max_count, max_bytes: limits.max_bytes },
    );
  }
}

export function decideTenant(command: TenantCommand, state: TenantState, ctx: DecideContext): TenantEvent[] {
  const at = ctx.now.toISOString();
  const { tenant_id, snapshot_id } = command.data;
  switch (command.type) {
    case 'ReserveSnapshotQuota': {
      if (state.reservations.has(snapshot_id)) return [];
      const usage = quotaUsage(state);
      const l = command.data.limits;
      if (l.max_count > 0 && usage.count + 1 > l.max_count) throw new QuotaExceededError(tenant_id, 'count', l, usage);
      if (l.max_bytes > 0 && usage.bytes >= l.max_bytes) throw new QuotaExceededError(tenant_id, 'bytes', l, usage);
      return [{ type: 'SnapshotQuotaReserved', data: { tenant_id, snapshot_id, at } }];
    }
    case 'SizeSnapshotQuota': {
      const cur = state.reservations.get(snapshot_id);
      if (cur === undefined || cur === command.data.size_bytes) return [];
      return [{ type: 'SnapshotQuotaSized', data: { tenant_id, snapshot_id, size_bytes: command.data.size_bytes, at } }];
    }
    case 'ReleaseSnapshotQuota':
      if (!state.reservations.has(snapshot_id)) return [];
      return [{ type: 'SnapshotQuotaReleased', data: { tenant_id, snapshot_id, at } }];
    default:
      return assertNever(command, 'tenant command');
  }
}

export function evolveTenant(state: TenantState, event: TenantEvent): TenantState {
  const next = new Map(state.reservations);
  switch (event.type) {
    case 'SnapshotQuotaReserved':
      next.set(event.data.snapshot_id, 0);
      break;
    case 'SnapshotQuotaSized':
      if (next.has(event.data.snapshot_id)) next.set(event.data.snapshot_id, event.data.size_bytes);
      break;
    case 'SnapshotQuotaReleased':
      next.delete(event.data.snapshot_id);
      break;
    default:
      return assertNever(event, 'tenant event');
  }
  return { reservations: next };
}

export const tenantDecider: Decider<TenantCommand, TenantEvent, TenantState> = {
  decide: decideTenant,
  evolve: evolveTenant,
  initialState: initialTenantState,
};
