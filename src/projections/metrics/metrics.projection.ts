import type { RecordedEvent } from '../../domain/event-store.port.js';
import { parseVmEvent } from '../../domain/vm/vm.events.js';
import type { Projection, Sql } from '../projection.js';

/** Upper bounds (seconds) of the boot duration histogram; +Inf is implied. */
export const BOOT_BUCKETS_S = [0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300] as const;

/**
 * Event-derived metrics: counts that are facts about the log, not about this
 * process, so they survive restarts and agree across replicas (a scrape of
 * any replica reads the same table). Buckets are stored non-cumulative; the
 * exposition accumulates them.
 *
 * `metrics_counters` is where snapshot and egress events add their counts
 * once those events exist; the metric names they feed are defined in
 * `EVENT_COUNTERS` now so dashboards can be built against them. (Reconcile
 * summaries are counted by the reconciler's own fleet_reconcile_* metrics.)
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
  ],
  tables: [
    { name: 'metrics_boot_buckets', key: ['le'] },
    { name: 'metrics_counters', key: ['name', 'labels'] },
  ],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    await applyMetricsBatch(sql, [recorded]);
  },
  applyBatch: (sql: Sql, events: readonly RecordedEvent[]) => applyMetricsBatch(sql, events),
};

/** Sums the batch's boots per bucket in memory: one statement per batch. */
async function applyMetricsBatch(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const buckets = new Map<number, { n: number; ms: number }>();
  for (const recorded of events) {
    if (recorded.type !== 'VmBooted' || !recorded.streamId.startsWith('vm-')) continue;
    const e = parseVmEvent(recorded.type, recorded.data);
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

/**
 * Counters fed by later events (snapshot lifecycle after the seed's
 * SnapshotCountKey, egress failures after EgressMetrics): name → help and the
 * label sets published at zero until the events land.
 */
export const EVENT_COUNTERS = {
  fleet_snapshot_transitions_total: {
    help: 'Snapshot state transitions by state and mode (snapshot events; SnapshotCountKey)',
    labels: ['creating', 'ready', 'restoring', 'failed'].flatMap((state) => ['manual', 'build'].map((mode) => ({ state, mode }))),
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
