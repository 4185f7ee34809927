/**
 * `npm run bench -- consumers [--events N] [--rate R] [--live-seconds S] [--keep]`
 *
 * Subscription consumers on a fresh embedded Postgres: appends N synthetic,
 * schema-valid VM and host events (realistic lifecycles: request, reserve,
 * place, boot, activity, destroy or fail, release), then replays the whole log
 * from zero into every read model the service keeps (PROJECTIONS, billing
 * included) and reports events/s and total time, checks the billed
 * VM-seconds against what the generator knows, times billing alone (a
 * rebuild), then appends live at R events/s for S seconds and reports the lag
 * from an append's commit to the billing read model having applied it.
 * Defaults: 100,000 events (the issue's 1,000,000 with --events 1000000), 1,000 events/s, 15 s. Progress goes to stderr.
 * Before the replay it reads the whole log once with `readAll` in the runner's page size and nothing
 * applied (the ceiling a replay cannot beat), and prints the replay's share of it.
 * `--replay-only` stops after the replay (no billing rebuild, no live phases); `--pg-stats` loads
 * pg_stat_statements and prints where the server's time went during the replay; `--profile-replay FILE`
 * writes a CPU profile of this process during the replay only.
 */
import { randomUUID } from 'node:crypto';
import { Session } from 'node:inspector/promises';
import { promises as fs, readFileSync, readdirSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { pino } from 'pino';
import { freePort, startEmbeddedPostgres } from '../src/adapters/postgres/embedded.js';
import { runMigrations } from '../src/adapters/postgres/migrations.js';
import { PostgresEventStore } from '../src/adapters/postgres/postgres-event-store.js';
import { PROJECTIONS } from '../src/adapters/service.js';
import type { NewEvent } from '../src/domain/event-store.port.js';
import { hostEventSchema } from '../src/domain/host/host.events.js';
import { vmEventSchema } from '../src/domain/vm/vm.events.js';
import { billingProjection } from '../src/projections/billing/billing.projection.js';
import { rebuildProjection } from '../src/projections/rebuild.js';
import { CHECKPOINTS_MIGRATION, ProjectionRunner } from '../src/projections/runner.js';

const progress = (msg: string): void => void process.stderr.write(`[bench ${new Date().toISOString().slice(11, 19)}] ${msg}\n`);
const fmt = (n: number): string => Math.round(n).toLocaleString('en-US');

function option(args: string[], name: string, fallback: number): number {
  const i = args.indexOf(`--${name}`);
  if (i < 0) return fallback;
  const v = Number(args[i + 1]);
  if (!Number.isFinite(v) || v <= 0) throw new Error(`--${name} needs a positive number`);
  return v;
}

function percentile(sorted: readonly number[], p: number): number {
  return sorted.length === 0 ? Number.NaN : sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!;
}

/** Deterministic, so two runs bill the same fleet. */
function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

const HOSTS = 40;
const TENANTS = 25;
const BASE = Date.UTC(2026, 0, 5, 0, 0, 0);

interface Append {
  readonly stream: string;
  readonly events: NewEvent[];
}

let validated = 0;
/** Every event goes through its domain schema while the first thousands are made, then every 100th: all come from the same templates. */
function ev(kind: 'vm' | 'host', type: string, data: Record<string, unknown>, tenant: string | undefined, n: number): NewEvent {
  if (n < 5_000 || n % 100 === 0) {
    (kind === 'vm' ? vmEventSchema : hostEventSchema).parse({ type, data });
    validated++;
  }
  return {
    id: randomUUID(),
    type,
    data,
    metadata: { correlationId: randomUUID(), tenantId: tenant, actor: tenant ? `tenant:${tenant}` : 'admin' },
  };
}

function hostRegistered(h: number, n: number): Append {
  const capacity = {
    cpus: 128,
    ram_mb: 1_048_576,
    storage_gb: 8_000,
    vm_count: 500,
    arch: 'amd64',
    gpus: h % 10 === 0 ? 8 : 0,
    ...(h % 10 === 0 ? { gpu_kind: 'a100' } : {}),
  };
  return {
    stream: `host-h${h}`,
    events: [
      ev(
        'host',
        'HostRegistered',
        {
          host_id: `h${h}`,
          url: `http://10.1.0.${h}:7070`,
          region: h % 2 ? 'eu' : 'us',
          backend: 'process',
          labels: { rack: `r${h % 4}` },
          capacity,
          probed_capacity: capacity,
          overrides: {},
          token_encrypted: 'v1.c2VhbGVkLXRva2Vu',
          at: new Date(BASE - 3_600_000).toISOString(),
        },
        undefined,
        n,
      ),
    ],
  };
}

/**
 * One VM's lifecycle as the appends commands would make: the VM stream's
 * events in one append, the host's reservation and release in another.
 * Returns the billed VM-milliseconds when it ended (0 if it never booted or still runs).
 */
function vmLifecycle(i: number, r: () => number, n: number): { appends: Append[]; count: number; billedMs: number } {
  const id = `v${i}`;
  const tenant = `t${i % TENANTS}`;
  const h = i % HOSTS;
  const gpu = h % 10 === 0 && r() < 0.3;
  const cpus = [1, 2, 4, 8][Math.floor(r() * 4)]!;
  const ram = cpus * 1024;
  const t0 = BASE + i * 2_000 + Math.floor(r() * 1_000);
  const iso = (t: number): string => new Date(t).toISOString();
  const res = {
    vm_id: id,
    cpus,
    ram_mb: ram,
    storage_gb: 10,
    gpus: gpu ? 1 : 0,
    ...(gpu ? { gpu_kind: 'a100' } : {}),
    gpu_uuids: [],
    mig_instance_uuids: [],
  };
  const { vm_id: _vm, ...vmRes } = res;
  const vm: NewEvent[] = [];
  const host: NewEvent[] = [];
  let k = n;
  vm.push(
    ev(
      'vm',
      'VmRequested',
      {
        vm_id: id,
        spec: { cpus, ram_mb: ram, storage_gb: 10, gpus: gpu ? 1 : 0, ...(gpu ? { gpu_kind: 'a100' } : {}), image: 'busybox' },
        tenant_id: tenant,
        at: iso(t0),
      },
      tenant,
      k++,
    ),
  );
  host.push(ev('host', 'CapacityReserved', { ...res, host_id: `h${h}`, at: iso(t0 + 40) }, tenant, k++));
  vm.push(
    ev(
      'vm',
      'VmPlaced',
      {
        vm_id: id,
        host_id: `h${h}`,
        decision: {
          host_id: `h${h}`,
          policy: 'spread',
          candidates: HOSTS,
          headroom_cpus: 100,
          headroom_ram: 900_000,
          artifact_local: false,
          artifact_holders: 0,
        },
        reservation: vmRes,
        at: iso(t0 + 50),
      },
      tenant,
      k++,
    ),
  );
  vm.push(ev('vm', 'VmBootStarted', { vm_id: id, host_id: `h${h}`, at: iso(t0 + 60) }, tenant, k++));
  const fate = r();
  let billedMs = 0;
  if (fate < 0.08) {
    vm.push(
      ev(
        'vm',
        'VmFailed',
        {
          vm_id: id,
          reason: 'error',
          error: 'guest agent did not answer within 30 s',
          error_code: 'BOOT_TIMEOUT',
          phase: 'booting',
          at: iso(t0 + 30_060),
        },
        tenant,
        k++,
      ),
    );
    host.push(ev('host', 'CapacityReleased', { ...res, host_id: `h${h}`, at: iso(t0 + 30_100) }, tenant, k++));
  } else {
    const bootMs = 300 + Math.floor(r() * 4_000);
    const booted = t0 + 60 + bootMs;
    vm.push(
      ev(
        'vm',
        'VmBooted',
        {
          vm_id: id,
          url: `http://10.1.0.${h}:${20_000 + (i % 20_000)}`,
          endpoints: [],
          boot_ms: bootMs,
          auth_token_encrypted: 'v1.c2VhbGVk',
          at: iso(booted),
        },
        tenant,
        k++,
      ),
    );
    const runMs = 60_000 + Math.floor(r() * 3 * 3_600_000);
    for (let a = 1; a <= Math.floor(r() * 3); a++)
      vm.push(ev('vm', 'VmActivityRecorded', { vm_id: id, at: iso(booted + Math.floor((runMs * a) / 4)) }, tenant, k++));
    if (fate < 0.1) {
      // still running: an open interval at the end of the log
    } else if (fate < 0.13) {
      vm.push(
        ev(
          'vm',
          'VmFailed',
          { vm_id: id, reason: 'host_lost', error: 'host stopped answering', phase: 'running', at: iso(booted + runMs) },
          tenant,
          k++,
        ),
      );
      host.push(ev('host', 'CapacityReleased', { ...res, host_id: `h${h}`, at: iso(booted + runMs + 50) }, tenant, k++));
      billedMs = runMs;
    } else {
      vm.push(
        ev('vm', 'VmDestroyRequested', { vm_id: id, reason: r() < 0.7 ? 'client' : 'idle', at: iso(booted + runMs - 1_500) }, tenant, k++),
      );
      vm.push(ev('vm', 'VmDestroyed', { vm_id: id, reason: 'client', at: iso(booted + runMs) }, tenant, k++));
      host.push(ev('host', 'CapacityReleased', { ...res, host_id: `h${h}`, at: iso(booted + runMs + 50) }, tenant, k++));
      billedMs = runMs;
    }
  }
  return {
    appends: [
      { stream: `vm-${id}`, events: vm },
      { stream: `host-h${h}`, events: host },
    ],
    count: vm.length + host.length,
    billedMs,
  };
}

export default async function consumersBench(args: string[]): Promise<void> {
  const target = option(args, 'events', 100_000);
  const rate = option(args, 'rate', 1_000);
  const liveSeconds = option(args, 'live-seconds', 15);
  const keep = args.includes('--keep');
  const replayOnly = args.includes('--replay-only');
  const pgStats = args.includes('--pg-stats');
  const profile = args.indexOf('--profile-replay') >= 0 ? args[args.indexOf('--profile-replay') + 1] : undefined;
  const logger = pino({ level: 'warn' });
  const root = await fs.mkdtemp(path.join(os.tmpdir(), 'fleet-bench-consumers-'));
  progress(
    `starting embedded Postgres in ${root} (load average ${os
      .loadavg()
      .map((l) => l.toFixed(1))
      .join(' ')})`,
  );
  const server = await startEmbeddedPostgres({
    dataDir: path.join(root, 'data'),
    port: await freePort(),
    database: 'bench',
    ...(pgStats ? { settings: { shared_preload_libraries: 'pg_stat_statements', 'pg_stat_statements.track': 'all' } } : {}),
  });
  let store: PostgresEventStore | undefined;
  let pool: pg.Pool | undefined;
  let runner: ProjectionRunner | undefined;
  const out: string[] = [];
  try {
    store = await PostgresEventStore.open({ url: server.url, poolMax: 20, logger });
    pool = new pg.Pool({ connectionString: server.url, max: 12 });
    // At the end the server stops under connections a stopped runner may still hold.
    pool.on('error', () => undefined);

    // ---- fill
    const r = rng(42);
    let appended = 0;
    let expectedBilledMs = 0n;
    let vmCount = 0;
    const t0 = performance.now();
    for (let h = 0; h < HOSTS; h++) {
      const a = hostRegistered(h, appended);
      await store.append(a.stream, a.events, 'any');
      appended += a.events.length;
    }
    const ticker = setInterval(() => progress(`appending: ${fmt(appended)} / ${fmt(target)} events`), 5_000);
    try {
      while (appended < target) {
        // A chunk of lifecycles; host events of the chunk are grouped per host (one append each), as a busy host's stream sees them.
        const vmAppends: Append[] = [];
        const hostEvents = new Map<string, NewEvent[]>();
        while (appended < target && vmAppends.length < 400) {
          const l = vmLifecycle(vmCount++, r, appended);
          appended += l.count;
          expectedBilledMs += BigInt(l.billedMs);
          vmAppends.push(l.appends[0]!);
          const hs = l.appends[1]!;
          hostEvents.set(hs.stream, [...(hostEvents.get(hs.stream) ?? []), ...hs.events]);
        }
        const work: Append[] = [...vmAppends, ...[...hostEvents].map(([stream, events]) => ({ stream, events }))];
        let next = 0;
        await Promise.all(
          Array.from({ length: 8 }, async () => {
            while (next < work.length) {
              const a = work[next++]!;
              await store!.append(a.stream, a.events, 'any');
            }
          }),
        );
      }
    } finally {
      clearInterval(ticker);
    }
    const fillS = (performance.now() - t0) / 1000;
    progress(
      `appended ${fmt(appended)} events (${fmt(vmCount)} VMs, ${HOSTS} hosts, ${fmt(validated)} checked against their schemas) in ${fillS.toFixed(1)} s`,
    );
    await pool.query('VACUUM ANALYZE es_events');

    // ---- the ceiling: read the whole log once, in the runner's pages, applying nothing
    const postmaster = await postmasterPid(pool);
    const ceilingCpu0 = { server: serverCpuMs(postmaster), node: process.cpuUsage() };
    const c0 = performance.now();
    let read = 0;
    for (let after: string | undefined; ;) {
      const page = await store.readAll({ after, maxCount: 4000 });
      read += page.length;
      after = page.at(-1)?.position;
      if (page.length < 4000) break;
    }
    const ceilingS = (performance.now() - c0) / 1000;
    const ceilingNode = process.cpuUsage(ceilingCpu0.node);
    const ceilingCpu = (serverCpuMs(postmaster) - ceilingCpu0.server) / 1000 + (ceilingNode.user + ceilingNode.system) / 1e6;
    progress(`ceiling: readAll of ${fmt(read)} events in ${ceilingS.toFixed(1)} s, ${fmt(read / ceilingS)} events/s`);

    // ---- replay every read model from zero
    await runMigrations(pool, [CHECKPOINTS_MIGRATION, ...PROJECTIONS.flatMap((p) => p.migrations)], { logger });
    runner = new ProjectionRunner(store, pool, PROJECTIONS, logger);
    const names = runner.names;
    progress(`replaying ${fmt(appended)} events into ${names.join(', ')}`);
    const replayTick = setInterval(
      () =>
        progress(
          `replay: ${runner!
            .status()
            .map((s) => `${s.name} ${fmt(s.eventsApplied)}`)
            .join(', ')}`,
        ),
      5_000,
    );
    if (pgStats)
      await pool.query(
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset(); SELECT pg_stat_reset_shared('wal'); SELECT pg_stat_reset_shared('checkpointer')",
      );
    const inspector = profile ? new Session() : undefined;
    if (inspector) {
      inspector.connect();
      await inspector.post('Profiler.enable');
      await inspector.post('Profiler.start');
    }
    const cpu0 = { server: serverCpuMs(postmaster), node: process.cpuUsage() };
    const r0 = performance.now();
    try {
      await runner.start();
    } finally {
      clearInterval(replayTick);
    }
    if (inspector && profile) {
      const { profile: cpu } = await inspector.post('Profiler.stop');
      await fs.writeFile(profile, JSON.stringify(cpu));
      inspector.disconnect();
      progress(`replay CPU profile written to ${profile}`);
    }
    const replayS = (performance.now() - r0) / 1000;
    const nodeCpu = process.cpuUsage(cpu0.node);
    const cpu = { server: (serverCpuMs(postmaster) - cpu0.server) / 1000, node: (nodeCpu.user + nodeCpu.system) / 1e6 };
    const failed = runner.status().filter((s) => !s.caughtUp || s.eventsApplied !== appended);
    if (failed.length > 0)
      throw new Error(
        `replay incomplete: ${failed.map((s) => `${s.name} ${s.eventsApplied}${s.lastError ? ` (${s.lastError})` : ''}`).join(', ')}`,
      );
    const billed = await pool.query<{ ms: string }>(
      `SELECT (sum(quantity) * 1000)::bigint::text AS ms FROM billing_usage WHERE metric = 'vm_seconds'`,
    );
    const billedOk = BigInt(billed.rows[0]?.ms ?? '0') === expectedBilledMs;
    progress(
      `replay done in ${replayS.toFixed(1)} s; billed VM-ms ${billed.rows[0]?.ms} vs generator ${expectedBilledMs}: ${billedOk ? 'equal' : 'DIFFERENT'}`,
    );
    if (pgStats) {
      const { rows } = await pool.query<{ ms: number; calls: string; q: string }>(
        `SELECT round(total_exec_time)::float8 AS ms, calls::text, left(regexp_replace(query, '\\s+', ' ', 'g'), 110) AS q
           FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 15`,
      );
      for (const r of rows) progress(`pg: ${fmt(r.ms).padStart(7)} ms ${r.calls.padStart(7)} calls  ${r.q}`);
      const wal = await pool.query<{ mb: number; fpi: string; full: string; checkpoints: string }>(
        `SELECT round(w.wal_bytes / 1048576)::float8 AS mb, w.wal_fpi::text AS fpi, w.wal_buffers_full::text AS full,
                (c.num_timed + c.num_requested)::text AS checkpoints
           FROM pg_stat_wal w, pg_stat_checkpointer c`,
      );
      const w = wal.rows[0];
      if (w)
        progress(`pg: WAL ${fmt(w.mb)} MiB (${w.fpi} full-page images, WAL buffers full ${w.full} times), ${w.checkpoints} checkpoints`);
    }
    const usageRows = Number((await pool.query<{ n: string }>('SELECT count(*) AS n FROM billing_usage')).rows[0]?.n);
    const replayRows: Array<[string, string]> = [
      ['events in the log', fmt(appended)],
      ['read models replayed (in parallel)', names.join(', ')],
      ['replay from zero, all read models', `${replayS.toFixed(1)} s, ${fmt(appended / replayS)} events/s`],
      [
        'CPU during the replay: Postgres (all its processes) + this process',
        `${cpu.server.toFixed(1)} s + ${cpu.node.toFixed(1)} s = ${(cpu.server + cpu.node).toFixed(1)} s (${fmt(appended / (cpu.server + cpu.node))} events per CPU-second)`,
      ],
      [
        'ceiling: readAll of the whole log, pages of 4,000, nothing applied',
        `${ceilingS.toFixed(1)} s, ${fmt(read / ceilingS)} events/s; ${ceilingCpu.toFixed(1)} CPU-s`,
      ],
      ['billed VM-seconds = generator total', `${billedOk ? 'yes' : 'NO'} (${usageRows} usage rows)`],
      ['fill (appends of one lifecycle each, 8 writers)', `${fillS.toFixed(1)} s, ${fmt(appended / fillS)} events/s`],
    ];
    const machine = (): string =>
      `machine: ${os.availableParallelism()} cores, ${os.cpus()[0]?.model ?? '?'}, Node ${process.version}; load average at the end ${os
        .loadavg()
        .map((l) => l.toFixed(1))
        .join(' ')}`;
    const ratio = `replay share of the readAll ceiling: ${Math.round((100 * (appended / replayS)) / (read / ceilingS))}%`;
    if (replayOnly) {
      out.push(machine(), '| measure | result |', '|---|---|', ...replayRows.map(([a, b]) => `| ${a} | ${b} |`), ratio);
      process.stdout.write(`${out.join('\n')}\n`);
      if (!billedOk) throw new Error('billed VM-seconds differ from the generator');
      return;
    }

    progress('billing alone: rebuild into a shadow schema and compare');
    const b0 = performance.now();
    const rebuilt = await rebuildProjection(store, pool, billingProjection, { verify: true });
    const billingS = (performance.now() - b0) / 1000;
    const drift = rebuilt.drift.reduce((n, d) => n + d.onlyLive + d.onlyRebuilt, 0);

    // ---- live: append at `rate` events/s (single-event appends, as commands make them) and time each to the billing checkpoint
    progress(`live with every read model following: ${fmt(rate)} events/s for ${liveSeconds} s`);
    const live = await liveLoad(
      store,
      r,
      vmCount + 1_000_000,
      rate,
      liveSeconds,
      () => runner!.status().find((s) => s.name === 'billing')?.position,
    );
    await runner.stop();
    await quiesce(pool);
    // Billing on its own: a slow neighbour's open transaction holds back what every subscriber may see (see docs/benchmarks.md).
    progress(`live with billing alone following: ${fmt(rate)} events/s for ${liveSeconds} s`);
    const billingRunner = new ProjectionRunner(store, pool, [billingProjection], logger);
    await billingRunner.start();
    const solo = await liveLoad(store, r, vmCount + 3_000_000, rate, liveSeconds, () => billingRunner.status()[0]?.position);
    await billingRunner.stop();
    await quiesce(pool);
    progress(`live again with no read model running (the store's own delivery): ${fmt(rate)} events/s for ${liveSeconds} s`);
    const alone = await liveLoad(store, r, vmCount + 2_000_000, rate, liveSeconds, undefined);
    const p = (xs: readonly number[]): string =>
      `p50 ${percentile(xs, 50).toFixed(1)} ms, p99 ${percentile(xs, 99).toFixed(1)} ms, max ${(xs.at(-1) ?? Number.NaN).toFixed(1)} ms`;

    const rows: Array<[string, string]> = [
      ...replayRows,
      ['billing alone (rebuild --verify)', `${billingS.toFixed(1)} s, ${fmt(appended / billingS)} events/s, drift ${drift}`],
      [
        `live, read models following: single-event appends at ${fmt(rate)}/s`,
        `${fmt(live.rate)} events/s achieved; append ${p(live.appendMs)}`,
      ],
      [
        'live lag, append commit → billing applied',
        `${p(live.lags)} (${fmt(live.lags.length)} events${live.missing ? `, ${live.missing} never applied` : ''})`,
      ],
      ['same run: append commit → a plain subscription delivers it', p(live.delivery)],
      [`live, billing alone following: appends at ${fmt(rate)}/s`, `${fmt(solo.rate)} events/s achieved; append ${p(solo.appendMs)}`],
      [
        'live lag, append commit → billing applied (billing alone)',
        `${p(solo.lags)} (${fmt(solo.lags.length)} events${solo.missing ? `, ${solo.missing} never applied` : ''})`,
      ],
      ['same run: append commit → a plain subscription delivers it', p(solo.delivery)],
      [`live, no read model running: appends at ${fmt(rate)}/s`, `${fmt(alone.rate)} events/s achieved; append ${p(alone.appendMs)}`],
      ['same run: append commit → a plain subscription delivers it', p(alone.delivery)],
    ];
    out.push(machine(), '| measure | result |', '|---|---|', ...rows.map(([a, b]) => `| ${a} | ${b} |`), ratio);
    process.stdout.write(`${out.join('\n')}\n`);
    if (!billedOk || drift !== 0 || live.missing > 0 || solo.missing > 0) throw new Error('consumer results are wrong (see the table)');
  } finally {
    await runner?.stop().catch(() => undefined);
    await store?.close().catch(() => undefined);
    await pool?.end().catch(() => undefined);
    await server.stop().catch(() => undefined);
    if (!keep) await fs.rm(root, { recursive: true, force: true });
    else progress(`kept ${root}`);
  }
}

/** The server's main process: the parent of any backend. */
async function postmasterPid(pool: pg.Pool): Promise<number> {
  const { rows } = await pool.query<{ pid: number }>('SELECT pg_backend_pid() AS pid');
  return Number(procStat(rows[0]!.pid)[1]);
}

/** A process's /proc stat fields from the state on (index 0 = state, 1 = ppid, 11 = utime, 12 = stime, 13 = cutime, 14 = cstime). */
function procStat(pid: number | string): string[] {
  const raw = readFileSync(`/proc/${pid}/stat`, 'utf8');
  return raw.slice(raw.lastIndexOf(')') + 2).split(' ');
}

/**
 * CPU milliseconds the server has used: the postmaster, its live children and
 * the children it has reaped. Unlike wall time, it hardly moves with the load
 * other engineers put on the machine.
 */
function serverCpuMs(postmaster: number): number {
  const tick = 1000 / 100; // USER_HZ
  const own = procStat(postmaster);
  let ticks = Number(own[11]) + Number(own[12]) + Number(own[13]) + Number(own[14]);
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const f = procStat(entry);
      if (Number(f[1]) === postmaster) ticks += Number(f[11]) + Number(f[12]);
    } catch {
      // gone meanwhile
    }
  }
  return ticks * tick;
}

