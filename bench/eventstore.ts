/**
 * `npm run bench -- eventstore [--seconds N] [--slices N] [--events N] [--no-peers] [--keep]`
 *
 * The Postgres adapter on a fresh embedded server. First, single-event appends
 * with 1, 8 and 32 concurrent writers (one stream each), interleaved on the
 * same server with their peer and ceilings: Emmett's PostgreSQL event store
 * (`@event-driven-io/emmett-postgresql`, expected version on every append), a
 * plain autocommit one-row INSERT, and one multi-row INSERT per flush of what
 * arrived while the last was in flight (naive coalescing, no checks); then the
 * ratio lines; each system runs --seconds in total, round robin in --slices
 * slices. Then NOTIFY inside the transaction, batches of 100, read-all and
 * catch-up subscription events/s over the whole log (at least --events,
 * default 200,000). Progress goes to stderr, the table to stdout.
 */
import { execFileSync } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { promises as fs } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { getPostgreSQLEventStore, type PostgresEventStore as EmmettStore } from '@event-driven-io/emmett-postgresql';
import { STREAM_DOES_NOT_EXIST } from '@event-driven-io/emmett';
import pg from 'pg';
import { freePort, startEmbeddedPostgres } from '../src/adapters/postgres/embedded.js';
import { PostgresEventStore } from '../src/adapters/postgres/postgres-event-store.js';
import type { NewEvent, Position } from '../src/domain/event-store.port.js';

interface Row {
  readonly name: string;
  readonly rate: string;
  readonly p50?: string;
  readonly p99?: string;
  readonly note?: string;
}

const progress = (msg: string): void => {
  process.stderr.write(`[bench ${new Date().toISOString().slice(11, 19)}] ${msg}\n`);
};

function option(args: string[], name: string, fallback: number): number {
  const i = args.indexOf(`--${name}`);
  if (i < 0) return fallback;
  const v = Number(args[i + 1]);
  if (!Number.isFinite(v) || v <= 0) throw new Error(`--${name} needs a positive number`);
  return v;
}

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return Number.NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] as number;
}

function event(i: number): NewEvent {
  return {
    id: randomUUID(),
    type: 'VmBenchmarked',
    data: { vmId: `vm-${i}`, hostId: 'host-bench-1', cpus: 2, memoryMb: 2048, labels: { tier: 'bench', zone: 'a' }, note: 'x'.repeat(64) },
    metadata: { correlationId: randomUUID(), tenantId: 'tenant-bench', actor: 'bench', recordedAt: new Date().toISOString() },
  };
}

const fmt = (n: number): string => Math.round(n).toLocaleString('en-US');
const ms = (n: number): string => `${n.toFixed(2)} ms`;

interface Load {
  events: number;
  perSecond: number;
  latencies: number[];
}

/** `writers` concurrent loops, each making a writer for its own stream and calling it until `seconds` pass. */
async function load(
  label: string,
  writers: number,
  batch: number,
  seconds: number,
  writer: (stream: string) => (events: NewEvent[]) => Promise<void>,
): Promise<Load> {
  const latencies: number[] = [];
  let events = 0;
  const started = performance.now();
  const deadline = started + seconds * 1000;
  const ticker = setInterval(() => progress(`${label}: ${fmt(events)} events so far`), 1000);
  const prefix = `bench${Math.random().toString(36).slice(2, 8)}`;
  try {
    await Promise.all(
      Array.from({ length: writers }, async (_, w) => {
        const write = writer(`${prefix}-w${w}`);
        while (performance.now() < deadline) {
          const evs = Array.from({ length: batch }, (_, i) => event(events + i));
          const t0 = performance.now();
          await write(evs);
          latencies.push(performance.now() - t0);
          events += batch;
        }
      }),
    );
  } finally {
    clearInterval(ticker);
  }
  const elapsed = (performance.now() - started) / 1000;
  latencies.sort((a, b) => a - b);
  return { events, perSecond: events / elapsed, latencies };
}

function appendLoad(store: PostgresEventStore, label: string, writers: number, batch: number, seconds: number): Promise<Load> {
  return load(label, writers, batch, seconds, (stream) => {
    let expected: bigint | 'no_stream' = 'no_stream';
    return async (evs) => {
      expected = (await store.append(stream, evs, expected)).nextExpectedRevision;
    };
  });
}

