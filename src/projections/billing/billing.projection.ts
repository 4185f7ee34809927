import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isVmEventType } from '../../domain/vm/vm.events.js';
import { parsedVmEvent } from '../parsed-events.js';
import { isSnapshotEventType, parseSnapshotEvent, SNAPSHOT_STREAM_PREFIX } from '../../domain/snapshot/snapshot.events.js';
import type { Projection, Sql } from '../projection.js';

export const HOUR_MS = 3_600_000;

/** What one running VM is billed for, per millisecond it runs. */
export interface BilledShape {
  readonly cpus: number;
  readonly ram_mb: number;
  readonly gpus: number;
  /** '' when the VM has no GPU. */
  readonly gpu_kind: string;
}

/** One (hour, metric, kind) amount in thousandths of the metric's unit: integers, so sums are exact. */
export interface UsagePiece {
  readonly hourMs: number;
  readonly metric: UsageMetric;
  readonly kind: string;
  readonly milli: bigint;
}

/** `snapshot_byte_seconds` is stored (exact integers of byte-milliseconds); reads show it as `snapshot_gb_hours`. */
export const USAGE_METRICS = ['vm_seconds', 'cpu_seconds', 'ram_mb_seconds', 'gpu_seconds', 'snapshot_byte_seconds'] as const;
/** A GB of snapshot storage is 2^30 bytes. */
export const GB_BYTES = 1024 ** 3;
export type UsageMetric = (typeof USAGE_METRICS)[number];

/**
 * Splits [startMs, endMs) exactly at UTC hour boundaries into usage pieces.
 * Amounts are integer milli-units (a millisecond of one CPU is one
 * milli-CPU-second), so a replay or a query sums to the same digits.
 */
export function splitUsage(shape: BilledShape, startMs: number, endMs: number): UsagePiece[] {
  const out: UsagePiece[] = [];
  if (!(endMs > startMs)) return out;
  for (let hour = Math.floor(startMs / HOUR_MS) * HOUR_MS; hour < endMs; hour += HOUR_MS) {
    const ms = BigInt(Math.min(endMs, hour + HOUR_MS) - Math.max(startMs, hour));
    if (ms <= 0n) continue;
    out.push({ hourMs: hour, metric: 'vm_seconds', kind: '', milli: ms });
    out.push({ hourMs: hour, metric: 'cpu_seconds', kind: '', milli: ms * BigInt(shape.cpus) });
    out.push({ hourMs: hour, metric: 'ram_mb_seconds', kind: '', milli: ms * BigInt(shape.ram_mb) });
    if (shape.gpus > 0)
      out.push({ hourMs: hour, metric: 'gpu_seconds', kind: shape.gpu_kind || 'unknown', milli: ms * BigInt(shape.gpus) });
  }
  return out;
}

/** One stored snapshot's [startMs, endMs) as byte-milliseconds per UTC hour (kind = snapshot mode). */
export function splitSnapshotUsage(sizeBytes: number, mode: string, startMs: number, endMs: number): UsagePiece[] {
  const out: UsagePiece[] = [];
  if (!(endMs > startMs) || sizeBytes <= 0) return out;
  for (let hour = Math.floor(startMs / HOUR_MS) * HOUR_MS; hour < endMs; hour += HOUR_MS) {
    const ms = BigInt(Math.min(endMs, hour + HOUR_MS) - Math.max(startMs, hour));
    if (ms > 0n) out.push({ hourMs: hour, metric: 'snapshot_byte_seconds', kind: mode, milli: ms * BigInt(sizeBytes) });
  }
  return out;
}

/**
 * Billing usage per tenant and UTC hour, from event times only (the `at` each
 * event carries), never the clock: replaying the log gives the same bill to
 * the last digit. A VM runs from its VmBooted time to its VmDestroyed or
 * VmFailed time; while it runs its open interval lives in `billing_vms`
 * (started_at set), and the close splits it at hour boundaries into
 * `billing_usage`. Queries add open intervals up to "now" without writing.
 *
 * `billing_usage` is long-form (metric, kind) so snapshot GB-hours slot in
 * as metric `snapshot_gb_hours` (kind = snapshot mode) once snapshot events
 * exist; `billing_open_snapshots` is their open-interval table, kept by the
 * same rule (opened at SnapshotReady, closed at deletion).
 */
