import pg from 'pg';
import { pino } from 'pino';
import { runMigrations } from '../src/adapters/postgres/migrations.js';
import { snapshotsProjection } from '../src/projections/snapshots/snapshots.projection.js';
import {
  DIGEST_QUERY,
  findSnapshotByLayerKey,
  LAYER_QUERY,
  listSnapshotsByDigest,
} from '../src/projections/snapshots/snapshots.queries.js';
import { createTestDatabase } from '../test/support/postgres.js';
import { prepareAgents, registerHost, startCheckedAgent, startControlPlane } from '../test/support/control-plane.js';

/**
 * `npm run bench -- snapshots [--rows N] [--lookups N] [--forks N] [--mib N] [--skip-fork]`
 *
 * 1. The artifact index (tenant, digest) and the layer cache (tenant, layer
 *    key, arch → newest ready) over a snapshots read model of --rows rows
 *    (default 1,000,000): p50/p99 of --lookups (default 5000) each, through
 *    the same query functions the service uses, with EXPLAIN ANALYZE.
 * 2. Fork of a sandbox with a --mib MiB (default 100) writable layer: wall
 *    time from the fork request to the fork's first exec, through the API
 *    with a real agent, --forks runs (default 3).
 */
export default async function snapshotsBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: number): number => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const log = (s: string): void => void process.stdout.write(`${s}\n`);
  await indexBench(opt('rows', 1_000_000), opt('lookups', 5000), log);
  if (!args.includes('--skip-fork')) await forkBench(opt('forks', 3), opt('mib', 100), log);
}

const TENANTS = 1000;
const LAYER_KEYS = 20_000;

async function indexBench(rows: number, lookups: number, log: (s: string) => void): Promise<void> {
  const db = await createTestDatabase('bench_snap');
  const pool = new pg.Pool({ connectionString: db.url, max: 4 });
  try {
    await runMigrations(pool, snapshotsProjection.migrations, { logger: pino({ level: 'silent' }) });
    const t0 = performance.now();
    // Deterministic synthetic rows: 1000 tenants, ~1 in 10 a layer, 2 arches, ~90% ready. sha256 of the row number is the digest.
    await pool.query(
      `INSERT INTO snapshots (id, tenant_id, vm_id, host_id, arch, mode, layer_key, digest, kind, state, size_bytes, quota_counted, holders, revision, created_at, updated_at, last_used_at)
       SELECT 'snap-' || g, 't' || (g % ${TENANTS}), 'vm-' || (g / 7), 'h' || (g % 50), CASE WHEN g % 3 = 0 THEN 'arm64' ELSE 'amd64' END,
              CASE WHEN g % 10 = 0 THEN 'build' ELSE 'manual' END,
              CASE WHEN g % 10 = 0 THEN 'layer-' || (g % ${LAYER_KEYS}) END,
              encode(sha256(g::text::bytea), 'hex'), 'disk',
              CASE WHEN g % 11 = 0 THEN 'deleted' ELSE 'ready' END,
              1048576, g % 10 <> 0, ARRAY['h' || (g % 50)], 1,
              timestamptz '2026-01-01' + g * interval '1 second', timestamptz '2026-01-01' + g * interval '1 second', timestamptz '2026-01-01' + g * interval '1 second'
         FROM generate_series(1, $1) AS g`,
      [rows],
    );
    await pool.query('ANALYZE snapshots');
    log(`snapshots read model: ${rows} rows loaded in ${((performance.now() - t0) / 1000).toFixed(1)} s`);

    const pick = (): number => 1 + Math.floor(Math.random() * rows);
    const digestMs: number[] = [];
    let digestHits = 0;
    for (let i = 0; i < lookups; i++) {
      const g = pick();
      const digest = (await pool.query<{ d: string }>(`SELECT encode(sha256($1::text::bytea), 'hex') AS d`, [String(g)])).rows[0]!.d;
      const s = performance.now();
      const r = await listSnapshotsByDigest(pool, `t${g % TENANTS}`, digest);
      digestMs.push(performance.now() - s);
      if (r.length > 0) digestHits++;
    }
    const layerMs: number[] = [];
    let layerHits = 0;
    for (let i = 0; i < lookups; i++) {
      const g = 10 * (1 + Math.floor(Math.random() * Math.floor(rows / 10)));
      const s = performance.now();
      const r = await findSnapshotByLayerKey(pool, `t${g % TENANTS}`, `layer-${g % LAYER_KEYS}`, g % 3 === 0 ? 'arm64' : 'amd64');
      layerMs.push(performance.now() - s);
      if (r) layerHits++;
    }
    log(
      `artifact index by digest: ${lookups} lookups, p50 ${pct(digestMs, 50).toFixed(3)} ms, p99 ${pct(digestMs, 99).toFixed(3)} ms, max ${Math.max(...digestMs).toFixed(3)} ms (hits ${digestHits})`,
    );
    log(
      `layer cache by key+arch:  ${lookups} lookups, p50 ${pct(layerMs, 50).toFixed(3)} ms, p99 ${pct(layerMs, 99).toFixed(3)} ms, max ${Math.max(...layerMs).toFixed(3)} ms (hits ${layerHits})`,
    );
    // The same lookups timed inside the server (plpgsql, clock_timestamp around each query): what the index costs
    // without the client round trip and the Node event loop, which on a loaded shared machine dominate the tail.
    const client = await pool.connect();
    try {
      await client.query(`CREATE FUNCTION pg_temp.bench_lookups(n int, nrows int, layer boolean) RETURNS SETOF float8 AS $fn$
        DECLARE i int; g int; t0 timestamptz;
        BEGIN
          FOR i IN 1..n LOOP
            IF layer THEN
              g := 10 * (1 + floor(random() * (nrows / 10))::int);
              t0 := clock_timestamp();
              PERFORM id FROM snapshots WHERE tenant_id = 't' || (g % ${TENANTS}) AND layer_key = 'layer-' || (g % ${LAYER_KEYS})
                AND arch = CASE WHEN g % 3 = 0 THEN 'arm64' ELSE 'amd64' END AND state = 'ready' AND layer_key IS NOT NULL
                ORDER BY created_at DESC, id DESC LIMIT 1;
            ELSE
              g := 1 + floor(random() * nrows)::int;
              t0 := clock_timestamp();
              PERFORM id FROM snapshots WHERE tenant_id = 't' || (g % ${TENANTS}) AND digest = encode(sha256(g::text::bytea), 'hex') AND state = 'ready';
            END IF;
            RETURN NEXT extract(epoch FROM clock_timestamp() - t0) * 1000;
          END LOOP;
        END $fn$ LANGUAGE plpgsql`);
      for (const layer of [false, true]) {
        const r = await client.query<{ p50: number; p99: number; max: number }>(
          `SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50, percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99, max(ms) AS max FROM pg_temp.bench_lookups($1, $2, $3) AS ms`,
          [lookups, rows, layer],
        );
        const x = r.rows[0]!;
        log(
          `${layer ? 'layer cache, in-server ' : 'artifact index, in-server'}: ${lookups} lookups, p50 ${x.p50.toFixed(3)} ms, p99 ${x.p99.toFixed(3)} ms, max ${x.max.toFixed(3)} ms`,
        );
      }
    } finally {
      client.release();
    }
    const g = 4242;
    const digest = (await pool.query<{ d: string }>(`SELECT encode(sha256($1::text::bytea), 'hex') AS d`, [String(g)])).rows[0]!.d;
    for (const [what, q, params] of [
      ['digest', DIGEST_QUERY, [`t${g % TENANTS}`, digest]],
      ['layer', LAYER_QUERY, [`t${4240 % TENANTS}`, `layer-${4240 % LAYER_KEYS}`, 'amd64']],
    ] as const) {
      const plan = await pool.query<{ 'QUERY PLAN': string }>(`EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) ${q}`, [...params]);
      log(`EXPLAIN ${what}:\n${plan.rows.map((r) => `    ${r['QUERY PLAN']}`).join('\n')}`);
    }
  } finally {
    await pool.end();
    await db.drop();
  }
}

