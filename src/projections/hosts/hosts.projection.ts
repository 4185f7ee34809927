import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isHostEventType, parseHostEvent, type Reservation } from '../../domain/host/host.events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * The `hosts` read model: the placement view (capacity, allocated, state,
 * labels, arch, backend, last seen) and the registry the API lists. Allocated
 * totals are derived from the per-VM reservations in `host_reservations`, the
 * same way the host aggregate derives them, so a rebuild lands on the same
 * numbers. Times come from the events, never from now(), so a rebuild is
 * byte-for-byte the live table.
 */
export const hostsProjection: Projection = {
  name: 'hosts',
  migrations: [
    {
      id: 'hosts_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS hosts (
          id text PRIMARY KEY,
          url text NOT NULL,
          region text NOT NULL,
          backend text NOT NULL,
          labels jsonb NOT NULL,
          capacity jsonb NOT NULL,
          arch text NOT NULL,
          cordoned boolean NOT NULL DEFAULT false,
          reachable boolean NOT NULL DEFAULT true,
          deregistered boolean NOT NULL DEFAULT false,
          state text NOT NULL,
          token_encrypted text NOT NULL,
          allocated_cpus integer NOT NULL DEFAULT 0,
          allocated_ram_mb integer NOT NULL DEFAULT 0,
          allocated_storage_gb integer NOT NULL DEFAULT 0,
          allocated_vms integer NOT NULL DEFAULT 0,
          allocated_gpus integer NOT NULL DEFAULT 0,
          revision bigint NOT NULL,
          last_seen timestamptz NOT NULL,
          created_at timestamptz NOT NULL,
          updated_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS hosts_state_idx ON hosts (state);
        CREATE TABLE IF NOT EXISTS host_reservations (
          host_id text NOT NULL,
          vm_id text NOT NULL,
          reservation jsonb NOT NULL,
          reserved_at timestamptz NOT NULL,
          PRIMARY KEY (host_id, vm_id)
        );`,
    },
  ],
  tables: [
    { name: 'hosts', key: ['id'] },
    { name: 'host_reservations', key: ['host_id', 'vm_id'] },
  ],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith('host-') || !isHostEventType(recorded.type)) return;
    const event = parseHostEvent(recorded.type, recorded.data);
    const at = recorded.created;
    const rev = recorded.revision.toString();
    switch (event.type) {
      case 'HostRegistered': {
        const d = event.data;
        await sql.query(
          `INSERT INTO hosts (id, url, region, backend, labels, capacity, arch, state, token_encrypted, revision, last_seen, created_at, updated_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, 'active', $8, $9, $10, $10, $10)
           ON CONFLICT (id) DO UPDATE SET url = $2, region = $3, backend = $4, labels = $5, capacity = $6, arch = $7,
             cordoned = false, reachable = true, deregistered = false, state = 'active', token_encrypted = $8,
             revision = $9, last_seen = $10, updated_at = $10`,
          [d.host_id, d.url, d.region, d.backend, JSON.stringify(d.labels), JSON.stringify(d.capacity), d.capacity.arch || 'amd64', d.token_encrypted, rev, at],
        );
        return;
      }
      case 'HostCapacityProbed':
        await touch(sql, event.data.host_id, rev, at, `capacity = $4, arch = $5, last_seen = $3`, [JSON.stringify(event.data.capacity), event.data.capacity.arch || 'amd64']);
        return;
      case 'HostCordoned':
        await touch(sql, event.data.host_id, rev, at, `cordoned = true`, [], { cordoned: true });
        return;
      case 'HostUncordoned':
        await touch(sql, event.data.host_id, rev, at, `cordoned = false`, [], { cordoned: false });
        return;
      case 'HostMarkedUnreachable':
        await touch(sql, event.data.host_id, rev, at, `reachable = false`, [], { reachable: false });
        return;
      case 'HostReachable':
        await touch(sql, event.data.host_id, rev, at, `reachable = true, last_seen = $3`, [], { reachable: true });
        return;
      case 'HostDeregistered':
        await sql.query('DELETE FROM host_reservations WHERE host_id = $1', [event.data.host_id]);
        await touch(sql, event.data.host_id, rev, at, `deregistered = true, allocated_cpus = 0, allocated_ram_mb = 0, allocated_storage_gb = 0, allocated_vms = 0, allocated_gpus = 0`, [], { deregistered: true });
        return;
      case 'CapacityReserved': {
        const r = event.data;
        const inserted = await sql.query(
          `INSERT INTO host_reservations (host_id, vm_id, reservation, reserved_at) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING`,
          [r.host_id, r.vm_id, JSON.stringify(reservationOf(r)), at],
        );
        const sign = inserted.rowCount ? 1 : 0;
        await touch(sql, r.host_id, rev, at, allocationDelta(sign), [r.cpus, r.ram_mb, r.storage_gb, r.gpus]);
        return;
      }
      case 'CapacityReleased': {
        const r = event.data;
        const deleted = await sql.query('DELETE FROM host_reservations WHERE host_id = $1 AND vm_id = $2', [r.host_id, r.vm_id]);
        const sign = deleted.rowCount ? -1 : 0;
        await touch(sql, r.host_id, rev, at, allocationDelta(sign), [r.cpus, r.ram_mb, r.storage_gb, r.gpus]);
        return;
      }
    }
  },
};

function reservationOf(r: Reservation): Reservation {
  return {
    vm_id: r.vm_id,
    cpus: r.cpus,
    ram_mb: r.ram_mb,
    storage_gb: r.storage_gb,
    gpus: r.gpus,
    gpu_kind: r.gpu_kind,
    gpu_profile: r.gpu_profile,
    gpu_uuids: r.gpu_uuids,
    mig_instance_uuids: r.mig_instance_uuids,
  };
}

function allocationDelta(sign: number): string {
  return `allocated_cpus = allocated_cpus + ${sign} * $4, allocated_ram_mb = allocated_ram_mb + ${sign} * $5,
          allocated_storage_gb = allocated_storage_gb + ${sign} * $6, allocated_vms = allocated_vms + ${sign},
          allocated_gpus = allocated_gpus + ${sign} * $7`;
}

type StateFlags = Partial<Record<'cordoned' | 'reachable' | 'deregistered', boolean>>;

/**
 * Updates one host row, its stream revision and its time, plus `set` with
 * params from $4, in ONE statement. When the event changes a state flag, the
 * derived `state` is recomputed in the same UPDATE with that flag's new value
 * (SET expressions see the old row), so hot events (reservations) stay one
 * statement and flag events need no second one.
 */
async function touch(sql: Sql, hostId: string, rev: string, at: Date, set: string, params: unknown[] = [], flags?: StateFlags): Promise<void> {
  const f = (name: keyof StateFlags): string => (flags?.[name] === undefined ? name : String(flags[name]));
  const state = flags
    ? `, state = CASE WHEN ${f('deregistered')} THEN 'deregistered' WHEN NOT ${f('reachable')} THEN 'unreachable' WHEN ${f('cordoned')} THEN 'cordoned' ELSE 'active' END`
    : '';
  await sql.query(`UPDATE hosts SET ${set}${state}, revision = $2, updated_at = $3 WHERE id = $1`, [hostId, rev, at, ...params]);
}
