import type { Sql } from '../projection.js';
import { GB_BYTES, HOUR_MS, splitSnapshotUsage, splitUsage, USAGE_METRICS, type UsageMetric } from './billing.projection.js';

export type GroupBy = 'hour' | 'day';

export interface UsageQuery {
  /** Inclusive, on a UTC hour boundary. */
  readonly from: Date;
  /** Exclusive, on a UTC hour boundary. */
  readonly to: Date;
  readonly groupBy: GroupBy;
  /** Undefined: every tenant (admins only). */
  readonly tenantId: string | undefined;
  /** Open intervals are billed up to here (clipped to `to`); never written. */
  readonly now: Date;
}

export interface UsageRow {
  readonly tenant_id: string;
  readonly period_start: string;
  readonly vm_seconds: number;
  readonly cpu_seconds: number;
  readonly ram_mb_seconds: number;
  readonly gpu_seconds: Record<string, number>;
  readonly snapshot_gb_hours: number;
  /** Whether a still-running VM or a still-stored snapshot contributed (the figure grows until it ends). */
  readonly includes_running: boolean;
}

/** Decimal text → integer micro-units: sums stay exact whatever the stored scale. */
function toMicro(text: string): bigint {
  const negative = text.startsWith('-');
  const [whole = '0', frac = ''] = (negative ? text.slice(1) : text).split('.');
  const v = BigInt(whole) * 1_000_000n + BigInt((frac + '000000').slice(0, 6));
  return negative ? -v : v;
}

function microToNumber(v: bigint): number {
  // Exact to the millionth for any realistic bill; numbers on the wire are what clients expect.
  return Number(v) / 1_000_000;
}

function periodStart(ms: number, groupBy: GroupBy): number {
  const unit = groupBy === 'hour' ? HOUR_MS : 24 * HOUR_MS;
  return Math.floor(ms / unit) * unit;
}

/** Closed usage from the table, plus every open interval up to `now`, summed per tenant and period. */
export async function queryUsage(sql: Sql, q: UsageQuery): Promise<UsageRow[]> {
  type Acc = { tenant: string; period: number; m: Map<string, bigint>; running: boolean };
  const acc = new Map<string, Acc>();
  const add = (tenant: string, periodMs: number, metric: UsageMetric, kind: string, micro: bigint, running: boolean): void => {
    const key = `${tenant}\0${periodMs}`;
    let a = acc.get(key);
    if (!a) acc.set(key, (a = { tenant, period: periodMs, m: new Map(), running: false }));
    const mk = `${metric}\0${kind}`;
    a.m.set(mk, (a.m.get(mk) ?? 0n) + micro);
    if (running) a.running = true;
  };

  const closed = await sql.query<{ tenant_id: string; hour: Date; metric: string; kind: string; quantity: string }>(
    `SELECT tenant_id, hour, metric, kind, quantity::text AS quantity FROM billing_usage
      WHERE hour >= $1 AND hour < $2 AND ($3::text IS NULL OR tenant_id = $3)`,
    [q.from, q.to, q.tenantId ?? null],
  );
  for (const r of closed.rows) {
    if (!(USAGE_METRICS as readonly string[]).includes(r.metric)) continue;
    add(r.tenant_id, periodStart(r.hour.getTime(), q.groupBy), r.metric as UsageMetric, r.kind, toMicro(r.quantity), false);
  }

  const end = Math.min(q.now.getTime(), q.to.getTime());
  const open = await sql.query<{ tenant_id: string; cpus: number; ram_mb: number; gpus: number; gpu_kind: string; started_at: Date }>(
    `SELECT tenant_id, cpus, ram_mb, gpus, gpu_kind, started_at FROM billing_vms
      WHERE started_at IS NOT NULL AND started_at < $1 AND ($2::text IS NULL OR tenant_id = $2)`,
    [new Date(end), q.tenantId ?? null],
  );
  for (const r of open.rows) {
    const start = Math.max(r.started_at.getTime(), q.from.getTime());
    for (const p of splitUsage(r, start, end)) add(r.tenant_id, periodStart(p.hourMs, q.groupBy), p.metric, p.kind, p.milli * 1000n, true);
  }
  const stored = await sql.query<{ tenant_id: string; mode: string; size_bytes: string; started_at: Date }>(
    `SELECT tenant_id, mode, size_bytes, started_at FROM billing_snapshots
      WHERE started_at IS NOT NULL AND started_at < $1 AND ($2::text IS NULL OR tenant_id = $2)`,
    [new Date(end), q.tenantId ?? null],
  );
  for (const r of stored.rows) {
    const start = Math.max(r.started_at.getTime(), q.from.getTime());
    for (const p of splitSnapshotUsage(Number(r.size_bytes), r.mode, start, end))
      add(r.tenant_id, periodStart(p.hourMs, q.groupBy), p.metric, p.kind, p.milli * 1000n, true);
  }

  return [...acc.values()]
    .sort((a, b) => (a.tenant < b.tenant ? -1 : a.tenant > b.tenant ? 1 : a.period - b.period))
    .map((a) => {
      const get = (metric: UsageMetric, kind = ''): number => microToNumber(a.m.get(`${metric}\0${kind}`) ?? 0n);
      const gpu: Record<string, number> = {};
      for (const [k, v] of a.m) {
        const [metric, kind] = k.split('\0') as [string, string];
        if (metric === 'gpu_seconds') gpu[kind] = microToNumber(v);
      }
      let snapshots = 0n;
      for (const [k, v] of a.m) if (k.startsWith('snapshot_byte_seconds\0')) snapshots += v;
      return {
        tenant_id: a.tenant,
        period_start: new Date(a.period).toISOString(),
        vm_seconds: get('vm_seconds'),
        cpu_seconds: get('cpu_seconds'),
        ram_mb_seconds: get('ram_mb_seconds'),
        gpu_seconds: gpu,
        snapshot_gb_hours: Number(snapshots) / 1_000_000 / 3600 / GB_BYTES,
        includes_running: a.running,
      };
    });
}