/** Emmett's appendToStream with the expected version, as its command handlers call it. */
function emmettLoad(emmett: EmmettStore, label: string, writers: number, seconds: number): Promise<Load> {
  return load(label, writers, 1, seconds, (stream) => {
    let expected: bigint | typeof STREAM_DOES_NOT_EXIST = STREAM_DOES_NOT_EXIST;
    return async (evs) => {
      const r = await emmett.appendToStream(
        stream,
        evs.map((e) => ({ type: e.type, data: e.data as Record<string, unknown>, metadata: e.metadata as Record<string, unknown> })),
        { expectedStreamVersion: expected },
      );
      expected = r.nextExpectedStreamVersion;
    };
  });
}

// The ceilings write the rows the store writes, into a table of the same shape (columns, identity, the three
// indexes): what they leave out is the checking (stream lock, head and idempotency probes, expected revision).
const CEILING_TABLE = 'CREATE TABLE IF NOT EXISTS bench_rows (LIKE es_events INCLUDING ALL)';

/** Ceiling: every append one autocommit INSERT of one row, no checks (the writer counts its own revisions). */
function plainInsertLoad(pool: pg.Pool, label: string, writers: number, seconds: number): Promise<Load> {
  return load(label, writers, 1, seconds, (stream) => {
    let revision = 0;
    return async (evs) => {
      const e = evs[0] as NewEvent;
      await pool.query({
        name: 'bench_plain',
        text: 'INSERT INTO bench_rows (txid, stream_id, revision, event_id, type, data, metadata) VALUES (pg_current_xact_id(), $1, $2, $3, $4, $5::json, $6::json)',
        values: [stream, revision++, e.id, e.type, JSON.stringify(e.data), JSON.stringify(e.metadata)],
      });
    };
  });
}

/** Ceiling: what arrives while a flush is in flight goes in the next one, one multi-row INSERT, no checks. */
function coalescedInsertLoad(pool: pg.Pool, label: string, writers: number, seconds: number): Promise<Load> {
  let queue: Array<{ stream: string; revision: number; e: NewEvent; done: () => void; fail: (err: unknown) => void }> = [];
  let flushing = false;
  const kick = (): void => {
    if (flushing || queue.length === 0) return;
    flushing = true;
    const batch = queue;
    queue = [];
    pool
      .query({
        name: 'bench_coalesced',
        text: `INSERT INTO bench_rows (txid, stream_id, revision, event_id, type, data, metadata)
               SELECT pg_current_xact_id(), * FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::text[], $5::json[], $6::json[])`,
        values: [
          batch.map((b) => b.stream),
          batch.map((b) => b.revision),
          batch.map((b) => b.e.id),
          batch.map((b) => b.e.type),
          batch.map((b) => JSON.stringify(b.e.data)),
          batch.map((b) => JSON.stringify(b.e.metadata)),
        ],
      })
      .then(
        () => batch.forEach((b) => b.done()),
        (err: unknown) => batch.forEach((b) => b.fail(err)),
      )
      .finally(() => {
        flushing = false;
        kick();
      });
  };
  return load(label, writers, 1, seconds, (stream) => {
    let revision = 0;
    return (evs) =>
      new Promise<void>((done, fail) => {
        queue.push({ stream, revision: revision++, e: evs[0] as NewEvent, done, fail });
        kick();
      });
  });
}

function machine(pgVersion: string): string {
  let cpu = 'unknown CPU';
  try {
    cpu = /model name\s*:\s*(.+)/.exec(execFileSync('cat', ['/proc/cpuinfo']).toString())?.[1] ?? cpu;
  } catch {
    cpu = os.cpus()[0]?.model ?? cpu;
  }
  return `${os.availableParallelism()} cores (nproc), ${cpu}, ${Math.round(os.totalmem() / 2 ** 30)} GiB RAM, ${os.type()} ${os.release()}, Node ${process.version}, ${pgVersion}`;
}

