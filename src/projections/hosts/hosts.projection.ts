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
  apply: (sql: Sql, recorded: RecordedEvent) => applyHostEvents(sql, [recorded]),
  applyBatch: applyHostEvents,
};

interface HostRowState {
  id: string;
  url: string;
  region: string;
  backend: string;
  labels: unknown;
  capacity: unknown;
  arch: string;
  cordoned: boolean;
  reachable: boolean;
  deregistered: boolean;
  state: string;
  token_encrypted: string;
  allocated_cpus: number;
  allocated_ram_mb: number;
  allocated_storage_gb: number;
  allocated_vms: number;
  allocated_gpus: number;
  revision: string;
  last_seen: Date;
  created_at: Date;
  updated_at: Date;
}

const HOST_COLUMNS: ReadonlyArray<[keyof HostRowState, string]> = [
  ['id', 'text'],
  ['url', 'text'],
  ['region', 'text'],
  ['backend', 'text'],
  ['labels', 'jsonb'],
  ['capacity', 'jsonb'],
  ['arch', 'text'],
  ['cordoned', 'boolean'],
  ['reachable', 'boolean'],
  ['deregistered', 'boolean'],
  ['state', 'text'],
  ['token_encrypted', 'text'],
  ['allocated_cpus', 'integer'],
  ['allocated_ram_mb', 'integer'],
  ['allocated_storage_gb', 'integer'],
  ['allocated_vms', 'integer'],
  ['allocated_gpus', 'integer'],
  ['revision', 'bigint'],
  ['last_seen', 'timestamptz'],
  ['created_at', 'timestamptz'],
  ['updated_at', 'timestamptz'],
];

/** A (host, vm) reservation as the batch sees it: whether it exists now, and the row to write if this batch made it. */
interface Hold {
  exists: boolean;
  written?: { reservation: Reservation; at: Date } | undefined;
}

/**
 * Load, fold, write (like the vms read model): the host rows and the
 * reservations a run of events touches are read once, the events are folded
 * in order in memory, and the result is written in a few statements. One
 * event is a run of one, so live and replay share this code. Allocation
 * moves only when a reservation really appears or disappears, so a
 * re-delivered event changes nothing.
 */
