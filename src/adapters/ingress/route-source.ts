import type { Pool } from 'pg';
import { getIngressTarget, getRunningVmPlacement, type IngressTargetRow } from '../../projections/ingress/ingress.queries.js';

/** Where a proxy reads the route table; `fresh` skips any cache. */
export interface RouteSource {
  lookup(vmId: string, fresh?: boolean): Promise<IngressTargetRow | undefined>;
  /** A running VM that publishes no ports: only a port handler that authenticates itself serves it. Not cached. */
  lookupRunning(vmId: string): Promise<Pick<IngressTargetRow, 'vm_id' | 'tenant_id' | 'host_id' | 'host_url'> | undefined>;
}

/**
 * The `ingress_routes` read model with a short per-VM cache: every replica
 * reads the same table, so they agree once the cache turns over (`ttlMs`,
 * 0 for none). Misses are not cached, so a route published a moment ago
 * answers as soon as the read model has it; a route cached from before a
 * migration is re-read when its old host refuses the connection.
 */
export class PgRouteSource implements RouteSource {
  private readonly cache = new Map<string, { row: IngressTargetRow; until: number }>();

  constructor(
    private readonly pool: Pool,
    private readonly ttlMs: number,
  ) {}

  async lookup(vmId: string, fresh = false): Promise<IngressTargetRow | undefined> {
    const now = Date.now();
    if (!fresh && this.ttlMs > 0) {
      const hit = this.cache.get(vmId);
      if (hit && hit.until > now) return hit.row;
    }
    const row = await getIngressTarget(this.pool, vmId);
    if (row && this.ttlMs > 0) {
      if (this.cache.size > 50_000) this.cache.clear();
      this.cache.set(vmId, { row, until: now + this.ttlMs });
    } else this.cache.delete(vmId);
    return row;
  }

  lookupRunning(vmId: string): ReturnType<RouteSource['lookupRunning']> {
    return getRunningVmPlacement(this.pool, vmId);
  }
}
