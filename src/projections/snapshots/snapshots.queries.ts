import type { Sql } from '../projection.js';

export interface SnapshotRow {
  id: string;
  tenant_id: string;
  vm_id: string;
  task_id: string | null;
  host_id: string;
  arch: string;
  mode: string;
  layer_key: string | null;
  digest: string | null;
  kind: string;
  state: string;
  size_bytes: number;
  parent_snapshot_id: string | null;
  comment: string;
  metadata: Record<string, string>;
  retention_until: string | null;
  exports: Array<{ destination: string; status: string; requested_at: string; updated_at: string; last_error?: string }>;
  holders: string[];
  last_error: string | null;
  created_at: string;
  updated_at: string;
  last_used_at: string;
}

const COLUMNS = `id, tenant_id, vm_id, task_id, host_id, arch, mode, layer_key, digest, kind, state, size_bytes, parent_snapshot_id, comment, metadata, retention_until, exports, holders, last_error, created_at, updated_at, last_used_at`;

function toRow(r: Record<string, unknown>): SnapshotRow {
  return {
    ...(r as unknown as SnapshotRow),
    size_bytes: Number(r.size_bytes),
    retention_until: r.retention_until ? (r.retention_until as Date).toISOString() : null,
    created_at: (r.created_at as Date).toISOString(),
    updated_at: (r.updated_at as Date).toISOString(),
    last_used_at: (r.last_used_at as Date).toISOString(),
  };
}

export interface SnapshotFilter {
  /** Undefined only for admins: every tenant. */
  tenantId: string | undefined;
  vmId?: string | undefined;
  taskId?: string | undefined;
  state?: string | undefined;
  mode?: string | undefined;
  layerKey?: string | undefined;
  arch?: string | undefined;
  /** The "name" key of the metadata blob; an absent key simply does not match. */
  name?: string | undefined;
  limit: number;
  after?: { created_at: string; id: string } | undefined;
}

/** Newest first, keyset-paginated on (created_at, id). */
export async function listSnapshots(sql: Sql, f: SnapshotFilter): Promise<SnapshotRow[]> {
  const { rows } = await sql.query(
    `SELECT ${COLUMNS} FROM snapshots
      WHERE ($1::text IS NULL OR tenant_id = $1)
        AND ($2::text IS NULL OR vm_id = $2)
        AND ($3::text IS NULL OR task_id = $3)
        AND ($4::text IS NULL OR state = $4)
        AND ($5::text IS NULL OR mode = $5)
        AND ($6::text IS NULL OR layer_key = $6)
        AND ($7::text IS NULL OR arch = $7)
        AND ($8::text IS NULL OR metadata->>'name' = $8)
        AND ($9::timestamptz IS NULL OR (created_at, id) < ($9::timestamptz, $10::text))
      ORDER BY created_at DESC, id DESC
      LIMIT $11`,
    [
      f.tenantId ?? null,
      f.vmId ?? null,
      f.taskId ?? null,
      f.state ?? null,
      f.mode ?? null,
      f.layerKey ?? null,
      f.arch ?? null,
      f.name ?? null,
      f.after?.created_at ?? null,
      f.after?.id ?? null,
      f.limit,
    ],
  );
  return rows.map(toRow);
}

export async function getSnapshot(sql: Sql, id: string, tenantId: string | undefined): Promise<SnapshotRow | undefined> {
  const { rows } = await sql.query(`SELECT ${COLUMNS} FROM snapshots WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)`, [
    id,
    tenantId ?? null,
  ]);
  return rows[0] ? toRow(rows[0]) : undefined;
}

export const DIGEST_QUERY = `SELECT ${COLUMNS} FROM snapshots WHERE tenant_id = $1 AND digest = $2 AND state = 'ready'`;

/**
 * The artifact index (seed ListSnapshotsByDigest): every ready snapshot of
 * `tenantId` whose artifact hashes to `digest`; their holders are the hosts
 * holding the bytes. tenantId is a security boundary: another tenant's match
 * is a miss.
 */
export async function listSnapshotsByDigest(sql: Sql, tenantId: string, digest: string): Promise<SnapshotRow[]> {
  const { rows } = await sql.query(DIGEST_QUERY, [tenantId, digest]);
  return rows.map(toRow);
}

export const LAYER_QUERY = `SELECT ${COLUMNS} FROM snapshots
  WHERE tenant_id = $1 AND layer_key = $2 AND arch = $3 AND state = 'ready' AND layer_key IS NOT NULL
  ORDER BY created_at DESC, id DESC LIMIT 1`;

