import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import type { EventStore } from '../../src/domain/event-store.port.js';
import { snapshotEventSchema, type SnapshotEvent } from '../../src/domain/snapshot/snapshot.events.js';
import { billingProjection } from '../../src/projections/billing/billing.projection.js';
import { queryUsage } from '../../src/projections/billing/billing.queries.js';
import { metricsProjection } from '../../src/projections/metrics/metrics.projection.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import { vmEventsProjection } from '../../src/projections/vm-events/vm-events.projection.js';
import { KEYS, appendLifecycle, auth, lifecycle, startHarness, type Harness } from './support.js';

const T = (s: string): Date => new Date(`2026-03-01T${s}Z`);
const GIB = 1024 ** 3;

async function snapshotEvents(
  store: EventStore,
  id: string,
  events: Array<[SnapshotEvent['type'], Record<string, unknown>]>,
): Promise<string> {
  let position = '';
  for (const [type, data] of events) {
    const parsed = snapshotEventSchema.parse({ type, data: { snapshot_id: id, ...data } });
    position = (
      await store.append(`snapshot-${id}`, [{ id: randomUUID(), type: parsed.type, data: parsed.data, metadata: { actor: 'test' } }], 'any')
    ).position;
  }
  return position;
}

const requested = (mode: string, at: Date): [SnapshotEvent['type'], Record<string, unknown>] => [
  'SnapshotRequested',
  {
    vm_id: 'vm1',
    tenant_id: 'acme',
    host_id: 'h1',
    arch: 'x86_64',
    mode,
    comment: '',
    metadata: {},
    ask: { live: false, diff: false, keep_paused: false, shrink: false },
    quota_counted: mode !== 'build',
    at: at.toISOString(),
  },
];

/**
 * Snapshot storage is billed in GB-hours (GB = 2^30 bytes) from the snapshot
 * events' own times: SnapshotTaken opens the interval with its size,
 * SnapshotDeleted closes it; a snapshot still stored counts up to now at
 * query time. A replay (rebuild) gives the same tables; the snapshot and
 * VM-end counters in /metrics are fed by the same events.
 */
describe('snapshot storage billing and event-fed counters', { timeout: 120_000 }, () => {
  let h: Harness;
  before(async () => {
    h = await startHarness('snapbill');
    const s = h.service.store;
    // manual: 2 GiB from 10:30 to 12:00 (3 GB-hours); build: 1 GiB from 11:00, still stored; failed: never billed.
    await snapshotEvents(s, 'snap-a', [
      requested('manual', T('10:29:00.000')),
      ['SnapshotTaken', { digest: 'd'.repeat(64), size_bytes: 2 * GIB, kind: 'disk', at: T('10:30:00.000').toISOString() }],
      ['SnapshotUsed', { at: T('11:10:00.000').toISOString() }],
      ['SnapshotDeleted', { reason: 'client', forced: false, at: T('12:00:00.000').toISOString() }],
    ]);
    await snapshotEvents(s, 'snap-b', [
      requested('build', T('10:59:00.000')),
      ['SnapshotTaken', { digest: 'e'.repeat(64), size_bytes: GIB, kind: 'disk', at: T('11:00:00.000').toISOString() }],
    ]);
    await snapshotEvents(s, 'snap-c', [
      requested('manual', T('11:00:00.000')),
      ['SnapshotFailed', { error: 'disk full', at: T('11:00:05.000').toISOString() }],
    ]);
    const last = await appendLifecycle(
      s,
      'v1',
      lifecycle('v1', 'acme', 'h1', { requested: T('10:00:00.000'), booted: T('10:00:01.000'), ended: T('10:10:00.000'), failed: true }),
    );
    await h.service.runner.waitFor(last, 15_000);
  });
  after(async () => h.close());

  it('bills GB-hours per hour and mode from event times, open snapshots up to now', async () => {
    const rows = await queryUsage(h.db.pool, {
      from: T('10:00:00'),
      to: T('13:00:00'),
      groupBy: 'hour',
      tenantId: 'acme',
      now: T('12:30:00'),
    });
    assert.deepEqual(
      rows.map((r) => [r.period_start.slice(11, 16), r.snapshot_gb_hours, r.includes_running]),
      [
        ['10:00', 1, false],
        ['11:00', 3, true],
        ['12:00', 0.5, true],
      ],
    );
    const res = await h.service.app.inject({
      url: '/v1/usage?from=2026-03-01T10:00:00Z&to=2026-03-01T12:00:00Z&group_by=day',
      headers: auth(KEYS.acme),
    });
    assert.equal(res.statusCode, 200, res.body);
    assert.equal(res.json().usage[0].snapshot_gb_hours, 4, '1 + 3 GB-hours within 10:00..12:00');
    const { rows: stored } = await h.db.pool.query<{ kind: string; q: string }>(
      "SELECT kind, sum(quantity)::text AS q FROM billing_usage WHERE metric = 'snapshot_byte_seconds' GROUP BY kind",
    );
    assert.deepEqual(
      stored.map((r) => [r.kind, BigInt(r.q.split('.')[0]!)]),
      [['manual', BigInt(2 * GIB) * 5400n]],
      'closed intervals are exact integers (byte-seconds); the build snapshot is still open',
    );
  });

  it('a replay gives the same billing, metrics and event tables (rebuild --verify finds no drift)', async () => {
    for (const p of [billingProjection, metricsProjection, vmEventsProjection]) {
      const report = await rebuildProjection(h.service.store, h.db.pool, p, { verify: true });
      for (const d of report.drift) assert.deepEqual([d.table, d.onlyLive, d.onlyRebuilt], [d.table, 0, 0], p.name);
    }
  });

  it('feeds the snapshot transition and VM end counters in /metrics', async () => {
    const body = (await h.service.app.inject({ url: '/metrics' })).body;
    /** `name{a="x",b="y"}` matched on its label set, whatever order the exposition writes the labels in. */
    const value = (series: string): number => {
      const key = (s: string): string => {
        const [name, labels = ''] = s.replace('}', '').split('{');
        return `${name}{${labels.split(',').filter(Boolean).sort().join(',')}}`;
      };
      const line = body.split('\n').find((l) => !l.startsWith('#') && key(l.split(' ')[0]!) === key(series));
      return line ? Number(line.split(' ')[1]) : NaN;
    };
    assert.equal(value('fleet_snapshot_transitions_total{state="creating",mode="manual"}'), 2);
    assert.equal(value('fleet_snapshot_transitions_total{state="ready",mode="manual"}'), 1);
    assert.equal(value('fleet_snapshot_transitions_total{state="failed",mode="manual"}'), 1);
    assert.equal(value('fleet_snapshot_transitions_total{state="restoring",mode="manual"}'), 1);
    assert.equal(value('fleet_snapshot_transitions_total{state="deleted",mode="manual"}'), 1);
    assert.equal(value('fleet_snapshot_transitions_total{state="ready",mode="build"}'), 1);
    assert.equal(value('fleet_vm_ends_total{reason="host_lost"}'), 1, 'the support lifecycle fails with reason host_lost');
    assert.equal(value('fleet_vm_ends_total{reason="oom"}'), 0, 'every reason is published, at zero until it happens');
  });
});