async function applyHostEvents(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const hostEvents = events
    .filter((r) => r.streamId.startsWith('host-') && isHostEventType(r.type))
    .map((r) => ({ r, e: parseHostEvent(r.type, r.data) }));
  if (hostEvents.length === 0) return;
  const ids = [...new Set(hostEvents.map(({ e }) => e.data.host_id))];
  const loaded = await sql.query(`SELECT ${HOST_COLUMNS.map(([c]) => c).join(', ')} FROM hosts WHERE id = ANY($1::text[])`, [ids]);
  const hosts = new Map<string, HostRowState>(
    loaded.rows.map((row) => [row.id as string, { ...(row as unknown as HostRowState), revision: String(row.revision) }]),
  );

  const pairKey = (h: string, v: string): string => `${h}\u0000${v}`;
  const pairs = hostEvents.flatMap(({ e }) =>
    e.type === 'CapacityReserved' || e.type === 'CapacityReleased' ? [[e.data.host_id, e.data.vm_id] as const] : [],
  );
  const holds = new Map<string, Hold>(pairs.map(([h, v]) => [pairKey(h, v), { exists: false }]));
  // Every pair of the batch has its hold from the line above; this only spares the lookups a non-null assertion.
  const holdOf = (h: string, v: string): Hold => {
    const key = pairKey(h, v);
    const found = holds.get(key);
    if (found) return found;
    const hold: Hold = { exists: false };
    holds.set(key, hold);
    return hold;
  };
  if (pairs.length > 0) {
    const existing = await sql.query<{ host_id: string; vm_id: string }>(
      `SELECT host_id, vm_id FROM host_reservations WHERE (host_id, vm_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))`,
      [pairs.map(([h]) => h), pairs.map(([, v]) => v)],
    );
    for (const row of existing.rows) holdOf(row.host_id, row.vm_id).exists = true;
  }
  const wiped = new Set<string>();
  const touched = new Set<string>();

  for (const { r, e } of hostEvents) {
    const id = e.data.host_id;
    const at = r.created;
    const rev = r.revision.toString();
    if (e.type === 'HostRegistered') {
      const d = e.data;
      const prior = hosts.get(id);
      hosts.set(id, {
        id,
        url: d.url,
        region: d.region,
        backend: d.backend,
        labels: d.labels,
        capacity: d.capacity,
        arch: d.capacity.arch || 'amd64',
        cordoned: false,
        reachable: true,
        deregistered: false,
        state: 'active',
        token_encrypted: d.token_encrypted,
        allocated_cpus: prior?.allocated_cpus ?? 0,
        allocated_ram_mb: prior?.allocated_ram_mb ?? 0,
        allocated_storage_gb: prior?.allocated_storage_gb ?? 0,
        allocated_vms: prior?.allocated_vms ?? 0,
        allocated_gpus: prior?.allocated_gpus ?? 0,
        revision: rev,
        last_seen: at,
        created_at: prior?.created_at ?? at,
        updated_at: at,
      });
      touched.add(id);
      continue;
    }
    if (e.type === 'HostDeregistered') {
      // Every hold of this host goes, whether this batch knows of it or not.
      wiped.add(id);
      for (const [key, hold] of holds) if (key.startsWith(`${id}\u0000`)) Object.assign(hold, { exists: false, written: undefined });
    }
    let sign = 0;
    if (e.type === 'CapacityReserved' || e.type === 'CapacityReleased') {
      const hold = holdOf(id, e.data.vm_id);
      if (e.type === 'CapacityReserved' && !hold.exists) {
        Object.assign(hold, { exists: true, written: { reservation: reservationOf(e.data), at } });
        sign = 1;
      } else if (e.type === 'CapacityReleased' && hold.exists) {
        Object.assign(hold, { exists: false, written: undefined });
        sign = -1;
      }
    }
    const row = hosts.get(id);
    if (!row) continue;
    touched.add(id);
    row.revision = rev;
    row.updated_at = at;
    switch (e.type) {
      case 'HostCapacityProbed':
        Object.assign(row, { capacity: e.data.capacity, arch: e.data.capacity.arch || 'amd64', last_seen: at });
        break;
      case 'HostCordoned':
        row.cordoned = true;
        break;
      case 'HostUncordoned':
        row.cordoned = false;
        break;
      case 'HostMarkedUnreachable':
        row.reachable = false;
        break;
      case 'HostReachable':
        Object.assign(row, { reachable: true, last_seen: at });
        break;
      case 'HostTokenResealed':
        row.token_encrypted = e.data.token_encrypted;
        break;
      case 'HostDeregistered':
        Object.assign(row, {
          deregistered: true,
          allocated_cpus: 0,
          allocated_ram_mb: 0,
          allocated_storage_gb: 0,
          allocated_vms: 0,
          allocated_gpus: 0,
        });
        break;
      case 'CapacityReserved':
      case 'CapacityReleased':
        row.allocated_cpus += sign * e.data.cpus;
        row.allocated_ram_mb += sign * e.data.ram_mb;
        row.allocated_storage_gb += sign * e.data.storage_gb;
        row.allocated_vms += sign;
        row.allocated_gpus += sign * e.data.gpus;
        break;
    }
    row.state = row.deregistered ? 'deregistered' : !row.reachable ? 'unreachable' : row.cordoned ? 'cordoned' : 'active';
  }

  if (wiped.size > 0) await sql.query('DELETE FROM host_reservations WHERE host_id = ANY($1::text[])', [[...wiped]]);
  const gone = [...holds].filter(([, h]) => !h.exists).map(([k]) => k.split('\u0000') as [string, string]);
  if (gone.length > 0) {
    await sql.query(`DELETE FROM host_reservations WHERE (host_id, vm_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))`, [
      gone.map(([h]) => h),
      gone.map(([, v]) => v),
    ]);
  }
  const made = [...holds].flatMap(([k, h]) => {
    if (!h.exists || !h.written) return [];
    const [host_id, vm_id] = k.split('\u0000') as [string, string];
    return [{ host_id, vm_id, reservation: h.written.reservation, reserved_at: h.written.at }];
  });
  if (made.length > 0) {
    await sql.query(
      `INSERT INTO host_reservations (host_id, vm_id, reservation, reserved_at)
       SELECT r.host_id, r.vm_id, r.reservation, r.reserved_at FROM jsonb_to_recordset($1::jsonb) AS r(host_id text, vm_id text, reservation jsonb, reserved_at timestamptz)
       ON CONFLICT (host_id, vm_id) DO UPDATE SET reservation = EXCLUDED.reservation, reserved_at = EXCLUDED.reserved_at`,
      [JSON.stringify(made)],
    );
  }
  if (touched.size > 0) {
    const cols = HOST_COLUMNS.map(([c]) => c);
    await sql.query(
      `INSERT INTO hosts (${cols.join(', ')})
       SELECT ${cols.map((c) => `r.${c}`).join(', ')} FROM jsonb_to_recordset($1::jsonb) AS r(${HOST_COLUMNS.map(([c, t]) => `${c} ${t}`).join(', ')})
       ON CONFLICT (id) DO UPDATE SET ${cols
         .filter((c) => c !== 'id')
         .map((c) => `${c} = EXCLUDED.${c}`)
         .join(', ')}`,
      // Every touched id was set in `hosts` above.
      [JSON.stringify([...touched].flatMap((id) => hosts.get(id) ?? []))],
    );
  }
}

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
