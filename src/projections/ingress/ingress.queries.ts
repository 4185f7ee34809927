import type { Sql } from '../projection.js';

export interface IngressTargetRow {
  readonly vm_id: string;
  readonly tenant_id: string;
  readonly host_id: string;
  /** The host agent's API address (from the hosts read model), for port handlers that talk to the agent. */
  readonly host_url: string | null;
  readonly routes: ReadonlyArray<{ as: string; port: number; public: boolean; target: string }>;
  readonly token_sha256: string;
  /** The VM's state in the vms read model (`paused`: the ingress resumes it first). */
  readonly vm_state?: string | null | undefined;
}

/** The route row of a VM, or undefined when it has none (never published, unpublished, or ending). */
export async function getIngressTarget(sql: Sql, vmId: string): Promise<IngressTargetRow | undefined> {
  const { rows } = await sql.query<{
    vm_id: string;
    tenant_id: string;
    host_id: string;
    host_url: string | null;
    routes: IngressTargetRow['routes'];
    token_sha256: string;
    vm_state: string | null;
  }>(
    `SELECT r.vm_id, r.tenant_id, r.host_id, h.url AS host_url, r.routes, r.token_sha256, v.state AS vm_state
       FROM ingress_routes r LEFT JOIN hosts h ON h.id = r.host_id LEFT JOIN vms v ON v.id = r.vm_id WHERE r.vm_id = $1`,
    [vmId],
  );
  return rows[0];
}

/** Where a running VM is, whether or not it publishes ports: for a port handler that authenticates itself (E2B's envd). */
export async function getRunningVmPlacement(
  sql: Sql,
  vmId: string,
): Promise<{ vm_id: string; tenant_id: string; host_id: string; host_url: string | null } | undefined> {
  const { rows } = await sql.query<{ vm_id: string; tenant_id: string; host_id: string; host_url: string | null }>(
    `SELECT v.id AS vm_id, v.tenant_id, v.host_id, h.url AS host_url
       FROM vms v LEFT JOIN hosts h ON h.id = v.host_id WHERE v.id = $1 AND v.state = 'running' AND v.host_id IS NOT NULL`,
    [vmId],
  );
  return rows[0];
}

export async function countIngressRoutes(sql: Sql): Promise<number> {
  const { rows } = await sql.query<{ n: string }>(`SELECT coalesce(sum(jsonb_array_length(routes)), 0) AS n FROM ingress_routes`);
  return Number(rows[0]?.n ?? 0);
}
