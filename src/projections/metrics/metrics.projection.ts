import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isVmEventType } from '../../domain/vm/vm.events.js';
import { parsedVmEvent } from '../parsed-events.js';
import { VM_END_REASONS } from '../../domain/vm/vm.lifecycle.js';
import { isSnapshotEventType, parseSnapshotEvent, SNAPSHOT_STREAM_PREFIX } from '../../domain/snapshot/snapshot.events.js';
import type { Projection, Sql } from '../projection.js';

/** Upper bounds (seconds) of the boot duration histogram; +Inf is implied. */
export const BOOT_BUCKETS_S = [0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300] as const;

/**
 * Event-derived metrics: counts that are facts about the log, not about this
 * process, so they survive restarts and agree across replicas (a scrape of
 * any replica reads the same table). Buckets are stored non-cumulative; the
 * exposition accumulates them.
 *
 * `metrics_counters` holds the counters of `EVENT_COUNTERS` that events
 * feed: snapshot transitions (snapshot events) and VM ends by reason.
 * Egress failures are counted from VmEgressFailed, by provider and
 * operation, once one happened (providers are the operator's to name).
 * (Reconcile summaries are counted by the reconciler's own
 * fleet_reconcile_* metrics.)
 */
export const metricsProjection: Projection = {
  name: 'metrics',
  migrations: [
    {
      id: 'metrics_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS metrics_boot_buckets (
          le double precision PRIMARY KEY,
          observations bigint NOT NULL,
          sum_ms bigint NOT NULL
        );
        CREATE TABLE IF NOT EXISTS metrics_counters (
          name text NOT NULL,
          labels text NOT NULL DEFAULT '',
          value double precision NOT NULL,
          PRIMARY KEY (name, labels)
        );`,
    },
    {
      // A snapshot's later events do not repeat its mode: remembered from SnapshotRequested.
      id: 'metrics_0002_snapshot_modes',
      sql: `CREATE TABLE IF NOT EXISTS metrics_snapshot_modes (snapshot_id text PRIMARY KEY, mode text NOT NULL);`,
    },
  ],
  tables: [
    { name: 'metrics_boot_buckets', key: ['le'] },
    { name: 'metrics_counters', key: ['name', 'labels'] },
    { name: 'metrics_snapshot_modes', key: ['snapshot_id'] },
  ],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    await applyMetricsBatch(sql, [recorded]);
  },
  applyBatch: (sql: Sql, events: readonly RecordedEvent[]) => applyMetricsBatch(sql, events),
};

/** Sums the batch's boots per bucket in memory: one statement per batch. */
async function applyMetricsBatch(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  await applyCounters(sql, events);
  const buckets = new Map<number, { n: number; ms: number }>();
  for (const recorded of events) {
    if (recorded.type !== 'VmBooted' || !recorded.streamId.startsWith('vm-')) continue;
    const e = parsedVmEvent(recorded); // VmBooted: the metadata-dependent upgrade concerns ending reasons only
    if (e.type !== 'VmBooted') continue;
    const le = BOOT_BUCKETS_S.find((b) => e.data.boot_ms / 1000 <= b) ?? Number.POSITIVE_INFINITY;
    const b = buckets.get(le) ?? { n: 0, ms: 0 };
    b.n += 1;
    b.ms += e.data.boot_ms;
    buckets.set(le, b);
  }
  if (buckets.size === 0) return;
  const all = [...buckets];
  await sql.query(
    `INSERT INTO metrics_boot_buckets (le, observations, sum_ms)
     SELECT * FROM unnest($1::float8[], $2::bigint[], $3::bigint[])
     ON CONFLICT (le) DO UPDATE SET observations = metrics_boot_buckets.observations + EXCLUDED.observations, sum_ms = metrics_boot_buckets.sum_ms + EXCLUDED.sum_ms`,
    [all.map(([le]) => (le === Number.POSITIVE_INFINITY ? 'Infinity' : le)), all.map(([, b]) => b.n), all.map(([, b]) => b.ms)],
  );
}

/** Which snapshot event is which transition of fleet_snapshot_transitions_total. */
const SNAPSHOT_TRANSITIONS: Readonly<Record<string, string>> = {
  SnapshotRequested: 'creating',
  SnapshotTaken: 'ready',
  SnapshotFailed: 'failed',
  SnapshotUsed: 'restoring',
  SnapshotDeleted: 'deleted',
};

const labelText = (labels: Record<string, string>): string =>
  Object.entries(labels)
    .sort(([a], [b]) => (a < b ? -1 : 1))
    .map(([k, v]) => `${k}=${v}`)
    .join(',');

/** Snapshot transitions and VM ends, summed per label set in memory: a few statements per batch. */
async function applyCounters(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const snaps = events.filter(
    (r) => r.streamId.startsWith(SNAPSHOT_STREAM_PREFIX) && r.type in SNAPSHOT_TRANSITIONS && isSnapshotEventType(r.type),
  );
  const ends = events.filter(
    (r) =>
      r.streamId.startsWith('vm-') &&
      (r.type === 'VmDestroyed' || r.type === 'VmFailed' || r.type === 'VmEgressFailed') &&
      isVmEventType(r.type),
  );
  if (snaps.length === 0 && ends.length === 0) return;
  const counts = new Map<string, { name: string; labels: string; n: number }>();
  const inc = (name: string, labels: Record<string, string>): void => {
    const text = labelText(labels);
    const key = `${name}\0${text}`;
    const c = counts.get(key) ?? { name, labels: text, n: 0 };
    c.n += 1;
    counts.set(key, c);
  };
  if (snaps.length > 0) {
    const parsed = snaps.map((r) => parseSnapshotEvent(r.type, r.data));
    const modes = new Map<string, string>();
    for (const e of parsed) if (e.type === 'SnapshotRequested') modes.set(e.data.snapshot_id, e.data.mode);
    if (modes.size > 0)
      await sql.query(
        'INSERT INTO metrics_snapshot_modes (snapshot_id, mode) SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT (snapshot_id) DO NOTHING',
        [[...modes.keys()], [...modes.values()]],
      );
    const unknown = [...new Set(parsed.map((e) => e.data.snapshot_id))].filter((id) => !modes.has(id));
    if (unknown.length > 0) {
      const { rows } = await sql.query<{ snapshot_id: string; mode: string }>(
        'SELECT snapshot_id, mode FROM metrics_snapshot_modes WHERE snapshot_id = ANY($1::text[])',
        [unknown],
      );
      for (const r of rows) modes.set(r.snapshot_id, r.mode);
    }
    for (const e of parsed) {
      const mode = modes.get(e.data.snapshot_id);
      const state = SNAPSHOT_TRANSITIONS[e.type];
      if (mode !== undefined && state !== undefined) inc('fleet_snapshot_transitions_total', { state, mode });
    }
  }
  for (const r of ends) {
    const e = parsedVmEvent(r);
    if (e.type === 'VmDestroyed' || e.type === 'VmFailed') inc('fleet_vm_ends_total', { reason: e.data.reason });
    // Provider names are registry keys ([a-z0-9_-]); anything else would break the stored label text.
    if (e.type === 'VmEgressFailed')
      inc('fleet_egress_failures_total', { provider: e.data.provider.replace(/[^a-z0-9_-]/g, '_'), op: e.data.op });
  }
  const all = [...counts.values()];
  await sql.query(
    `INSERT INTO metrics_counters (name, labels, value) SELECT * FROM unnest($1::text[], $2::text[], $3::float8[])
     ON CONFLICT (name, labels) DO UPDATE SET value = metrics_counters.value + EXCLUDED.value`,
    [all.map((c) => c.name), all.map((c) => c.labels), all.map((c) => c.n)],
  );
}

/**
 * Counters fed by later events (snapshot lifecycle after the seed's
 * SnapshotCountKey, egress failures after EgressMetrics): name → help and the
 * label sets published at zero until the events land.
 */
export const EVENT_COUNTERS = {
  fleet_snapshot_transitions_total: {
    help: 'Snapshot state transitions by state and mode (snapshot events; SnapshotCountKey)',
    labels: ['creating', 'ready', 'restoring', 'failed', 'deleted'].flatMap((state) =>
      ['manual', 'build'].map((mode) => ({ state, mode })),
    ),
  },
  fleet_vm_ends_total: {
    help: 'VMs that ended, by reason (VmDestroyed and VmFailed)',
    labels: VM_END_REASONS.map((reason) => ({ reason })),
  },
  fleet_egress_failures_total: {
    help: 'Egress provision/teardown failures by provider and operation (EgressMetrics)',
    labels: [] as Array<Record<string, string>>,
  },
} as const satisfies Record<string, { help: string; labels: ReadonlyArray<Record<string, string>> }>;

export interface BootHistogram {
  /** Cumulative counts per upper bound, ending with +Inf. */
  readonly buckets: Array<{ le: number; count: number }>;
  readonly count: number;
  readonly sumSeconds: number;
}

export async function bootHistogram(sql: Sql): Promise<BootHistogram> {
  const { rows } = await sql.query<{ le: number; observations: string; sum_ms: string }>(
    'SELECT le, observations, sum_ms FROM metrics_boot_buckets',
  );
  const by = new Map(rows.map((r) => [r.le, r]));
  let cumulative = 0;
  let sumMs = 0;
  const buckets: Array<{ le: number; count: number }> = [];
  for (const le of [...BOOT_BUCKETS_S, Number.POSITIVE_INFINITY]) {
    const r = by.get(le);
    cumulative += Number(r?.observations ?? 0);
    sumMs += Number(r?.sum_ms ?? 0);
    buckets.push({ le, count: cumulative });
  }
  return { buckets, count: cumulative, sumSeconds: sumMs / 1000 };
}

/** Stored counter values; labels are stored as canonical `k=v,k=v` text. */
export async function eventCounters(sql: Sql): Promise<Array<{ name: string; labels: Record<string, string>; value: number }>> {
  const { rows } = await sql.query<{ name: string; labels: string; value: number }>(
    'SELECT name, labels, value FROM metrics_counters ORDER BY name, labels',
  );
  return rows.map((r) => ({
    name: r.name,
    value: r.value,
    labels: Object.fromEntries(r.labels ? r.labels.split(',').map((kv) => kv.split('=') as [string, string]) : []),
  }));
}