interface LiveResult {
  readonly rate: number;
  readonly appendMs: number[];
  /** Commit → the watched checkpoint reached it (empty without a watcher). */
  readonly lags: number[];
  /** Commit → a plain live subscription delivered it. */
  readonly delivery: number[];
  readonly missing: number;
}

/** Appends single events at `rate`/s for `seconds`, lifecycles interleaved the way concurrent commands interleave them. */
async function liveLoad(
  store: PostgresEventStore,
  r: () => number,
  firstVm: number,
  rate: number,
  seconds: number,
  checkpoint: (() => string | undefined) | undefined,
): Promise<LiveResult> {
  const pending: Array<{ position: string; at: number }> = [];
  const lags: number[] = [];
  const appendMs: number[] = [];
  const watcher = setInterval(() => {
    const pos = checkpoint?.();
    if (pos === undefined) return;
    const now = performance.now();
    while (pending.length > 0 && pending[0]!.position <= pos) lags.push(now - pending.shift()!.at);
  }, 1);
  const delivered = new Map<string, number>();
  const rawSub = store.subscribeToAll({ after: await store.headPosition() }).subscribe({
    next: (item) => {
      if (item.kind === 'event') delivered.set(item.event.position, performance.now());
    },
  });
  const committed = new Map<string, number>();
  const queue: Array<{ stream: string; event: NewEvent }> = [];
  let vm = firstVm;
  const refill = (): void => {
    const lists = Array.from({ length: 20 }, () => vmLifecycle(vm++, r, 10_000_000)).flatMap((l) =>
      l.appends.map((a) => a.events.map((event) => ({ stream: a.stream, event }))),
    );
    for (let any = true; any;) {
      any = false;
      for (const list of lists) {
        const e = list.shift();
        if (e) {
          any = true;
          queue.push(e);
        }
      }
    }
  };
  let sent = 0;
  const l0 = performance.now();
  const inflight = new Set<Promise<void>>();
  while (performance.now() - l0 < seconds * 1000) {
    const due = Math.floor(((performance.now() - l0) / 1000) * rate) - sent;
    for (let j = 0; j < due; j++) {
      if (queue.length === 0) refill();
      const { stream, event } = queue.shift()!;
      sent++;
      const s0 = performance.now();
      const p = store.append(stream, [event], 'any').then((res) => {
        const at = performance.now();
        appendMs.push(at - s0);
        committed.set(res.position, at);
        if (!checkpoint) return;
        // Commits land out of position order under concurrency: keep the list sorted so the watcher pops in order.
        let idx = pending.length;
        while (idx > 0 && pending[idx - 1]!.position > res.position) idx--;
        pending.splice(idx, 0, { position: res.position, at });
      });
      inflight.add(p);
      void p.finally(() => inflight.delete(p));
    }
    await new Promise((res) => setTimeout(res, 2));
  }
  await Promise.all(inflight);
  const rateAchieved = sent / ((performance.now() - l0) / 1000);
  const deadline = performance.now() + 30_000;
  while ((pending.length > 0 || delivered.size < committed.size) && performance.now() < deadline)
    await new Promise((res) => setTimeout(res, 5));
  clearInterval(watcher);
  rawSub.unsubscribe();
  const delivery = [...committed].map(([pos, at]) => (delivered.get(pos) ?? Number.NaN) - at).filter((x) => !Number.isNaN(x));
  const sort = (xs: number[]): number[] => xs.sort((a, b) => a - b);
  return { rate: rateAchieved, appendMs: sort(appendMs), lags: sort(lags), delivery: sort(delivery), missing: pending.length };
}

/**
 * A stopped runner finishes the batch it is in; until that transaction ends it
 * holds back the snapshot xmin every reader of the log waits for. Wait it out,
 * so one phase's tail is not measured as the next phase's lag.
 */
async function quiesce(pool: pg.Pool): Promise<void> {
  const deadline = Date.now() + 60_000;
  while (Date.now() < deadline) {
    const { rows } = await pool.query<{ n: string }>(
      'SELECT count(*) AS n FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()',
    );
    if (Number(rows[0]?.n ?? 0) === 0) return;
    await new Promise((res) => setTimeout(res, 50));
  }
}