export const billingProjection: Projection = {
  name: 'billing',
  migrations: [
    {
      id: 'billing_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS billing_vms (
          vm_id text PRIMARY KEY,
          tenant_id text NOT NULL,
          cpus integer NOT NULL,
          ram_mb integer NOT NULL,
          gpus integer NOT NULL,
          gpu_kind text NOT NULL DEFAULT '',
          started_at timestamptz
        );
        CREATE INDEX IF NOT EXISTS billing_vms_open_idx ON billing_vms (tenant_id) WHERE started_at IS NOT NULL;
        CREATE TABLE IF NOT EXISTS billing_usage (
          tenant_id text NOT NULL,
          hour timestamptz NOT NULL,
          metric text NOT NULL,
          kind text NOT NULL DEFAULT '',
          quantity numeric NOT NULL,
          PRIMARY KEY (tenant_id, hour, metric, kind)
        );
        CREATE INDEX IF NOT EXISTS billing_usage_hour_idx ON billing_usage (hour);
        CREATE TABLE IF NOT EXISTS billing_open_snapshots (
          snapshot_id text PRIMARY KEY,
          tenant_id text NOT NULL,
          mode text NOT NULL DEFAULT '',
          size_gb numeric NOT NULL,
          started_at timestamptz NOT NULL
        );`,
    },
    {
      // billing_open_snapshots was never written: replaced by a table that also knows snapshots not taken yet.
      // billing_vm_runs: one row per ended VM run, with its end reason (the per-VM billing rows).
      id: 'billing_0002_snapshots_runs',
      sql: `
        DROP TABLE IF EXISTS billing_open_snapshots;
        CREATE TABLE IF NOT EXISTS billing_snapshots (
          snapshot_id text PRIMARY KEY,
          tenant_id text NOT NULL,
          mode text NOT NULL,
          size_bytes bigint NOT NULL DEFAULT 0,
          started_at timestamptz
        );
        CREATE TABLE IF NOT EXISTS billing_vm_runs (
          vm_id text PRIMARY KEY,
          tenant_id text NOT NULL,
          started_at timestamptz NOT NULL,
          ended_at timestamptz NOT NULL,
          reason text NOT NULL,
          cpus integer NOT NULL,
          ram_mb integer NOT NULL,
          gpus integer NOT NULL,
          gpu_kind text NOT NULL DEFAULT ''
        );
        CREATE INDEX IF NOT EXISTS billing_vm_runs_tenant_idx ON billing_vm_runs (tenant_id, ended_at);`,
    },
    {
      // How an `exited`/`oom` run's init ended, beside its reason (no event before it carried a signal; codes were rare).
      id: 'billing_0003_run_exit',
      sql: `ALTER TABLE billing_vm_runs ADD COLUMN IF NOT EXISTS exit_code integer, ADD COLUMN IF NOT EXISTS exit_signal text;`,
    },
  ],
  tables: [
    { name: 'billing_vms', key: ['vm_id'] },
    { name: 'billing_usage', key: ['tenant_id', 'hour', 'metric', 'kind'] },
    { name: 'billing_snapshots', key: ['snapshot_id'] },
    { name: 'billing_vm_runs', key: ['vm_id'] },
  ],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    await applyBillingBatch(sql, [recorded]);
  },
  applyBatch: (sql: Sql, events: readonly RecordedEvent[]) => applyBillingBatch(sql, events),
};

const BILLED_TYPES = new Set(['VmRequested', 'VmPlaced', 'VmBooted', 'VmDestroyed', 'VmFailed']);

interface OpenRow {
  tenant_id: string;
  cpus: number;
  ram_mb: number;
  gpus: number;
  gpu_kind: string;
  /** As stored (text round-trips exactly) and in ms for the arithmetic. */
  started: { text: string; ms: number } | null;
  inDb: boolean;
  changed: boolean;
}

/**
 * Applies events in order against an in-memory copy of the rows they touch,
 * then writes the result in at most four statements (read, delete, upsert,
 * usage): a replay costs a few round trips per page, not one per event. The
 * end state is the same as applying the events one by one, and usage sums
 * are exact integers of milli-units either way.
 */
async function applyBillingBatch(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  await applySnapshotBilling(sql, events);
  const relevant = events
    .filter((e) => BILLED_TYPES.has(e.type) && e.streamId.startsWith('vm-') && isVmEventType(e.type))
    .map((e) => parsedVmEvent(e));
  if (relevant.length === 0) return;
  const rows = new Map<string, OpenRow | null>();
  const ids = [...new Set(relevant.map((e) => e.data.vm_id))];
  const loaded = await sql.query<{
    vm_id: string;
    tenant_id: string;
    cpus: number;
    ram_mb: number;
    gpus: number;
    gpu_kind: string;
    started_at: Date | null;
    started_text: string | null;
  }>(
    `SELECT vm_id, tenant_id, cpus, ram_mb, gpus, gpu_kind, started_at, started_at::text AS started_text FROM billing_vms WHERE vm_id = ANY($1::text[])`,
    [ids],
  );
  for (const r of loaded.rows) {
    rows.set(r.vm_id, {
      tenant_id: r.tenant_id,
      cpus: r.cpus,
      ram_mb: r.ram_mb,
      gpus: r.gpus,
      gpu_kind: r.gpu_kind,
      started: r.started_at && r.started_text ? { text: r.started_text, ms: r.started_at.getTime() } : null,
      inDb: true,
      changed: false,
    });
  }
  const deleted = new Set<string>();
  const usage = new Map<string, { tenant: string; piece: UsagePiece; milli: bigint }>();
  const runs: Array<{
    vm_id: string;
    row: OpenRow & { started: { text: string } };
    ended: string;
    reason: string;
    exit_code: number | null;
    exit_signal: string | null;
  }> = [];
  for (const event of relevant) {
    const id = event.data.vm_id;
    const row = rows.get(id);
    switch (event.type) {
      case 'VmRequested': {
        if (row) break; // already known: the insert is idempotent
        const sp = event.data.spec;
        rows.set(id, {
          tenant_id: event.data.tenant_id,
          cpus: sp.cpus,
          ram_mb: sp.ram_mb,
          gpus: sp.gpus,
          gpu_kind: sp.gpus > 0 ? (sp.gpu_kind ?? '') : '',
          started: null,
          inDb: deleted.has(id),
          changed: true,
        });
        break;
      }
      case 'VmPlaced': {
        if (!row) break;
        // What the host actually reserved is what is billed (a spec may ask for "any" GPU kind).
        const r = event.data.reservation;
        Object.assign(row, {
          cpus: r.cpus,
          ram_mb: r.ram_mb,
          gpus: r.gpus,
          gpu_kind: r.gpus > 0 ? (r.gpu_profile ? `${r.gpu_kind ?? 'unknown'}/${r.gpu_profile}` : (r.gpu_kind ?? '')) : '',
          changed: true,
        });
        break;
      }
      case 'VmBooted':
        if (row && !row.started) Object.assign(row, { started: { text: event.data.at, ms: Date.parse(event.data.at) }, changed: true });
        break;
      case 'VmDestroyed':
      case 'VmFailed': {
        if (!row) break;
        if (row.inDb) deleted.add(id);
        rows.set(id, null);
        if (!row.started) break; // never booted: nothing ran, nothing billed
        addPieces(usage, row.tenant_id, splitUsage(row, row.started.ms, Date.parse(event.data.at)));
        runs.push({
          vm_id: id,
          row: row as OpenRow & { started: { text: string } },
          ended: event.data.at,
          reason: event.data.reason,
          exit_code: event.type === 'VmFailed' ? (event.data.exit_code ?? null) : null,
          exit_signal: event.type === 'VmFailed' ? (event.data.exit_signal ?? null) : null,
        });
        break;
      }
      default:
        break;
    }
  }

  const gone = [...deleted].filter((id) => rows.get(id) === null);
  if (gone.length > 0) await sql.query('DELETE FROM billing_vms WHERE vm_id = ANY($1::text[])', [gone]);
  const upserts = [...rows].filter((e): e is [string, OpenRow] => e[1] !== null && e[1].changed);
  if (upserts.length > 0) {
    await sql.query(
      `INSERT INTO billing_vms (vm_id, tenant_id, cpus, ram_mb, gpus, gpu_kind, started_at)
       SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::int[], $5::int[], $6::text[], $7::timestamptz[])
       ON CONFLICT (vm_id) DO UPDATE SET tenant_id = EXCLUDED.tenant_id, cpus = EXCLUDED.cpus, ram_mb = EXCLUDED.ram_mb, gpus = EXCLUDED.gpus, gpu_kind = EXCLUDED.gpu_kind, started_at = EXCLUDED.started_at`,
      [
        upserts.map(([id]) => id),
        upserts.map(([, r]) => r.tenant_id),
        upserts.map(([, r]) => r.cpus),
        upserts.map(([, r]) => r.ram_mb),
        upserts.map(([, r]) => r.gpus),
        upserts.map(([, r]) => r.gpu_kind),
        upserts.map(([, r]) => r.started?.text ?? null),
      ],
    );
  }
  if (runs.length > 0) {
    await sql.query(
      `INSERT INTO billing_vm_runs (vm_id, tenant_id, started_at, ended_at, reason, cpus, ram_mb, gpus, gpu_kind, exit_code, exit_signal)
       SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::timestamptz[], $5::text[], $6::int[], $7::int[], $8::int[], $9::text[],
         $10::int[], $11::text[])
       ON CONFLICT (vm_id) DO NOTHING`,
      [
        runs.map((r) => r.vm_id),
        runs.map((r) => r.row.tenant_id),
        runs.map((r) => r.row.started.text),
        runs.map((r) => r.ended),
        runs.map((r) => r.reason),
        runs.map((r) => r.row.cpus),
        runs.map((r) => r.row.ram_mb),
        runs.map((r) => r.row.gpus),
        runs.map((r) => r.row.gpu_kind),
        runs.map((r) => r.exit_code),
        runs.map((r) => r.exit_signal),
      ],
    );
  }
  await writeUsage(sql, usage);
}

type UsageAcc = Map<string, { tenant: string; piece: UsagePiece; milli: bigint }>;

function addPieces(usage: UsageAcc, tenant: string, pieces: readonly UsagePiece[]): void {
  for (const piece of pieces) {
    const key = `${tenant}\0${piece.hourMs}\0${piece.metric}\0${piece.kind}`;
    const acc = usage.get(key);
    if (acc) acc.milli += piece.milli;
    else usage.set(key, { tenant, piece, milli: piece.milli });
  }
}

interface SnapshotRow {
  tenant_id: string;
  mode: string;
  size_bytes: number;
  started: { text: string; ms: number } | null;
  inDb: boolean;
}

/**
 * Snapshot storage, by the same rule as VMs: stored from SnapshotTaken.at
 * (its size_bytes) to SnapshotDeleted.at, split at hour boundaries into
 * byte-milliseconds. A snapshot that failed or was never taken is never
 * billed; copies on several hosts are one snapshot.
 */
async function applySnapshotBilling(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const relevant = events
    .filter((e) => e.streamId.startsWith(SNAPSHOT_STREAM_PREFIX) && isSnapshotEventType(e.type))
    .map((e) => parseSnapshotEvent(e.type, e.data))
    .filter((e) => ['SnapshotRequested', 'SnapshotTaken', 'SnapshotFailed', 'SnapshotDeleted'].includes(e.type));
  if (relevant.length === 0) return;
  const ids = [...new Set(relevant.map((e) => e.data.snapshot_id))];
  const loaded = await sql.query<{
    snapshot_id: string;
    tenant_id: string;
    mode: string;
    size_bytes: string;
    started_at: Date | null;
    started_text: string | null;
  }>(
    `SELECT snapshot_id, tenant_id, mode, size_bytes, started_at, started_at::text AS started_text FROM billing_snapshots WHERE snapshot_id = ANY($1::text[])`,
    [ids],
  );
  const rows = new Map<string, SnapshotRow | null>();
  for (const r of loaded.rows)
    rows.set(r.snapshot_id, {
      tenant_id: r.tenant_id,
      mode: r.mode,
      size_bytes: Number(r.size_bytes),
      started: r.started_at && r.started_text ? { text: r.started_text, ms: r.started_at.getTime() } : null,
      inDb: true,
    });
  const gone = new Set<string>();
  const usage: UsageAcc = new Map();
  for (const e of relevant) {
    const id = e.data.snapshot_id;
    const row = rows.get(id);
    switch (e.type) {
      case 'SnapshotRequested':
        if (row === undefined) rows.set(id, { tenant_id: e.data.tenant_id, mode: e.data.mode, size_bytes: 0, started: null, inDb: false });
        break;
      case 'SnapshotTaken':
        if (row && !row.started)
          Object.assign(row, { size_bytes: e.data.size_bytes, started: { text: e.data.at, ms: Date.parse(e.data.at) } });
        break;
      case 'SnapshotFailed':
      case 'SnapshotDeleted':
        if (!row) break;
        if (row.inDb) gone.add(id);
        rows.set(id, null);
        if (e.type === 'SnapshotDeleted' && row.started)
          addPieces(usage, row.tenant_id, splitSnapshotUsage(row.size_bytes, row.mode, row.started.ms, Date.parse(e.data.at)));
        break;
      default:
        break;
    }
  }
  const del = [...gone].filter((id) => rows.get(id) === null);
  if (del.length > 0) await sql.query('DELETE FROM billing_snapshots WHERE snapshot_id = ANY($1::text[])', [del]);
  const up = [...rows].filter((e): e is [string, SnapshotRow] => e[1] !== null && ids.includes(e[0]));
  if (up.length > 0)
    await sql.query(
      `INSERT INTO billing_snapshots (snapshot_id, tenant_id, mode, size_bytes, started_at)
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::timestamptz[])
       ON CONFLICT (snapshot_id) DO UPDATE SET size_bytes = EXCLUDED.size_bytes, started_at = EXCLUDED.started_at`,
      [
        up.map(([id]) => id),
        up.map(([, r]) => r.tenant_id),
        up.map(([, r]) => r.mode),
        up.map(([, r]) => r.size_bytes),
        up.map(([, r]) => r.started?.text ?? null),
      ],
    );
  await writeUsage(sql, usage);
}

async function writeUsage(sql: Sql, usage: UsageAcc): Promise<void> {
  if (usage.size > 0) {
    const all = [...usage.values()];
    await sql.query(
      `INSERT INTO billing_usage (tenant_id, hour, metric, kind, quantity)
       SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::text[], $4::text[], $5::numeric[])
       ON CONFLICT (tenant_id, hour, metric, kind) DO UPDATE SET quantity = billing_usage.quantity + EXCLUDED.quantity`,
      [
        all.map((u) => u.tenant),
        all.map((u) => new Date(u.piece.hourMs).toISOString()),
        all.map((u) => u.piece.metric),
        all.map((u) => u.piece.kind),
        all.map((u) => milliToDecimal(u.milli)),
      ],
    );
  }
}

/** Integer thousandths as an exact decimal with three places (`1500` → `1.500`). */
export function milliToDecimal(milli: bigint): string {
  const neg = milli < 0n;
  const abs = neg ? -milli : milli;
  return `${neg ? '-' : ''}${abs / 1000n}.${(abs % 1000n).toString().padStart(3, '0')}`;
}
