import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isVmEventType, parseVmEvent } from '../../domain/vm/vm.events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * The `vms` read model: what the API lists and gets. One row per VM, every
 * field taken from its events (times included), so a rebuild reproduces it.
 */
export const vmsProjection: Projection = {
  name: 'vms',
  migrations: [
    {
      id: 'vms_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS vms (
          id text PRIMARY KEY,
          tenant_id text NOT NULL,
          task_id text,
          state text NOT NULL,
          host_id text,
          url text,
          endpoints jsonb NOT NULL DEFAULT '[]',
          spec jsonb NOT NULL,
          placement jsonb,
          reason text,
          error text,
          error_code text,
          failed_phase text,
          boot_ms integer,
          idempotency_key text,
          revision bigint NOT NULL,
          created_at timestamptz NOT NULL,
          updated_at timestamptz NOT NULL,
          state_changed_at timestamptz NOT NULL,
          last_activity_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS vms_tenant_created_idx ON vms (tenant_id, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS vms_created_idx ON vms (created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS vms_host_state_idx ON vms (host_id, state);
        CREATE INDEX IF NOT EXISTS vms_task_idx ON vms (task_id) WHERE task_id IS NOT NULL;
        CREATE INDEX IF NOT EXISTS vms_state_idx ON vms (state);`,
    },
  ],
  tables: [{ name: 'vms', key: ['id'] }],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith('vm-') || !isVmEventType(recorded.type)) return;
    const event = parseVmEvent(recorded.type, recorded.data);
    const at = recorded.created;
    const rev = recorded.revision.toString();
    const id = event.data.vm_id;
    switch (event.type) {
      case 'VmRequested': {
        const d = event.data;
        await sql.query(
          `INSERT INTO vms (id, tenant_id, task_id, state, spec, idempotency_key, revision, created_at, updated_at, state_changed_at, last_activity_at)
           VALUES ($1, $2, $3, 'requested', $4, $5, $6, $7, $7, $7, $7)
           ON CONFLICT (id) DO NOTHING`,
          [id, d.tenant_id, d.task_id ?? null, JSON.stringify(d.spec), d.idempotency_key ?? null, rev, at],
        );
        return;
      }
      case 'VmPlaced':
        await update(sql, id, rev, at, `state = 'placed', host_id = $4, placement = $5, state_changed_at = $3`, [event.data.host_id, JSON.stringify(event.data.decision)]);
        return;
      case 'VmBootStarted':
        await update(sql, id, rev, at, `state = 'booting', state_changed_at = $3`);
        return;
      case 'VmBooted':
        await update(sql, id, rev, at, `state = 'running', url = $4, endpoints = $5, boot_ms = $6, state_changed_at = $3, last_activity_at = $3`, [event.data.url, JSON.stringify(event.data.endpoints), event.data.boot_ms]);
        return;
      case 'VmActivityRecorded':
        await update(sql, id, rev, at, `last_activity_at = GREATEST(last_activity_at, $4::timestamptz)`, [event.data.at]);
        return;
      case 'VmDestroyRequested':
        await update(sql, id, rev, at, `state = 'destroying', reason = $4, state_changed_at = $3`, [event.data.reason]);
        return;
      case 'VmDestroyed':
        await update(sql, id, rev, at, `state = 'destroyed', reason = $4, state_changed_at = $3`, [event.data.reason]);
        return;
      case 'VmMigrated':
        await update(sql, id, rev, at, `host_id = $4, placement = $5, url = $6, endpoints = $7`, [event.data.host_id, JSON.stringify(event.data.decision), event.data.url, JSON.stringify(event.data.endpoints)]);
        return;
      case 'VmFailed':
        await update(sql, id, rev, at, `state = 'failed', reason = $4, error = $5, error_code = $6, failed_phase = $7, state_changed_at = $3`, [event.data.reason, event.data.error, event.data.error_code ?? null, event.data.phase]);
        return;
    }
  },
};

async function update(sql: Sql, id: string, rev: string, at: Date, set: string, params: unknown[] = []): Promise<void> {
  await sql.query(`UPDATE vms SET ${set}, revision = $2, updated_at = $3 WHERE id = $1`, [id, rev, at, ...params]);
}
