import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isIngressEventType, parseIngressEvent, type IngressEvent } from '../../domain/vm/ingress.events.js';
import { VM_STREAM_PREFIX } from '../../domain/ids.js';
import type { Projection, Sql } from '../projection.js';

const VM_END_TYPES: ReadonlySet<string> = new Set(['VmDestroyRequested', 'VmDestroyed', 'VmFailed']);

/**
 * The `ingress_routes` read model: the route table every ingress replica
 * reads. One row per VM with published routes; it goes when the routes are
 * unpublished or as soon as the VM starts to end (whichever event comes
 * first), so a destroyed VM never answers, whatever path ended it.
 */
export const ingressProjection: Projection = {
  name: 'ingress',
  migrations: [
    {
      id: 'ingress_0001',
      sql: `CREATE TABLE IF NOT EXISTS ingress_routes (
              vm_id text PRIMARY KEY,
              tenant_id text NOT NULL,
              host_id text NOT NULL,
              routes jsonb NOT NULL,
              token_sha256 text NOT NULL,
              revision bigint NOT NULL,
              updated_at timestamptz NOT NULL
            );`,
    },
  ],
  tables: [{ name: 'ingress_routes', key: ['vm_id'] }],
  apply: (sql: Sql, recorded: RecordedEvent) => applyIngressEvents(sql, [recorded]),
  applyBatch: applyIngressEvents,
};

/**
 * Every VM end deletes its row, so a replay meets a delete for nearly every
 * VM: deletes are collected and sent as one statement, before any other
 * write of the run (which may concern a VM deleted earlier in it) and at its end.
 */
async function applyIngressEvents(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const deletes = new Set<string>();
  const flush = async (): Promise<void> => {
    if (deletes.size === 0) return;
    await sql.query(`DELETE FROM ingress_routes WHERE vm_id = ANY($1::text[])`, [[...deletes]]);
    deletes.clear();
  };
  for (const recorded of events) {
    if (!recorded.streamId.startsWith(VM_STREAM_PREFIX)) continue;
    if (VM_END_TYPES.has(recorded.type)) deletes.add(recorded.streamId.slice(VM_STREAM_PREFIX.length));
    else if (isIngressEventType(recorded.type)) {
      const e = parseIngressEvent(recorded.type, recorded.data);
      if (e.type === 'IngressUnpublished') deletes.add(e.data.vm_id);
      else {
        await flush();
        await applyRouteWrite(sql, recorded, e);
      }
    }
  }
  await flush();
}

async function applyRouteWrite(sql: Sql, recorded: RecordedEvent, e: IngressEvent): Promise<void> {
  const revision = recorded.revision.toString();
  switch (e.type) {
    case 'IngressPublished': {
      const d = e.data;
      await sql.query(
        `INSERT INTO ingress_routes (vm_id, tenant_id, host_id, routes, token_sha256, revision, updated_at)
           VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7)
           ON CONFLICT (vm_id) DO UPDATE SET tenant_id = EXCLUDED.tenant_id, host_id = EXCLUDED.host_id, routes = EXCLUDED.routes,
             token_sha256 = EXCLUDED.token_sha256, revision = EXCLUDED.revision, updated_at = EXCLUDED.updated_at
           WHERE ingress_routes.revision < EXCLUDED.revision`,
        [d.vm_id, d.tenant_id, d.host_id, JSON.stringify(d.routes), d.token_sha256, revision, recorded.created],
      );
      return;
    }
    case 'IngressAdopted':
      await sql.query(
        `UPDATE ingress_routes SET host_id = $2, routes = $3::jsonb, revision = $4, updated_at = $5 WHERE vm_id = $1 AND revision < $4`,
        [e.data.vm_id, e.data.host_id, JSON.stringify(e.data.routes), revision, recorded.created],
      );
      return;
    case 'IngressUnpublished':
      return; // collected with the deletes
  }
}
