import type { Position } from '../../domain/event-store.port.js';
import type { ExistingSnapshot } from '../../domain/snapshot/snapshot.decider.js';
import type { QuotaLimits } from '../../domain/tenant/tenant.decider.js';

/** Read-model queries the snapshot commands use for candidate selection (they may lag; the streams decide). */
export interface SnapshotReads {
  latestReadyOfVm(vmId: string): Promise<{ id: string } | undefined>;
  dependentsOf(snapshotId: string): Promise<string[]>;
  expired(now: Date): Promise<Array<{ id: string; tenant_id: string }>>;
  idleLayers(before: Date): Promise<Array<{ id: string; tenant_id: string }>>;
  layersOverCap(max: number): Promise<Array<{ id: string; tenant_id: string }>>;
  /** VMs not yet ended whose spec seeds from this snapshot. */
  liveVmsSeededFrom(snapshotId: string): Promise<string[]>;
  /** Deleted snapshots some host still holds (a delete the agent did not finish). */
  deletedWithHolders(): Promise<Array<{ id: string; tenant_id: string }>>;
}

export interface SnapshotConfig {
  readonly defaultRetentionMs: number;
  readonly quota: QuotaLimits;
  /** Build (mode "build") snapshots per tenant: a pool of their own, outside `quota`. */
  readonly buildQuota: QuotaLimits;
  /** 0: the agent client's default. */
  readonly pullTimeoutMs: number;
  readonly checkpointTimeoutMs: number;
  readonly idleTtlMs: number;
  readonly maxPerTenant: number;
  readonly gcIntervalMs: number;
}

export interface SnapshotResult {
  readonly snapshot: ExistingSnapshot;
  readonly position: Position | undefined;
}