/** CSV with one column per GPU kind present, so a spreadsheet needs no JSON. */
export function usageCsv(rows: readonly UsageRow[]): string {
  const kinds = [...new Set(rows.flatMap((r) => Object.keys(r.gpu_seconds)))].sort();
  const header = [
    'tenant_id',
    'period_start',
    'vm_seconds',
    'cpu_seconds',
    'ram_mb_seconds',
    ...kinds.map((k) => `gpu_seconds:${k}`),
    'snapshot_gb_hours',
    'includes_running',
  ];
  const cell = (v: string | number | boolean): string => {
    const s = String(v);
    return /[",\n\r]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
  };
  const lines = [header.map(cell).join(',')];
  for (const r of rows) {
    lines.push(
      [
        r.tenant_id,
        r.period_start,
        r.vm_seconds,
        r.cpu_seconds,
        r.ram_mb_seconds,
        ...kinds.map((k) => r.gpu_seconds[k] ?? 0),
        r.snapshot_gb_hours,
        r.includes_running,
      ]
        .map(cell)
        .join(','),
    );
  }
  return `${lines.join('\r\n')}\r\n`;
}

/** One VM run as billing keeps it: its end reason beside what it was billed for within the window. */
export interface VmRunRow {
  readonly vm_id: string;
  readonly tenant_id: string;
  readonly started_at: string;
  /** Null while it runs. */
  readonly ended_at: string | null;
  /** The closed set of end reasons; null while it runs. */
  readonly reason: string | null;
  /** For `exited`/`oom`: how its init ended, when its host recorded it. */
  readonly exit_code: number | null;
  readonly exit_signal: string | null;
  readonly vm_seconds: number;
  readonly cpu_seconds: number;
  readonly ram_mb_seconds: number;
  readonly gpu_seconds: number;
  readonly gpu_kind: string;
}

/** Every VM run overlapping [from, to), ended ones with their reason, running ones up to `now`; oldest start first. */
export async function queryVmRuns(
  sql: Sql,
  q: Omit<UsageQuery, 'groupBy'> & { readonly reason?: string | undefined; readonly limit: number },
): Promise<VmRunRow[]> {
  const { rows } = await sql.query<{
    vm_id: string;
    tenant_id: string;
    started_at: Date;
    ended_at: Date | null;
    reason: string | null;
    exit_code: number | null;
    exit_signal: string | null;
    cpus: number;
    ram_mb: number;
    gpus: number;
    gpu_kind: string;
  }>(
    `SELECT * FROM (
       SELECT vm_id, tenant_id, started_at, ended_at, reason, exit_code, exit_signal, cpus, ram_mb, gpus, gpu_kind FROM billing_vm_runs
        WHERE started_at < $2 AND ended_at > $1
       UNION ALL
       SELECT vm_id, tenant_id, started_at, NULL, NULL, NULL, NULL, cpus, ram_mb, gpus, gpu_kind FROM billing_vms
        WHERE started_at IS NOT NULL AND started_at < LEAST($2, $3)) r
      WHERE ($4::text IS NULL OR tenant_id = $4) AND ($5::text IS NULL OR reason = $5)
      ORDER BY started_at, vm_id LIMIT $6`,
    [q.from, q.to, q.now, q.tenantId ?? null, q.reason ?? null, q.limit],
  );
  return rows.map((r) => {
    const start = Math.max(r.started_at.getTime(), q.from.getTime());
    const end = Math.min(r.ended_at?.getTime() ?? q.now.getTime(), q.to.getTime());
    const sum = (metric: UsageMetric): number =>
      Number(splitUsage(r, start, end).reduce((acc, p) => (p.metric === metric ? acc + p.milli : acc), 0n)) / 1000;
    return {
      vm_id: r.vm_id,
      tenant_id: r.tenant_id,
      started_at: r.started_at.toISOString(),
      ended_at: r.ended_at?.toISOString() ?? null,
      reason: r.reason,
      exit_code: r.exit_code,
      exit_signal: r.exit_signal,
      vm_seconds: sum('vm_seconds'),
      cpu_seconds: sum('cpu_seconds'),
      ram_mb_seconds: sum('ram_mb_seconds'),
      gpu_seconds: sum('gpu_seconds'),
      gpu_kind: r.gpu_kind,
    };
  });
}
