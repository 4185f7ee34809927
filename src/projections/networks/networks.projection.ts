import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isNetworkEventType, NETWORK_STREAM_PREFIX, parseNetworkEvent } from '../../domain/network/network.events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * The `networks` and `network_members` read model: one row per tenant
 * network (gone when deleted) and one per VM that joined it. Whether a
 * member is live is the `vms` read model's state, joined at query time.
 */
export const networksProjection: Projection = {
  name: 'networks',
  migrations: [
    {
      id: 'networks_0001',
      sql: `CREATE TABLE IF NOT EXISTS networks (
              id text PRIMARY KEY,
              tenant_id text NOT NULL,
              name text NOT NULL,
              subnet text NOT NULL,
              created_at timestamptz NOT NULL
            );
            CREATE INDEX IF NOT EXISTS networks_tenant ON networks (tenant_id, created_at);
            CREATE TABLE IF NOT EXISTS network_members (
              network_id text NOT NULL,
              vm_id text NOT NULL,
              ip text NOT NULL,
              host_id text NOT NULL,
              joined_at timestamptz NOT NULL,
              PRIMARY KEY (network_id, vm_id)
            );`,
    },
  ],
  tables: [
    { name: 'network_members', key: ['network_id', 'vm_id'] },
    { name: 'networks', key: ['id'] },
  ],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith(NETWORK_STREAM_PREFIX) || !isNetworkEventType(recorded.type)) return;
    const e = parseNetworkEvent(recorded.type, recorded.data);
    switch (e.type) {
      case 'NetworkCreated':
        await sql.query(
          `INSERT INTO networks (id, tenant_id, name, subnet, created_at) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING`,
          [e.data.network_id, e.data.tenant_id, e.data.name, e.data.subnet, e.data.at],
        );
        return;
      case 'NetworkMemberJoined':
        await sql.query(
          `INSERT INTO network_members (network_id, vm_id, ip, host_id, joined_at) VALUES ($1, $2, $3, $4, $5)
           ON CONFLICT (network_id, vm_id) DO NOTHING`,
          [e.data.network_id, e.data.vm_id, e.data.ip, e.data.host_id, e.data.at],
        );
        return;
      case 'NetworkDeleted':
        await sql.query(`DELETE FROM network_members WHERE network_id = $1`, [e.data.network_id]);
        await sql.query(`DELETE FROM networks WHERE id = $1`, [e.data.network_id]);
        return;
    }
  },
};
