import type { HostCapacity } from '@fleet/agent-protocol';
import type { Sql } from '../projection.js';

export interface HostRow {
  id: string;
  url: string;
  region: string;
  backend: string;
  labels: Record<string, string>;
  capacity: HostCapacity;
  arch: string;
  state: string;
  allocated: { cpus: number; ram_mb: number; storage_gb: number; vm_count: number; gpus: number };
  revision: string;
  last_seen: string;
  created_at: string;
  updated_at: string;
}

const COLUMNS = `id, url, region, backend, labels, capacity, arch, state, allocated_cpus, allocated_ram_mb, allocated_storage_gb,
  allocated_vms, allocated_gpus, revision, last_seen, created_at, updated_at`;

function toRow(r: Record<string, unknown>): HostRow {
  return {
    id: r.id as string,
    url: r.url as string,
    region: r.region as string,
    backend: r.backend as string,
    labels: r.labels as Record<string, string>,
    capacity: r.capacity as HostCapacity,
    arch: r.arch as string,
    state: r.state as string,
    allocated: {
      cpus: r.allocated_cpus as number,
      ram_mb: r.allocated_ram_mb as number,
      storage_gb: r.allocated_storage_gb as number,
      vm_count: r.allocated_vms as number,
      gpus: r.allocated_gpus as number,
    },
    revision: String(r.revision),
    last_seen: (r.last_seen as Date).toISOString(),
    created_at: (r.created_at as Date).toISOString(),
    updated_at: (r.updated_at as Date).toISOString(),
  };
}

/** Hosts ordered by id, keyset-paginated: `after` is the last id of the previous page. */
export async function listHosts(
  sql: Sql,
  opts: { limit: number; after?: string | undefined; includeDeregistered?: boolean },
): Promise<HostRow[]> {
  const { rows } = await sql.query(
    `SELECT ${COLUMNS} FROM hosts
      WHERE ($1::text IS NULL OR id > $1) AND ($2 OR state <> 'deregistered')
      ORDER BY id LIMIT $3`,
    [opts.after ?? null, opts.includeDeregistered ?? false, opts.limit],
  );
  return rows.map(toRow);
}

export async function getHost(sql: Sql, id: string): Promise<HostRow | undefined> {
  const { rows } = await sql.query(`SELECT ${COLUMNS} FROM hosts WHERE id = $1`, [id]);
  return rows[0] ? toRow(rows[0]) : undefined;
}

/** Ids of hosts that can take work, for the placement cache to load. */
export async function listSchedulableHostIds(sql: Sql): Promise<Array<{ id: string; revision: string }>> {
  const { rows } = await sql.query<{ id: string; revision: string }>(
    `SELECT id, revision FROM hosts WHERE state <> 'deregistered' ORDER BY id`,
  );
  return rows;
}

export async function allocationByHost(sql: Sql): Promise<HostRow[]> {
  const { rows } = await sql.query(`SELECT ${COLUMNS} FROM hosts WHERE state <> 'deregistered'`);
  return rows.map(toRow);
}
