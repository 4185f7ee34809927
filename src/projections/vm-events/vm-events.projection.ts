import type { RecordedEvent } from '../../domain/event-store.port.js';
import { FEED_TYPES, toEnvironmentEvent } from '../../domain/vm/vm.feed.js';
import { parsedVmEvent } from '../parsed-events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * How long the JSON events read keeps an event: measured from the newest
 * event applied, never the clock, so a replay prunes exactly the same rows.
 * The event store itself keeps everything (audit, SSE feed).
 */
export const VM_EVENTS_RETENTION_DAYS = 30;
const RETENTION_MS = VM_EVENTS_RETENTION_DAYS * 24 * 3_600_000;

/**
 * The `vm_events` read model behind `GET /v1/vm-events`: one row per VM
 * lifecycle event the feed carries, in the feed's own shape, with its
 * tenant, so a tenant's page is an index range and not a scan of the log.
 * `vm_event_owners` remembers each VM's tenant (from its VmRequested).
 */
export const vmEventsProjection: Projection = {
  name: 'vm_events',
  migrations: [
    {
      id: 'vm_events_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS vm_event_owners (
          vm_id text PRIMARY KEY,
          tenant_id text NOT NULL
        );
        CREATE TABLE IF NOT EXISTS vm_events (
          position text PRIMARY KEY,
          tenant_id text NOT NULL,
          vm_id text NOT NULL,
          event text NOT NULL,
          at timestamptz NOT NULL,
          body jsonb NOT NULL
        );
        CREATE INDEX IF NOT EXISTS vm_events_tenant_idx ON vm_events (tenant_id, position);
        CREATE INDEX IF NOT EXISTS vm_events_vm_idx ON vm_events (vm_id, position);
        CREATE INDEX IF NOT EXISTS vm_events_at_idx ON vm_events (at);`,
    },
  ],
  tables: [
    { name: 'vm_event_owners', key: ['vm_id'] },
    { name: 'vm_events', key: ['position'] },
  ],
  apply: (sql, recorded) => applyVmEvents(sql, [recorded]),
  applyBatch: applyVmEvents,
};

async function applyVmEvents(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const relevant = events.filter((r) => r.streamId.startsWith('vm-') && FEED_TYPES.includes(r.type));
  if (relevant.length === 0) return;
  const owners = new Map<string, string>();
  for (const r of relevant) {
    const t = r.type === 'VmRequested' ? (r.data as { tenant_id?: unknown } | null)?.tenant_id : undefined;
    if (typeof t === 'string') owners.set(r.streamId.slice(3), t);
  }
  if (owners.size > 0)
    await sql.query(
      `INSERT INTO vm_event_owners (vm_id, tenant_id) SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT (vm_id) DO NOTHING`,
      [[...owners.keys()], [...owners.values()]],
    );
  const missing = [...new Set(relevant.map((r) => r.streamId.slice(3)))].filter((id) => !owners.has(id));
  if (missing.length > 0) {
    const { rows } = await sql.query<{ vm_id: string; tenant_id: string }>(
      'SELECT vm_id, tenant_id FROM vm_event_owners WHERE vm_id = ANY($1::text[])',
      [missing],
    );
    for (const r of rows) owners.set(r.vm_id, r.tenant_id);
  }
  const rows = relevant.flatMap((r) => {
    const env = toEnvironmentEvent(r, parsedVmEvent);
    const tenant = owners.get(r.streamId.slice(3));
    // A VM whose VmRequested was never seen has no owner to show its events to.
    return env && tenant !== undefined ? [{ env, tenant }] : [];
  });
  if (rows.length === 0) return;
  // One JSON document for the whole run: a jsonb[] parameter would escape every body into an array literal and parse it twice.
  await sql.query(
    `INSERT INTO vm_events (position, tenant_id, vm_id, event, at, body)
     SELECT x.p, x.t, x.v, x.e, x.a, x.b FROM jsonb_to_recordset($1::jsonb) AS x(p text, t text, v text, e text, a timestamptz, b jsonb)
     ON CONFLICT (position) DO NOTHING`,
    [JSON.stringify(rows.map((x) => ({ p: x.env.id, t: x.tenant, v: x.env.vm_id, e: x.env.event, a: x.env.updated_at, b: x.env })))],
  );
  // Against the newest event kept (never pruned itself): the same rows go whatever the batching.
  await sql.query(`DELETE FROM vm_events WHERE at < (SELECT max(at) FROM vm_events) - make_interval(secs => $1)`, [RETENTION_MS / 1000]);
}

export interface VmEventsQuery {
  /** Undefined: every tenant (admin). */
  readonly tenantId: string | undefined;
  readonly vmId?: string | undefined;
  /** Feed event names (`vm.failed`, …). */
  readonly events?: readonly string[] | undefined;
  readonly since?: Date | undefined;
  /** Exclusive: the position of the last event of the previous page. */
  readonly after?: string | undefined;
  readonly limit: number;
}

/** Oldest first, keyset-paged on position. */
export async function queryVmEvents(sql: Sql, q: VmEventsQuery): Promise<Array<Record<string, unknown>>> {
  const { rows } = await sql.query<{ body: Record<string, unknown> }>(
    `SELECT body FROM vm_events
      WHERE ($1::text IS NULL OR tenant_id = $1)
        AND ($2::text IS NULL OR vm_id = $2)
        AND ($3::text[] IS NULL OR event = ANY($3::text[]))
        AND ($4::timestamptz IS NULL OR at >= $4)
        AND ($5::text IS NULL OR position > $5)
      ORDER BY position
      LIMIT $6`,
    [q.tenantId ?? null, q.vmId ?? null, q.events && q.events.length > 0 ? q.events : null, q.since ?? null, q.after ?? null, q.limit],
  );
  return rows.map((r) => r.body);
}