/** The layer cache (seed FindSnapshotByLayerKey): newest ready layer artifact, one index scan. Empty key never matches. */
export async function findSnapshotByLayerKey(sql: Sql, tenantId: string, layerKey: string, arch: string): Promise<SnapshotRow | undefined> {
  if (!layerKey) return undefined;
  const { rows } = await sql.query(LAYER_QUERY, [tenantId, layerKey, arch]);
  return rows[0] ? toRow(rows[0]) : undefined;
}

/** Reporting only: enforcement is the tenant stream's. */
export async function snapshotQuotaUsage(sql: Sql, tenantId: string): Promise<{ count: number; bytes: number }> {
  const { rows } = await sql.query<{ count: string; bytes: string | null }>(
    `SELECT count(*) AS count, sum(size_bytes) AS bytes FROM snapshots
      WHERE tenant_id = $1 AND state IN ('creating', 'ready', 'restoring') AND mode <> 'build'`,
    [tenantId],
  );
  return { count: Number(rows[0]?.count ?? 0), bytes: Number(rows[0]?.bytes ?? 0) };
}

/** The VM's newest ready snapshot with lineage semantics (what a new snapshot's parent is). */
export async function latestReadySnapshotOfVm(sql: Sql, vmId: string): Promise<SnapshotRow | undefined> {
  const { rows } = await sql.query(
    `SELECT ${COLUMNS} FROM snapshots WHERE vm_id = $1 AND state = 'ready' AND mode IN ('manual', 'build') AND layer_key IS NULL ORDER BY created_at DESC, id DESC LIMIT 1`,
    [vmId],
  );
  return rows[0] ? toRow(rows[0]) : undefined;
}

/** Live snapshots whose lineage names `id`. */
export async function dependentsOf(sql: Sql, id: string): Promise<string[]> {
  const { rows } = await sql.query<{ id: string }>(
    `SELECT id FROM snapshots WHERE parent_snapshot_id = $1 AND state <> 'deleted' ORDER BY id`,
    [id],
  );
  return rows.map((r) => r.id);
}

/** Past retention_until and not yet deleted. */
export async function expiredSnapshots(sql: Sql, now: Date, limit = 100): Promise<Array<{ id: string; tenant_id: string }>> {
  const { rows } = await sql.query<{ id: string; tenant_id: string }>(
    `SELECT id, tenant_id FROM snapshots WHERE state IN ('ready', 'failed') AND retention_until IS NOT NULL AND retention_until <= $1 ORDER BY retention_until LIMIT $2`,
    [now, limit],
  );
  return rows;
}

/** Ready layer artifacts idle since before `before`, oldest use first. */
export async function idleLayers(sql: Sql, before: Date, limit = 100): Promise<Array<{ id: string; tenant_id: string }>> {
  const { rows } = await sql.query<{ id: string; tenant_id: string }>(
    `SELECT id, tenant_id FROM snapshots WHERE state = 'ready' AND layer_key IS NOT NULL AND last_used_at < $1 ORDER BY last_used_at LIMIT $2`,
    [before, limit],
  );
  return rows;
}

/** Per tenant over `max` ready layers: the least recently used beyond the cap. */
export async function layersOverCap(sql: Sql, max: number, limit = 100): Promise<Array<{ id: string; tenant_id: string }>> {
  const { rows } = await sql.query<{ id: string; tenant_id: string }>(
    `SELECT id, tenant_id FROM (
        SELECT id, tenant_id, row_number() OVER (PARTITION BY tenant_id ORDER BY last_used_at DESC, id DESC) AS rn
          FROM snapshots WHERE state = 'ready' AND layer_key IS NOT NULL) ranked
      WHERE rn > $1 ORDER BY tenant_id, rn DESC LIMIT $2`,
    [max, limit],
  );
  return rows;
}

export async function deletedWithHolders(sql: Sql, limit = 100): Promise<Array<{ id: string; tenant_id: string }>> {
  const { rows } = await sql.query<{ id: string; tenant_id: string }>(
    `SELECT id, tenant_id FROM snapshots WHERE state = 'deleted' AND cardinality(holders) > 0 ORDER BY updated_at LIMIT $1`,
    [limit],
  );
  return rows;
}

/** VMs not yet ended whose spec seeds from `snapshotId` (the vms read model). */
export async function liveVmsSeededFrom(sql: Sql, snapshotId: string): Promise<string[]> {
  const { rows } = await sql.query<{ id: string }>(
    `SELECT id FROM vms WHERE state NOT IN ('destroyed', 'failed') AND spec->>'seed_snapshot_id' = $1`,
    [snapshotId],
  );
  return rows.map((r) => r.id);
}
