import type { Sql } from '../projection.js';

/**
 * What the reconciler reads from the `vms` read model each cycle: every VM
 * not yet ended, with the clocks its checks need. Kept beside the dead
 * letters (the reconciler's own read model) rather than in vms/, which
 * another part owns. Only hints: the reconciler re-reads a VM's stream
 * before it acts on it.
 */
export interface LiveVmHintRow {
  id: string;
  state: string;
  host_id: string | null;
  state_changed_at: Date;
  last_activity_at: Date;
  max_runtime_s: number | null;
  idle_timeout_s: number | null;
  timeout_at: Date | null;
  healthcheck: {
    http?: { port: number; path?: string };
    exec?: string[];
    interval_seconds?: number;
    timeout_seconds?: number;
    retries?: number;
    start_period_seconds?: number;
  } | null;
  /** The provider of a proxy-mode VM (its endpoint is probed each cycle); null otherwise. */
  egress_proxy: string | null;
}

export async function listLiveVmHints(sql: Sql): Promise<LiveVmHintRow[]> {
  const { rows } = await sql.query<{
    id: string;
    state: string;
    host_id: string | null;
    state_changed_at: Date;
    last_activity_at: Date;
    max_runtime_s: string | null;
    idle_timeout_s: string | null;
    on_idle: string | null;
    timeout_at: Date | null;
    healthcheck: LiveVmHintRow['healthcheck'];
    egress_proxy: string | null;
  }>(
    `SELECT id, state, host_id, state_changed_at, last_activity_at, timeout_at,
            (spec->>'max_runtime_s')::bigint AS max_runtime_s, (spec->>'idle_timeout_s')::bigint AS idle_timeout_s, spec->>'on_idle' AS on_idle, spec->'healthcheck' AS healthcheck,
            CASE WHEN spec->'egress'->>'mode' = 'proxy' THEN spec->'egress'->>'provider' END AS egress_proxy
       FROM vms WHERE state NOT IN ('destroyed', 'failed')`,
  );
  return rows.map((r) => ({
    ...r,
    max_runtime_s: r.max_runtime_s === null ? null : Number(r.max_runtime_s),
    idle_timeout_s: r.idle_timeout_s === null ? null : Number(r.idle_timeout_s),
  }));
}
