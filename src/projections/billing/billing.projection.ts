import type { RecordedEvent } from '../../domain/event-store.port.js';
import { isVmEventType, parseVmEvent } from '../../domain/vm/vm.events.js';
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

export const USAGE_METRICS = ['vm_seconds', 'cpu_seconds', 'ram_mb_seconds', 'gpu_seconds', 'snapshot_gb_hours'] as const;
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
    if (shape.gpus > 0) out.push({ hourMs: hour, metric: 'gpu_seconds', kind: shape.gpu_kind || 'unknown', milli: ms * BigInt(shape.gpus) });
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
  ],
  tables: [
    { name: 'billing_vms', key: ['vm_id'] },
    { name: 'billing_usage', key: ['tenant_id', 'hour', 'metric', 'kind'] },
    { name: 'billing_open_snapshots', key: ['snapshot_id'] },
  ],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith('vm-')) return;
    switch (recorded.type) {
      case 'VmRequested':
      case 'VmPlaced':
      case 'VmBooted':
      case 'VmDestroyed':
      case 'VmFailed':
        break;
      default:
        return; // the common case on replay: no query at all
    }
    if (!isVmEventType(recorded.type)) return;
    const event = parseVmEvent(recorded.type, recorded.data);
    const id = event.data.vm_id;
    switch (event.type) {
      case 'VmRequested': {
        const s = event.data.spec;
        await sql.query(
          `INSERT INTO billing_vms (vm_id, tenant_id, cpus, ram_mb, gpus, gpu_kind) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (vm_id) DO NOTHING`,
          [id, event.data.tenant_id, s.cpus, s.ram_mb, s.gpus, s.gpus > 0 ? (s.gpu_kind ?? '') : ''],
        );
        return;
      }
      case 'VmPlaced': {
        // What the host actually reserved is what is billed (a spec may ask for "any" GPU kind).
        const r = event.data.reservation;
        const kind = r.gpus > 0 ? (r.gpu_profile ? `${r.gpu_kind ?? 'unknown'}/${r.gpu_profile}` : (r.gpu_kind ?? '')) : '';
        await sql.query(`UPDATE billing_vms SET cpus = $2, ram_mb = $3, gpus = $4, gpu_kind = $5 WHERE vm_id = $1`, [id, r.cpus, r.ram_mb, r.gpus, kind]);
        return;
      }
      case 'VmBooted':
        await sql.query(`UPDATE billing_vms SET started_at = $2 WHERE vm_id = $1 AND started_at IS NULL`, [id, event.data.at]);
        return;
      case 'VmDestroyed':
      case 'VmFailed': {
        const { rows } = await sql.query<{ tenant_id: string; cpus: number; ram_mb: number; gpus: number; gpu_kind: string; started_at: Date | null }>(
          `DELETE FROM billing_vms WHERE vm_id = $1 RETURNING tenant_id, cpus, ram_mb, gpus, gpu_kind, started_at`,
          [id],
        );
        const open = rows[0];
        if (!open?.started_at) return; // never booted: nothing ran, nothing billed
        await addUsage(sql, open.tenant_id, splitUsage(open, open.started_at.getTime(), Date.parse(event.data.at)));
        return;
      }
      default:
        return;
    }
  },
};

async function addUsage(sql: Sql, tenantId: string, pieces: readonly UsagePiece[]): Promise<void> {
  if (pieces.length === 0) return;
  await sql.query(
    `INSERT INTO billing_usage (tenant_id, hour, metric, kind, quantity)
     SELECT $1, u.h, u.m, u.k, u.q::numeric / 1000 FROM unnest($2::timestamptz[], $3::text[], $4::text[], $5::text[]) AS u(h, m, k, q)
     ON CONFLICT (tenant_id, hour, metric, kind) DO UPDATE SET quantity = billing_usage.quantity + EXCLUDED.quantity`,
    [tenantId, pieces.map((p) => new Date(p.hourMs).toISOString()), pieces.map((p) => p.metric), pieces.map((p) => p.kind), pieces.map((p) => p.milli.toString())],
  );
}