export default async function eventstoreBench(args: string[]): Promise<void> {
  const seconds = option(args, 'seconds', 5);
  const slices = Math.round(option(args, 'slices', 4));
  const peers = !args.includes('--no-peers');
  const target = option(args, 'events', 200_000);
  const loadBefore = os.loadavg()[0] ?? 0;
  const root = await fs.mkdtemp(path.join(os.tmpdir(), 'fleet-bench-pg-'));
  progress(`starting embedded Postgres in ${root}`);
  const server = await startEmbeddedPostgres({ dataDir: path.join(root, 'data'), port: await freePort(), database: 'bench' });
  const rows: Row[] = [];
  let store: PostgresEventStore | undefined;
  let admin: pg.Pool | undefined;
  try {
    store = await PostgresEventStore.open({ url: server.url, poolMax: 40 });
    admin = new pg.Pool({ connectionString: server.url, max: 1 });
    const version = (await admin.query<{ v: string }>("SELECT current_setting('server_version') AS v")).rows[0]?.v ?? '?';
    const pgVersion = `PostgreSQL ${version}`;

    const ratios: string[] = [];
    let emmett: EmmettStore | undefined;
    let rawPool: pg.Pool | undefined;
    if (peers) {
      await admin.query(CEILING_TABLE);
      rawPool = new pg.Pool({ connectionString: server.url, max: 40 });
      emmett = getPostgreSQLEventStore(server.url, { connectionOptions: { pool: rawPool } });
      await emmett.schema.migrate();
    }
    try {
      for (const writers of [1, 8, 32]) {
        const w = `${writers} writer${writers > 1 ? 's' : ''}`;
        const systems: Array<{ label: string; unit: string; run: (label: string, seconds: number) => Promise<Load> }> = [
          { label: `single-event appends, ${w}`, unit: 'appends/s', run: (l, s) => appendLoad(store!, l, writers, 1, s) },
        ];
        if (emmett && rawPool) {
          const [em, raw] = [emmett, rawPool];
          systems.push({
            label: `  Emmett 0.42 appendToStream, expected version, ${w}`,
            unit: 'appends/s',
            run: (l, s) => emmettLoad(em, l, writers, s),
          });
          systems.push({
            label: `  ceiling: autocommit one-row INSERT, ${w}`,
            unit: 'rows/s',
            run: (l, s) => plainInsertLoad(raw, l, writers, s),
          });
          if (writers > 1)
            systems.push({
              label: `  ceiling: one multi-row INSERT per flush, ${w}`,
              unit: 'rows/s',
              run: (l, s) => coalescedInsertLoad(raw, l, writers, s),
            });
        }
        // Round robin in short slices, so load from elsewhere on the machine falls on every system alike.
        const results = systems.map(() => ({ events: 0, elapsed: 0, latencies: [] as number[] }));
        for (let slice = 0; slice < slices; slice++) {
          for (const [i, sys] of systems.entries()) {
            progress(`${sys.label.trim()}, slice ${slice + 1}/${slices} of ${(seconds / slices).toFixed(1)}s`);
            const r = await sys.run(sys.label.trim(), seconds / slices);
            const acc = results[i]!;
            acc.events += r.events;
            acc.elapsed += r.events / r.perSecond;
            for (const l of r.latencies) acc.latencies.push(l);
          }
        }
        const rates = results.map((r) => r.events / r.elapsed);
        for (const [i, sys] of systems.entries()) {
          const lat = results[i]!.latencies.sort((a, b) => a - b);
          rows.push({ name: sys.label, rate: `${fmt(rates[i]!)} ${sys.unit}`, p50: ms(percentile(lat, 50)), p99: ms(percentile(lat, 99)) });
        }
        if (systems.length === 1) continue;
        ratios.push(`ratio vs emmett, ${w}: ${(rates[0]! / rates[1]!).toFixed(1)}x`);
        if (writers > 1) ratios.push(`share of coalesced ceiling, ${w}: ${Math.round((100 * rates[0]!) / rates[3]!)}%`);
      }
    } finally {
      await emmett?.close();
      await rawPool?.end().catch(() => undefined);
    }

    // The same 32 writers with the NOTIFY inside each append's transaction, to show why it is not the default.
    const inTx = await PostgresEventStore.open({ url: server.url, poolMax: 40, notify: 'in-transaction' });
    try {
      const label = 'single-event appends, 32 writers, NOTIFY in the transaction';
      progress(`${label} for ${seconds}s`);
      const r = await appendLoad(inTx, label, 32, 1, seconds);
      rows.push({
        name: label,
        rate: `${fmt(r.perSecond)} appends/s`,
        p50: ms(percentile(r.latencies, 50)),
        p99: ms(percentile(r.latencies, 99)),
        note: 'not the default',
      });
    } finally {
      await inTx.close();
    }

    for (const writers of [1, 8]) {
      const label = `batches of 100, ${writers} writer${writers > 1 ? 's' : ''}`;
      progress(`${label} for ${seconds}s`);
      const r = await appendLoad(store, label, writers, 100, seconds);
      rows.push({
        name: label,
        rate: `${fmt(r.perSecond)} events/s`,
        p50: ms(percentile(r.latencies, 50)),
        p99: ms(percentile(r.latencies, 99)),
      });
    }

    let total = Number((await admin.query<{ n: string }>('SELECT count(*) AS n FROM es_events')).rows[0]?.n ?? 0);
    if (total < target) {
      progress(`filling the log to ${fmt(target)} events (now ${fmt(total)})`);
      const ticker = setInterval(() => progress(`fill: ${fmt(total)} events`), 2000);
      try {
        const per = 8;
        const need = target - total;
        await Promise.all(
          Array.from({ length: per }, async (_, w) => {
            let expected: bigint | 'no_stream' = 'no_stream';
            for (let done = 0; done < need / per; done += 500) {
              const r = await store!.append(
                `fill-w${w}`,
                Array.from({ length: 500 }, (_, i) => event(i)),
                expected,
              );
              expected = r.nextExpectedRevision;
              total += 500;
            }
          }),
        );
      } finally {
        clearInterval(ticker);
      }
    }
    await admin.query('VACUUM ANALYZE es_events');

    progress(`readAll over ${fmt(total)} events`);
    {
      const t0 = performance.now();
      let after: Position | undefined;
      let n = 0;
      for (;;) {
        const page = await store.readAll({ after, maxCount: 5000 });
        if (page.length === 0) break;
        n += page.length;
        after = page[page.length - 1]?.position;
        if (n % 50_000 < 5000) progress(`readAll: ${fmt(n)} events`);
      }
      const s = (performance.now() - t0) / 1000;
      rows.push({ name: `readAll, pages of 5,000 (${fmt(n)} events)`, rate: `${fmt(n / s)} events/s` });
    }

    for (const pass of ['first', 'second']) {
      progress(`catch-up subscription over ${fmt(total)} events (${pass} pass)`);
      const t0 = performance.now();
      const n = await new Promise<number>((resolve, reject) => {
        let count = 0;
        const sub = store!.subscribeToAll().subscribe({
          next: (item) => {
            if (item.kind === 'event') {
              count += 1;
              if (count % 50_000 === 0) progress(`subscription: ${fmt(count)} events`);
            } else if (item.kind === 'caught-up') {
              queueMicrotask(() => sub.unsubscribe());
              resolve(count);
            }
          },
          error: reject,
        });
      });
      const s = (performance.now() - t0) / 1000;
      rows.push({ name: `catch-up subscription, ${pass} pass (${fmt(n)} events)`, rate: `${fmt(n / s)} events/s` });
    }

    const widths = [Math.max(...rows.map((r) => r.name.length), 9), Math.max(...rows.map((r) => r.rate.length), 10), 10, 10];
    const line = (cells: string[]): string =>
      cells.map((c, i) => (i === 0 ? c.padEnd(widths[i] as number) : c.padStart(widths[i] as number))).join('  ');
    // Other work on the machine competes for the same cores: say how busy it was.
    const load = `1-min load average ${loadBefore.toFixed(1)} at start, ${(os.loadavg()[0] ?? 0).toFixed(1)} at end`;
    process.stdout.write(`\nEvent store benchmark (Postgres adapter, embedded server)\n${machine(pgVersion)}\n${load}\n\n`);
    process.stdout.write(`${line(['benchmark', 'throughput', 'p50', 'p99'])}\n${'-'.repeat(widths.reduce((a, b) => a + b + 2, 0))}\n`);
    for (const r of rows) process.stdout.write(`${line([r.name, r.rate, r.p50 ?? '', r.p99 ?? ''])}${r.note ? `  (${r.note})` : ''}\n`);
    if (ratios.length > 0) process.stdout.write(`\n${ratios.join('\n')}\n`);
  } finally {
    await store?.close();
    await admin?.end();
    await server.stop();
    if (!args.includes('--keep')) await fs.rm(root, { recursive: true, force: true });
  }
}
