import type { Sql } from '../projection.js';

export interface NetworkMemberRow {
  readonly vm_id: string;
  readonly ip: string;
  readonly host_id: string;
  readonly state: string;
}

export interface NetworkRow {
  readonly id: string;
  readonly name: string;
  readonly subnet: string;
  readonly created_at: string;
  /** Live members only (a VM that ended has left, and its address is free again). */
  readonly members: NetworkMemberRow[];
}

const SELECT = `
  SELECT n.id, n.name, n.subnet, n.created_at,
         coalesce(jsonb_agg(jsonb_build_object('vm_id', m.vm_id, 'ip', m.ip, 'host_id', m.host_id, 'state', v.state)
                            ORDER BY m.joined_at) FILTER (WHERE v.id IS NOT NULL), '[]'::jsonb) AS members
    FROM networks n
    LEFT JOIN network_members m ON m.network_id = n.id
    LEFT JOIN vms v ON v.id = m.vm_id AND v.state NOT IN ('destroyed', 'failed')`;

interface Raw extends Record<string, unknown> {
  id: string;
  name: string;
  subnet: string;
  created_at: Date;
  members: NetworkMemberRow[];
}

const toRow = (r: Raw): NetworkRow => ({ ...r, created_at: r.created_at.toISOString() });

/** The tenant's networks, oldest first. */
export async function listNetworks(sql: Sql, tenantId: string): Promise<NetworkRow[]> {
  const { rows } = await sql.query<Raw>(`${SELECT} WHERE n.tenant_id = $1 GROUP BY n.id ORDER BY n.created_at, n.id`, [tenantId]);
  return rows.map(toRow);
}

/** One network of the tenant; undefined for another tenant's (or none). */
export async function getNetwork(sql: Sql, tenantId: string, id: string): Promise<NetworkRow | undefined> {
  const { rows } = await sql.query<Raw>(`${SELECT} WHERE n.tenant_id = $1 AND n.id = $2 GROUP BY n.id`, [tenantId, id]);
  const r = rows[0];
  return r ? toRow(r) : undefined;
}
