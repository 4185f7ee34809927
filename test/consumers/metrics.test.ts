import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import parsePrometheusTextFormat from 'parse-prometheus-text-format';
import { metricsProjection } from '../../src/projections/metrics/metrics.projection.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import { appendLifecycle, lifecycle, startHarness, type Harness } from './support.js';

interface Family {
  name: string;
  type: string;
  metrics: Array<{ labels?: Record<string, string>; value?: string; buckets?: Record<string, string>; count?: string; sum?: string }>;
}

describe('/metrics from events', { timeout: 120_000 }, () => {
  let h: Harness;
  before(async () => {
    h = await startHarness('metrics');
    const t = (s: number): Date => new Date(Date.UTC(2026, 5, 1, 10, 0, s));
    let last = '';
    // Boot times 0.3 s, 1.5 s, 1.5 s and 45 s; one VM never boots.
    const boots = [0.3, 1.5, 1.5, 45];
    for (const [i, b] of boots.entries())
      last = await appendLifecycle(
        h.service.store,
        `m${i}`,
        lifecycle(`m${i}`, i === 3 ? 'globex' : 'acme', 'h1', {
          requested: t(0),
          booted: new Date(t(0).getTime() + b * 1000),
          ended: i === 0 ? t(59) : undefined,
        }),
      );
    last = await appendLifecycle(h.service.store, 'm9', lifecycle('m9', 'acme', 'h1', { requested: t(0) }));
    await h.service.runner.waitFor(last, 15_000);
  });
  after(async () => h?.close());

  const scrape = async (): Promise<Map<string, Family>> => {
    const r = await h.service.app.inject({ url: '/metrics' });
    assert.equal(r.statusCode, 200);
    assert.match(String(r.headers['content-type']), /^text\/plain; version=0.0.4/);
    return new Map((parsePrometheusTextFormat(r.body) as Family[]).map((f) => [f.name, f]));
  };

  it('exposes the boot duration histogram, VMs by state, lag and the event-fed counters, parseable by a Prometheus parser', async () => {
    const families = await scrape();
    const boot = families.get('fleet_vm_boot_duration_seconds');
    assert.equal(boot?.type, 'HISTOGRAM');
    const m = boot.metrics[0]!;
    assert.equal(m.count, '4');
    assert.equal(Number(m.sum), 48.3);
    assert.equal(m.buckets!['0.25'], '0');
    assert.equal(m.buckets!['0.5'], '1');
    assert.equal(m.buckets!['2'], '3');
    assert.equal(m.buckets!['30'], '3');
    assert.equal(m.buckets!['60'], '4');
    assert.equal(m.buckets!['+Inf'], '4');

    const vms = families.get('fleet_vms')!;
    const byState = Object.fromEntries(vms.metrics.map((x) => [`${x.labels!.state}@${x.labels!.host}`, Number(x.value)]));
    assert.deepEqual(byState, { 'destroyed@h1': 1, 'running@h1': 3, 'booting@h1': 1 });

    for (const name of ['fleet_projection_lag_events', 'fleet_projection_lag_seconds']) {
      const fam = families.get(name)!;
      assert.equal(fam.type, 'GAUGE');
      for (const p of ['hosts', 'vms', 'billing', 'metrics'])
        assert.ok(
          fam.metrics.some((x) => x.labels!.projection === p),
          `${name} has ${p}`,
        );
      for (const x of fam.metrics) assert.equal(Number(x.value), 0, `${name}{${x.labels!.projection}} after catching up`);
    }
    for (const name of ['fleet_feed_clients', 'fleet_feed_lag_events', 'fleet_feed_lag_seconds'])
      assert.equal(families.get(name)?.type, 'GAUGE', name);
    const snapshots = families.get('fleet_snapshot_transitions_total')!;
    assert.equal(snapshots.type, 'COUNTER');
    assert.ok(snapshots.metrics.some((x) => x.labels!.state === 'ready' && x.labels!.mode === 'manual' && x.value === '0'));
    assert.equal(families.get('fleet_egress_failures_total')?.type, 'COUNTER');
  });

  it('the event-derived histogram survives a rebuild unchanged', async () => {
    const report = await rebuildProjection(h.service.store, h.db.pool, metricsProjection, { verify: true });
    for (const d of report.drift) assert.deepEqual([d.table, d.onlyLive, d.onlyRebuilt], [d.table, 0, 0]);
  });

  it('counts events a read model has not applied yet as lag', async () => {
    await h.service.runner.stop();
    await appendLifecycle(h.service.store, 'late', lifecycle('late', 'acme', 'h1', { requested: new Date() }));
    // The log is read gap-free: an event is counted once every earlier transaction is visible, a moment after its append.
    const billingLag = async (): Promise<number> =>
      Number((await scrape()).get('fleet_projection_lag_events')!.metrics.find((x) => x.labels!.projection === 'billing')!.value);
    let lag = await billingLag();
    for (let i = 0; i < 50 && lag < 3; i++) {
      await new Promise((resolve) => setTimeout(resolve, 100));
      lag = await billingLag();
    }
    assert.equal(lag, 3);
  });
});
