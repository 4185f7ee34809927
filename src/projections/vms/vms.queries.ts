import type { Sql } from '../projection.js';

export interface VmRow {
  id: string;
  tenant_id: string;
  task_id: string | null;
  state: string;
  host_id: string | null;
  url: string | null;
  endpoints: Array<{ as: string; url: string; port: number; protocol?: string | undefined }>;
  spec: Record<string, unknown>;
  placement: Record<string, unknown> | null;
  reason: string | null;
  error: string | null;
  error_code: string | null;
  boot_ms: number | null;
  created_at: string;
  updated_at: string;
  last_activity_at: string;
  metadata: Record<string, string>;
  failed_phase: string | null;
  exit_code: number | null;
  exit_signal: string | null;
  timeout_at: string | null;
}

const COLUMNS = `id, tenant_id, task_id, state, host_id, url, endpoints, spec, placement, reason, error, error_code, boot_ms, created_at, updated_at, last_activity_at, metadata, failed_phase, exit_code, exit_signal, timeout_at`;

function toRow(r: Record<string, unknown>): VmRow {
  return {
    ...(r as unknown as VmRow),
    created_at: (r.created_at as Date).toISOString(),
    updated_at: (r.updated_at as Date).toISOString(),
    last_activity_at: (r.last_activity_at as Date).toISOString(),
    timeout_at: r.timeout_at ? (r.timeout_at as Date).toISOString() : null,
  };
}

export interface VmFilter {
  /** Undefined only for admins: every tenant. */
  tenantId: string | undefined;
  state?: string | undefined;
  taskId?: string | undefined;
  hostId?: string | undefined;
  /** One of the closed set of end reasons. */
  reason?: string | undefined;
  /** Every pair must match (`metadata @> …`). */
  metadata?: Record<string, string> | undefined;
  /** Any of these states (with `state`, both must hold). */
  states?: readonly string[] | undefined;
  createdAfter?: string | undefined;
  /** The spec's image or seed snapshot. */
  template?: string | undefined;
  limit: number;
  /** Keyset: the (created_at, id) of the last row of the previous page. */
  after?: { created_at: string; id: string } | undefined;
}

/** Newest first, keyset-paginated on (created_at, id) so pages stay stable while VMs are created. */
export async function listVms(sql: Sql, f: VmFilter): Promise<VmRow[]> {
  const { rows } = await sql.query(
    `SELECT ${COLUMNS} FROM vms
      WHERE ($1::text IS NULL OR tenant_id = $1)
        AND ($2::text IS NULL OR state = $2)
        AND ($3::text IS NULL OR task_id = $3)
        AND ($4::text IS NULL OR host_id = $4)
        AND ($5::timestamptz IS NULL OR (created_at, id) < ($5::timestamptz, $6::text))
        AND ($8::text IS NULL OR reason = $8)
        AND ($9::jsonb IS NULL OR metadata @> $9::jsonb)
        AND ($10::text[] IS NULL OR state = ANY($10::text[]))
        AND ($11::timestamptz IS NULL OR created_at >= $11::timestamptz)
        AND ($12::text IS NULL OR spec->>'image' = $12 OR spec->>'seed_snapshot_id' = $12)
      ORDER BY created_at DESC, id DESC
      LIMIT $7`,
    [
      f.tenantId ?? null,
      f.state ?? null,
      f.taskId ?? null,
      f.hostId ?? null,
      f.after?.created_at ?? null,
      f.after?.id ?? null,
      f.limit,
      f.reason ?? null,
      f.metadata && Object.keys(f.metadata).length > 0 ? JSON.stringify(f.metadata) : null,
      f.states ? [...f.states] : null,
      f.createdAfter ?? null,
      f.template ?? null,
    ],
  );
  return rows.map(toRow);
}

/** A tenant's VM, or any VM for an admin (tenantId undefined). Another tenant's VM reads as absent. */
export async function getVm(sql: Sql, id: string, tenantId: string | undefined): Promise<VmRow | undefined> {
  const { rows } = await sql.query(`SELECT ${COLUMNS} FROM vms WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)`, [
    id,
    tenantId ?? null,
  ]);
  return rows[0] ? toRow(rows[0]) : undefined;
}

export async function countVmsByStateAndHost(sql: Sql): Promise<Array<{ state: string; host_id: string; count: number }>> {
  const { rows } = await sql.query<{ state: string; host_id: string | null; count: string }>(
    `SELECT state, host_id, count(*) AS count FROM vms GROUP BY state, host_id`,
  );
  return rows.map((r) => ({ state: r.state, host_id: r.host_id ?? '', count: Number(r.count) }));
}
