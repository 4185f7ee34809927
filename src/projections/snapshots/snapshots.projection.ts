import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isSnapshotEventType, parseSnapshotEvent, SNAPSHOT_STREAM_PREFIX } from '../../domain/snapshot/snapshot.events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * The `snapshots` read model: one row per snapshot, every field from its
 * events. The artifact index (tenant, digest → holders) and the layer cache
 * (tenant, layer key, arch → newest ready) are QUERIES over this one table
 * with partial indexes, never second tables: a row already says "these hosts
 * hold these bytes", so a separate index could only disagree with it.
 * `holders` is folded from SnapshotTaken (the origin) and the move/drop events.
 */
export const snapshotsProjection: Projection = {
  name: 'snapshots',
  migrations: [
    {
      id: 'snapshots_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS snapshots (
          id text PRIMARY KEY,
          tenant_id text NOT NULL,
          vm_id text NOT NULL,
          task_id text,
          host_id text NOT NULL,
          arch text NOT NULL,
          mode text NOT NULL,
          layer_key text,
          digest text,
          kind text NOT NULL DEFAULT 'disk',
          state text NOT NULL,
          size_bytes bigint NOT NULL DEFAULT 0,
          parent_snapshot_id text,
          comment text NOT NULL DEFAULT '',
          metadata jsonb NOT NULL DEFAULT '{}',
          ask jsonb NOT NULL DEFAULT '{}',
          quota_counted boolean NOT NULL,
          retention_until timestamptz,
          exports jsonb NOT NULL DEFAULT '[]',
          holders text[] NOT NULL DEFAULT '{}',
          last_error text,
          revision bigint NOT NULL,
          created_at timestamptz NOT NULL,
          updated_at timestamptz NOT NULL,
          last_used_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS snapshots_digest_idx ON snapshots (tenant_id, digest) WHERE state = 'ready';
        CREATE INDEX IF NOT EXISTS snapshots_layer_idx ON snapshots (tenant_id, layer_key, arch, created_at DESC, id DESC) WHERE state = 'ready' AND layer_key IS NOT NULL;
        CREATE INDEX IF NOT EXISTS snapshots_tenant_created_idx ON snapshots (tenant_id, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS snapshots_created_idx ON snapshots (created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS snapshots_vm_idx ON snapshots (vm_id, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS snapshots_parent_idx ON snapshots (parent_snapshot_id) WHERE state <> 'deleted' AND parent_snapshot_id IS NOT NULL;
        CREATE INDEX IF NOT EXISTS snapshots_retention_idx ON snapshots (retention_until) WHERE state IN ('ready', 'failed') AND retention_until IS NOT NULL;
        CREATE INDEX IF NOT EXISTS snapshots_layer_lru_idx ON snapshots (tenant_id, last_used_at) WHERE state = 'ready' AND layer_key IS NOT NULL;`,
    },
  ],
  tables: [{ name: 'snapshots', key: ['id'] }],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith(SNAPSHOT_STREAM_PREFIX) || !isSnapshotEventType(recorded.type)) return;
    const event = parseSnapshotEvent(recorded.type, recorded.data);
    const rev = recorded.revision.toString();
    const id = event.data.snapshot_id;
    const at = event.data.at;
    switch (event.type) {
      case 'SnapshotRequested': {
        const d = event.data;
        await sql.query(
          `INSERT INTO snapshots (id, tenant_id, vm_id, task_id, host_id, arch, mode, layer_key, state, parent_snapshot_id, comment, metadata, ask, quota_counted, retention_until, revision, created_at, updated_at, last_used_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'creating', $9, $10, $11, $12, $13, $14, $15, $16, $16, $16)
           ON CONFLICT (id) DO NOTHING`,
          [
            id,
            d.tenant_id,
            d.vm_id,
            d.task_id ?? null,
            d.host_id,
            d.arch,
            d.mode,
            d.layer_key ?? null,
            d.parent_snapshot_id ?? null,
            d.comment,
            JSON.stringify(d.metadata),
            JSON.stringify(d.ask),
            d.quota_counted,
            d.retention_until ?? null,
            rev,
            at,
          ],
        );
        return;
      }
      case 'SnapshotTaken':
        await update(
          sql,
          id,
          rev,
          at,
          `state = 'ready', digest = $4, size_bytes = $5, kind = $6, holders = ARRAY[host_id], last_used_at = $3`,
          [event.data.digest, event.data.size_bytes, event.data.kind],
        );
        return;
      case 'SnapshotFailed':
        await update(sql, id, rev, at, `state = 'failed', last_error = $4`, [event.data.error]);
        return;
      case 'SnapshotArtifactMoved':
        await update(sql, id, rev, at, `holders = CASE WHEN $4 = ANY(holders) THEN holders ELSE array_append(holders, $4) END`, [
          event.data.to_host_id,
        ]);
        return;
      case 'SnapshotArtifactMoveFailed':
        await update(sql, id, rev, at, ``);
        return;
      case 'SnapshotArtifactDropped':
        await update(sql, id, rev, at, `holders = array_remove(holders, $4)`, [event.data.host_id]);
        return;
      case 'SnapshotUsed':
        await sql.query(`UPDATE snapshots SET last_used_at = GREATEST(last_used_at, $3::timestamptz), revision = $2 WHERE id = $1`, [
          id,
          rev,
          at,
        ]);
        return;
      case 'SnapshotDeleted':
        await update(sql, id, rev, at, `state = 'deleted'`);
        return;
      case 'SnapshotExportRequested':
        await update(
          sql,
          id,
          rev,
          at,
          `exports = (SELECT coalesce(jsonb_agg(e ORDER BY n), '[]'::jsonb) FROM jsonb_array_elements(exports) WITH ORDINALITY AS x(e, n) WHERE e->>'destination' <> $4)
                     || jsonb_build_array(jsonb_build_object('destination', $4::text, 'status', 'pending', 'requested_at', $5::text, 'updated_at', $5::text))`,
          [event.data.destination, at],
        );
        return;
      case 'SnapshotExportUpdated':
        await update(
          sql,
          id,
          rev,
          at,
          `exports = (SELECT coalesce(jsonb_agg(CASE WHEN e->>'destination' = $4
                        THEN jsonb_strip_nulls((e - 'last_error') || jsonb_build_object('status', $5::text, 'updated_at', $6::text, 'last_error', $7::text))
                        ELSE e END ORDER BY n), '[]'::jsonb)
                      FROM jsonb_array_elements(exports) WITH ORDINALITY AS x(e, n))`,
          [event.data.destination, event.data.status, at, event.data.error ?? null],
        );
        return;
    }
  },
};

async function update(sql: Sql, id: string, rev: string, at: string, set: string, params: unknown[] = []): Promise<void> {
  await sql.query(`UPDATE snapshots SET ${set ? `${set}, ` : ''}revision = $2, updated_at = $3 WHERE id = $1`, [id, rev, at, ...params]);
}
