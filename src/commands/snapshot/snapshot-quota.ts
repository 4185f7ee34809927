import { KeyedQueue } from '../keyed-queue.js';
import { tenantAggregate } from '../../domain/tenant/tenant.aggregate.js';
import {
  QuotaExceededError,
  quotaUsage,
  type QuotaLimits,
  type QuotaPool,
  type TenantCommand,
} from '../../domain/tenant/tenant.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta } from '../command-handler.js';
import type { SnapshotConfig } from './snapshot-types.js';

/** The per-tenant snapshot quota (`tenant-<id>`): reservations before an archive, its real size after, releases. */
export class SnapshotQuota {
  private readonly tenantQueues = new KeyedQueue();
  private readonly quotaTenantHandler: BoundOf<typeof tenantAggregate>;

  /** quotaHandler: reservations retry many times, losing a race to a sibling is the normal case, not an error. */
  constructor(
    quotaHandler: CommandHandler,
    private readonly config: SnapshotConfig,
  ) {
    this.quotaTenantHandler = bindAggregate(quotaHandler, tenantAggregate);
  }

  /** Reserves `expected` bytes in `pool`; returns the headroom the archive may use (max_bytes less the others), undefined without a byte limit. */
  async reserve(
    tenantId: string,
    snapshotId: string,
    meta: CommandMeta,
    pool: QuotaPool,
    limits: QuotaLimits,
    expected: number,
  ): Promise<number | undefined> {
    const r = await this.onTenant(tenantId, () =>
      this.quotaTenantHandler.handle(
        tenantId,
        {
          type: 'ReserveSnapshotQuota',
          data: { tenant_id: tenantId, snapshot_id: snapshotId, limits, pool, expected_bytes: expected },
        } satisfies TenantCommand,
        meta,
      ),
    );
    if (limits.max_bytes <= 0) return undefined;
    const others = quotaUsage(r.state, pool).bytes - (r.state.reservations.get(snapshotId) ?? r.state.builds.get(snapshotId) ?? 0);
    return Math.max(1, limits.max_bytes - others);
  }

  async release(tenantId: string, snapshotId: string, meta: CommandMeta): Promise<void> {
    await this.onTenant(tenantId, () =>
      this.quotaTenantHandler.handle(
        tenantId,
        { type: 'ReleaseSnapshotQuota', data: { tenant_id: tenantId, snapshot_id: snapshotId } } satisfies TenantCommand,
        meta,
      ),
    );
  }

  /** The real size replaces the estimate, and is refused if siblings took the room meanwhile: never over quota. */
  async size(tenantId: string, snapshotId: string, sizeBytes: number, limits: QuotaLimits, meta: CommandMeta): Promise<void> {
    await this.onTenant(tenantId, () =>
      this.quotaTenantHandler.handle(
        tenantId,
        {
          type: 'SizeSnapshotQuota',
          data: { tenant_id: tenantId, snapshot_id: snapshotId, size_bytes: sizeBytes, limits },
        } satisfies TenantCommand,
        meta,
      ),
    );
  }

  /** The error for an archive that outgrew the pool's headroom, with the pool's usage now. */
  async exceeded(tenantId: string, limits: QuotaLimits, pool: QuotaPool): Promise<QuotaExceededError> {
    const { state } = await this.quotaTenantHandler.load(tenantId);
    return new QuotaExceededError(tenantId, 'bytes', limits, quotaUsage(state, pool), { pool });
  }

  async usage(tenantId: string): Promise<{
    count: number;
    bytes: number;
    max_count: number;
    max_bytes: number;
    builds: { count: number; bytes: number; max_count: number; max_bytes: number };
  }> {
    const { state } = await this.quotaTenantHandler.load(tenantId);
    return {
      ...quotaUsage(state, 'snapshots'),
      ...this.config.quota,
      builds: { ...quotaUsage(state, 'builds'), ...this.config.buildQuota },
    };
  }

  /** Writers of one tenant stream in this process go one at a time; other processes lose a revision conflict and retry. */
  private onTenant<T>(tenantId: string, fn: () => Promise<T>): Promise<T> {
    return this.tenantQueues.run(tenantId, fn);
  }
}
