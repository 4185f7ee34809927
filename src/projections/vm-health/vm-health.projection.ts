import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isHealthEventType, parseHealthEvent, VM_HEALTH_STREAM_PREFIX } from '../../domain/health/health.events.js';
import type { Projection, Sql } from '../projection.js';

/** The `vm_health` read model: each VM's last recorded health verdict. */
export const vmHealthProjection: Projection = {
  name: 'vm_health',
  migrations: [
    {
      id: 'vm_health_0001',
      sql: `CREATE TABLE IF NOT EXISTS vm_health (
              vm_id text PRIMARY KEY,
              state text NOT NULL,
              since timestamptz NOT NULL,
              failures integer NOT NULL,
              message text NOT NULL,
              revision bigint NOT NULL
            );`,
    },
  ],
  tables: [{ name: 'vm_health', key: ['vm_id'] }],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith(VM_HEALTH_STREAM_PREFIX) || !isHealthEventType(recorded.type)) return;
    const d = parseHealthEvent(recorded.type, recorded.data).data;
    await sql.query(
      `INSERT INTO vm_health (vm_id, state, since, failures, message, revision) VALUES ($1, $2, $3, $4, $5, $6)
       ON CONFLICT (vm_id) DO UPDATE SET state = EXCLUDED.state, since = EXCLUDED.since, failures = EXCLUDED.failures, message = EXCLUDED.message, revision = EXCLUDED.revision`,
      [d.vm_id, d.state, d.since, d.failures, d.message, recorded.revision.toString()],
    );
  },
};

export interface VmHealthRow {
  state: string;
  since: string;
  failures: number;
  message: string;
}

export async function getVmHealth(sql: Sql, vmId: string): Promise<VmHealthRow | undefined> {
  const { rows } = await sql.query<{ state: string; since: Date; failures: number; message: string }>(
    `SELECT state, since, failures, message FROM vm_health WHERE vm_id = $1`,
    [vmId],
  );
  const r = rows[0];
  return r ? { state: r.state, since: r.since.toISOString(), failures: r.failures, message: r.message } : undefined;
}
