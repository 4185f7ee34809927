import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isIngressEventType, parseIngressEvent } from '../../domain/vm/ingress.events.js';
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
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith(VM_STREAM_PREFIX)) return;
    const vmId = recorded.streamId.slice(VM_STREAM_PREFIX.length);
    const revision = recorded.revision.toString();
    if (VM_END_TYPES.has(recorded.type)) {
      await sql.query(`DELETE FROM ingress_routes WHERE vm_id = $1`, [vmId]);
      return;
    }
    if (!isIngressEventType(recorded.type)) return;
    const e = parseIngressEvent(recorded.type, recorded.data);
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
        await sql.query(`DELETE FROM ingress_routes WHERE vm_id = $1`, [e.data.vm_id]);
        return;
    }
  },
};