async function forkBench(runs: number, mib: number, log: (s: string) => void): Promise<void> {
  const fleet = await prepareAgents();
  if ('skip' in fleet) {
    log(`fork benchmark skipped: ${fleet.skip}`);
    return;
  }
  const cp = await startControlPlane({ env: { EXEC_DEFAULT_TIMEOUT_MS: '120000', AGENT_CALL_TIMEOUT_MS: '120000' } });
  try {
    const agent = await startCheckedAgent(fleet);
    if ('skip' in agent) {
      log(`fork benchmark skipped: ${agent.skip}`);
      return;
    }
    await registerHost(cp, 'b1', agent);
    const src = await cp.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 512, storage_gb: 2 } });
    if (src.status !== 201) throw new Error(`source VM: ${JSON.stringify(src.body)}`);
    const id = (src.body as { id: string }).id;
    const w = await cp.request('POST', `/v1/vms/${id}/exec`, {
      as: 'acme',
      body: {
        argv: ['/bin/sh', '-c', `dd if=/dev/urandom of=/root/layer bs=1M count=${mib} 2>/dev/null && sync && du -sm /root/layer`],
        timeout_ms: 120_000,
      },
    });
    log(`source sandbox ${id}: writable layer ${JSON.stringify((w.body as { stdout?: string }).stdout?.trim())} MiB`);
    const total: number[] = [];
    for (let i = 0; i < runs; i++) {
      const t0 = performance.now();
      const f = await cp.request('POST', `/v1/vms/${id}/fork`, { as: 'acme', body: {} });
      if (f.status !== 201) throw new Error(`fork: ${JSON.stringify(f.body)}`);
      const tFork = performance.now();
      const fid = (f.body as { id: string }).id;
      const e = await cp.request('POST', `/v1/vms/${fid}/exec`, { as: 'acme', body: { argv: ['true'] } });
      if (e.status !== 200 || (e.body as { exit_code: number }).exit_code !== 0) throw new Error(`first exec: ${JSON.stringify(e.body)}`);
      const ms = performance.now() - t0;
      total.push(ms);
      const snapId = (f.body as { seed_snapshot_id: string }).seed_snapshot_id;
      const evs = await cp.service.store.readStream(`snapshot-${snapId}`);
      const at = (type: string): number => Date.parse((evs.find((e) => e.type === type)?.data as { at: string }).at);
      const cpMs = at('SnapshotTaken') - at('SnapshotRequested');
      log(
        `fork ${i + 1}: request → fork running ${(tFork - t0).toFixed(0)} ms (checkpoint ${cpMs} ms, boot from it ${(f.body as { boot_ms: number }).boot_ms} ms), → first exec ${ms.toFixed(0)} ms`,
      );
      await cp.request('DELETE', `/v1/vms/${fid}`, { as: 'acme' });
      await cp.request('DELETE', `/v1/snapshots/${snapId}?force=true`, { as: 'acme' });
    }
    log(
      `fork of a ${mib} MiB writable layer, request → first exec: p50 ${pct(total, 50).toFixed(0)} ms, max ${Math.max(...total).toFixed(0)} ms over ${runs} runs`,
    );
  } finally {
    await cp.close();
    await fleet.close();
  }
}

function pct(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))] ?? 0;
}
