import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { pino } from 'pino';
import { runMigrations } from '../../src/adapters/postgres/migrations.js';
import { billingProjection, splitUsage } from '../../src/projections/billing/billing.projection.js';
import { queryUsage } from '../../src/projections/billing/billing.queries.js';
import { rebuildProjection } from '../../src/projections/rebuild.js';
import { CHECKPOINTS_MIGRATION, ProjectionRunner } from '../../src/projections/runner.js';
import { createTestDatabase } from '../support/postgres.js';
import { ADMIN_KEY, KEYS, appendLifecycle, auth, lifecycle, startHarness, type Harness } from './support.js';

const T = (s: string): Date => new Date(`2026-03-01T${s}Z`);

describe('billing usage', { timeout: 120_000 }, () => {
  let h: Harness;
  let last = '';
  before(async () => {
    h = await startHarness('billing');
    const store = h.service.store;
    // A: 10:30:00.000 → 12:15:00.500, 2 CPUs, 1024 MB
    last = await appendLifecycle(
      store,
      'vm-a',
      lifecycle('vm-a', 'acme', 'h1', { requested: T('10:29:58.000'), booted: T('10:30:00.000'), ended: T('12:15:00.500') }),
    );
    // B: a GPU VM straddling 12:00 by one millisecond each side, ended by a failure
    last = await appendLifecycle(
      store,
      'vm-b',
      lifecycle(
        'vm-b',
        'acme',
        'h1',
        { requested: T('11:59:50.000'), booted: T('11:59:59.999'), ended: T('12:00:00.001'), failed: true },
        { cpus: 4, ram_mb: 2048, gpus: 2, gpu_kind: 'a100' },
      ),
    );
    // C: globex, still running since 11:00
    last = await appendLifecycle(
      store,
      'vm-c',
      lifecycle('vm-c', 'globex', 'h2', { requested: T('10:59:59.000'), booted: T('11:00:00.000') }, { cpus: 1, ram_mb: 512 }),
    );
    // D: destroyed before it booted: never billed
    last = await appendLifecycle(
      store,
      'vm-d',
      lifecycle('vm-d', 'acme', 'h1', { requested: T('10:00:00.000'), ended: T('10:00:01.000') }),
    );
    await h.service.runner.waitFor(last, 15_000);
  });
  after(async () => h?.close());

  it('splits a run exactly at hour boundaries', () => {
    const pieces = splitUsage(
      { cpus: 2, ram_mb: 1024, gpus: 0, gpu_kind: '' },
      T('10:30:00.000').getTime(),
      T('12:15:00.500').getTime(),
    ).filter((p) => p.metric === 'vm_seconds');
    assert.deepEqual(
      pieces.map((p) => [new Date(p.hourMs).toISOString(), p.milli]),
      [
        ['2026-03-01T10:00:00.000Z', 1_800_000n],
        ['2026-03-01T11:00:00.000Z', 3_600_000n],
        ['2026-03-01T12:00:00.000Z', 900_500n],
      ],
    );
  });

  it('keeps closed usage per tenant and hour from event times, and the open interval of a running VM', async () => {
    const { rows } = await h.db.pool.query<{ tenant_id: string; hour: Date; metric: string; kind: string; quantity: string }>(
      'SELECT tenant_id, hour, metric, kind, quantity::text FROM billing_usage ORDER BY tenant_id, hour, metric, kind',
    );
    const got = rows.map(
      (r) => `${r.tenant_id} ${r.hour.toISOString().slice(11, 16)} ${r.metric}${r.kind ? `:${r.kind}` : ''} ${Number(r.quantity)}`,
    );
    assert.deepEqual(got, [
      'acme 10:00 cpu_seconds 3600',
      'acme 10:00 ram_mb_seconds 1843200',
      'acme 10:00 vm_seconds 1800',
      'acme 11:00 cpu_seconds 7200.004',
      'acme 11:00 gpu_seconds:a100 0.002',
      'acme 11:00 ram_mb_seconds 3686402.048',
      'acme 11:00 vm_seconds 3600.001',
      'acme 12:00 cpu_seconds 1801.004',
      'acme 12:00 gpu_seconds:a100 0.002',
      'acme 12:00 ram_mb_seconds 922114.048',
      'acme 12:00 vm_seconds 900.501',
    ]);
    const open = await h.db.pool.query('SELECT vm_id, tenant_id, started_at FROM billing_vms WHERE started_at IS NOT NULL');
    assert.deepEqual(
      open.rows.map((r) => [r.vm_id, r.tenant_id, (r.started_at as Date).toISOString()]),
      [['vm-c', 'globex', '2026-03-01T11:00:00.000Z']],
    );
  });

  it('bills a running VM up to now in a query, without writing it', async () => {
    const rows = await queryUsage(h.db.pool, {
      from: T('10:00:00'),
      to: T('14:00:00'),
      groupBy: 'hour',
      tenantId: 'globex',
      now: T('12:30:00.250'),
    });
    assert.deepEqual(
      rows.map((r) => [r.period_start, r.vm_seconds, r.cpu_seconds, r.ram_mb_seconds, r.includes_running]),
      [
        ['2026-03-01T11:00:00.000Z', 3600, 3600, 1_843_200, true],
        ['2026-03-01T12:00:00.000Z', 1800.25, 1800.25, 921_728, true],
      ],
    );
    const daily = await queryUsage(h.db.pool, {
      from: T('00:00:00'),
      to: new Date('2026-03-02T00:00:00Z'),
      groupBy: 'day',
      tenantId: undefined,
      now: T('12:30:00.250'),
    });
    assert.deepEqual(
      daily.map((r) => [r.tenant_id, r.period_start, r.vm_seconds, r.gpu_seconds]),
      [
        ['acme', '2026-03-01T00:00:00.000Z', 6300.502, { a100: 0.004 }],
        ['globex', '2026-03-01T00:00:00.000Z', 5400.25, {}],
      ],
    );
    const { rows: written } = await h.db.pool.query("SELECT count(*)::int AS n FROM billing_usage WHERE tenant_id = 'globex'");
    assert.equal(written[0].n, 0);
  });

  it('closes the open interval exactly when the destroy event lands', async () => {
    const ended = await appendLifecycle(
      h.service.store,
      'vm-c',
      lifecycle('vm-c', 'globex', 'h2', { requested: T('10:59:59.000'), booted: T('11:00:00.000'), ended: T('13:00:00.000') }).slice(-2),
    );
    await h.service.runner.waitFor(ended, 10_000);
    const rows = await queryUsage(h.db.pool, {
      from: T('10:00:00'),
      to: T('14:00:00'),
      groupBy: 'hour',
      tenantId: 'globex',
      now: new Date(),
    });
    assert.deepEqual(
      rows.map((r) => [r.period_start.slice(11, 16), r.vm_seconds, r.includes_running]),
      [
        ['11:00', 3600, false],
        ['12:00', 3600, false],
      ],
    );
  });

  it('GET /v1/usage: own tenant only, admin any or all, JSON and CSV, validated', async () => {
    const q = 'from=2026-03-01T10:00:00Z&to=2026-03-01T14:00:00Z&group_by=hour';
    const own = await h.service.app.inject({ url: `/v1/usage?${q}`, headers: auth(KEYS.acme) });
    assert.equal(own.statusCode, 200, own.body);
    assert.deepEqual([...new Set(own.json().usage.map((r: { tenant_id: string }) => r.tenant_id))], ['acme']);
    const other = await h.service.app.inject({ url: `/v1/usage?${q}&tenant=globex`, headers: auth(KEYS.acme) });
    assert.equal(other.statusCode, 403);
    const all = await h.service.app.inject({ url: `/v1/usage?${q}`, headers: auth(ADMIN_KEY) });
    assert.deepEqual([...new Set(all.json().usage.map((r: { tenant_id: string }) => r.tenant_id))], ['acme', 'globex']);
    const one = await h.service.app.inject({ url: `/v1/usage?${q}&tenant=globex`, headers: auth(ADMIN_KEY) });
    assert.deepEqual([...new Set(one.json().usage.map((r: { tenant_id: string }) => r.tenant_id))], ['globex']);
    const csv = await h.service.app.inject({ url: `/v1/usage?${q}`, headers: { ...auth(KEYS.acme), accept: 'text/csv' } });
    assert.equal(csv.statusCode, 200);
    assert.match(String(csv.headers['content-type']), /^text\/csv/);
    const lines = csv.body.trim().split('\r\n');
    assert.equal(
      lines[0],
      'tenant_id,period_start,vm_seconds,cpu_seconds,ram_mb_seconds,gpu_seconds:a100,snapshot_gb_hours,includes_running',
    );
    assert.equal(lines[2], 'acme,2026-03-01T11:00:00.000Z,3600.001,7200.004,3686402.048,0.002,0,false');
    const viaParam = await h.service.app.inject({ url: `/v1/usage?${q}&format=csv`, headers: auth(KEYS.acme) });
    assert.equal(viaParam.body, csv.body);
    const bad = await h.service.app.inject({ url: '/v1/usage?from=2026-03-01T10:30:00Z', headers: auth(KEYS.acme) });
    assert.equal(bad.statusCode, 400);
    assert.equal(bad.json().code, 'VALIDATION_FAILED');
    assert.match(bad.json().detail, /whole UTC hour.*2026-03-01T10:00:00.000Z/);
    const noAuth = await h.service.app.inject({ url: `/v1/usage?${q}` });
    assert.equal(noAuth.statusCode, 401);
  });

  it('replaying the whole log into an empty database yields identical usage rows', async () => {
    const dump = async (pool: pg.Pool): Promise<string[]> => {
      const a = await pool.query('SELECT tenant_id, hour, metric, kind, quantity::text FROM billing_usage ORDER BY 1, 2, 3, 4');
      const b = await pool.query('SELECT vm_id, tenant_id, cpus, ram_mb, gpus, gpu_kind, started_at FROM billing_vms ORDER BY 1');
      return [...a.rows, ...b.rows].map((r) => JSON.stringify(r));
    };
    const live = await dump(h.db.pool);
    assert.ok(live.length > 10);

    const fresh = await createTestDatabase('billing_replay');
    const runner = new ProjectionRunner(h.service.store, fresh.pool, [billingProjection], pino({ level: 'silent' }));
    try {
      await runMigrations(fresh.pool, [CHECKPOINTS_MIGRATION, ...billingProjection.migrations], { logger: pino({ level: 'silent' }) });
      await runner.start();
      const head = (await h.service.store.headPosition())!;
      await runner.waitFor(head, 15_000);
      assert.deepEqual(await dump(fresh.pool), live);
    } finally {
      await runner.stop();
      await fresh.drop();
    }

    // One event at a time through `apply` lands on the same rows as the runner's batches.
    const single = await createTestDatabase('billing_single');
    try {
      await runMigrations(single.pool, billingProjection.migrations, { logger: pino({ level: 'silent' }) });
      for (const e of await h.service.store.readAll()) await billingProjection.apply(single.pool, e);
      assert.deepEqual(await dump(single.pool), live);
    } finally {
      await single.drop();
    }

    const report = await rebuildProjection(h.service.store, h.db.pool, billingProjection, { verify: true });
    assert.ok(report.events > 20);
    for (const d of report.drift) assert.deepEqual([d.table, d.onlyLive, d.onlyRebuilt], [d.table, 0, 0]);
  });
});
