/**
 * `npm test`: embedded Postgres for the run (unless TEST_DATABASE_URL names a
 * server), then Node's test runner over every test/**\/*.test.ts: the files
 * that share nothing in two lanes at once (each lane with a Postgres of its
 * own), then the rest one at a time (SOLO below). Node 20's `--test` does not
 * expand globs, so we find the files. Optional arguments keep only the files whose
 * path contains one of them. Output is the runner's own, each phase ending
 * with its summary lines, then one line for both; the exit code is the first
 * failed phase's.
 */
import { spawn } from 'node:child_process';
import { promises as fs, statSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createLogger } from '../src/adapters/logger.js';
import { freePort, startEmbeddedPostgres, type EmbeddedPostgres } from '../src/adapters/postgres/embedded.js';

async function findTests(dir: string): Promise<string[]> {
  const out: string[] = [];
  for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
    const p = path.join(dir, entry.name);
    if (entry.isDirectory()) {
      if (entry.name !== 'node_modules' && !entry.name.startsWith('.')) out.push(...(await findTests(p)));
    } else if (entry.name.endsWith('.test.ts')) {
      out.push(p);
    }
  }
  return out;
}

/**
 * Kinds, for fast feedback (`npm run test:unit|test:int|test:e2e`):
 * - unit: pure code (deciders, placement, reconcile decisions, specs and
 *   config parsing): no Postgres is started and none is offered, so a test
 *   that needs one fails loudly instead of hiding here; no root needed;
 * - e2e: the API as a client sees it (control plane, consumers, snapshots);
 * - int: the rest (event stores, projections, agents and sandboxes,
 *   reconciler, security attacks).
 */
type Kind = 'unit' | 'int' | 'e2e';
const UNIT = [
  /^test\/domain\//,
  /^test\/packages\//,
  /^test\/commands\//,
  /\.decider\.test\.ts$/,
  /-deciders\.test\.ts$/,
  /config\.test\.ts$/,
  /^test\/snapshots\/snapshot-request\.test\.ts$/,
];
const E2E = [/^test\/control-plane\//, /^test\/consumers\//, /^test\/snapshots\//];

/**
 * Files that run alone, after the others: timing-sensitive (reconciler
 * intervals and leases, racing replicas, OOM polls, timeouts, CRIU freezes
 * and moves, idle expiry), CPU-bound (QEMU under TCG), or holding something
 * of the whole host (the test internet's routes, ip_forward, the host's free
 * space). Every other file shares nothing (a database of its own each, names,
 * prefixes and subnets random): those run first in two lanes, which on two
 * cores mostly overlaps one file's start-up and waits with another's work.
 */
const SOLO = [
  /^test\/reconciler\//,
  /^test\/security\//,
  /qemu/,
  /criu/,
  /lazy/,
  /^test\/agent\/(egress|host-agent|network-isolation|observe|process-backend|sandbox-security|storage)\.test\.ts$/,
  /^test\/control-plane\/(bounded-streams|e2b-sdk|e2b-sdk-memory|egress-api|embedded-startup|failures|lifecycle|observe|races|standby-checkpoints|vm-[a-z-]+)\.test\.ts$/,
  /^test\/ingress\/ingress-wake\.test\.ts$/,
  /^test\/snapshots\/snapshot-quota\.test\.ts$/,
  // A 64 KiB send buffer, stall timeouts and a 10 s wait for the live tail: it failed twice in a lane, never alone.
  /^test\/consumers\/feed\.test\.ts$/,
];

function isSolo(file: string): boolean {
  const f = file.split(path.sep).join('/');
  return SOLO.some((re) => re.test(f));
}

function kindOf(file: string): Kind {
  const f = file.split(path.sep).join('/');
  if (UNIT.some((re) => re.test(f))) return 'unit';
  return E2E.some((re) => re.test(f)) ? 'e2e' : 'int';
}

async function main(): Promise<number> {
  const args = process.argv.slice(2);
  const kindArg = args.find((a) => a.startsWith('--kind='))?.slice('--kind='.length);
  if (kindArg !== undefined && !['unit', 'int', 'e2e'].includes(kindArg)) {
    process.stderr.write(`--kind must be unit, int or e2e, not "${kindArg}"\n`);
    return 2;
  }
  const filters = args.filter((a) => !a.startsWith('--kind='));
  const all = (await findTests('test')).sort().filter((f) => kindArg === undefined || kindOf(f) === kindArg);
  const files = filters.length === 0 ? all : all.filter((f) => filters.some((x) => f.includes(x)));
  if (files.length === 0) {
    process.stderr.write(`no test files match ${filters.join(' ')}\n`);
    return 1;
  }

  const env = { ...process.env };
  const shared = files.filter((f) => !isSolo(f));
  const solo = files.filter(isSolo);
  // Two lanes for the shared files, each with a Postgres server of its own: readers of the event store see rows below
  // the server's oldest open transaction, so one file's open transactions would hold back what the other reads.
  const lanes = balance(shared, 2);
  const servers: Array<{ server: EmbeddedPostgres; dataDir: string }> = [];
  const urls: Array<string | undefined> = [];
  if (kindArg === 'unit') {
    delete env.TEST_DATABASE_URL;
  } else if (env.TEST_DATABASE_URL) {
    process.stderr.write('using the Postgres server in TEST_DATABASE_URL (for both lanes)\n');
    urls.push(env.TEST_DATABASE_URL, env.TEST_DATABASE_URL);
  } else {
    for (let i = 0; i < Math.max(1, lanes.filter((l) => l.length > 0).length); i++) {
      // One directory per run and lane: two runs at once (a developer's and an editor's) must not wipe each other's server.
      const dataDir = path.resolve('.tmp', `test-pg-${process.pid}${i === 0 ? '' : `-${i}`}`);
      await fs.rm(dataDir, { recursive: true, force: true });
      await fs.rm(`${dataDir}.log`, { force: true });
      await fs.rm(`${dataDir}.password`, { force: true });
      const port = await freePort();
      process.stderr.write(
        `starting embedded Postgres for the tests on 127.0.0.1:${port} (data ${path.relative('.', dataDir)}, log ${path.relative('.', dataDir)}.log)\n`,
      );
      const server = await startEmbeddedPostgres({ dataDir, port, database: 'postgres', logger: createLogger('warn', 'test-runner') });
      servers.push({ server, dataDir });
      urls.push(server.adminUrl);
    }
  }

  const children = new Set<ReturnType<typeof spawn>>();
  const forward = (signal: NodeJS.Signals): void => {
    for (const c of children) c.kill(signal);
  };
  process.on('SIGINT', forward);
  process.on('SIGTERM', forward);
  /** One `node --test` over `list`, one file at a time; output to ours, or kept and printed when it ends. */
  const run = async (list: string[], url: string | undefined, buffered: boolean): Promise<number> => {
    if (list.length === 0) return 0;
    // The runner's own reporter (spec on a terminal, TAP otherwise, as without flags) and each file's wall time.
    const reporters = [
      `--test-reporter=${process.stdout.isTTY ? 'spec' : 'tap'}`,
      '--test-reporter-destination=stdout',
      '--test-reporter=./scripts/file-times-reporter.mjs',
      '--test-reporter-destination=stdout',
    ];
    const started = spawn(process.execPath, ['--import', 'tsx', '--test', '--test-concurrency=1', ...reporters, ...list], {
      stdio: buffered ? ['ignore', 'pipe', 'pipe'] : 'inherit',
      env: url === undefined ? env : { ...env, TEST_DATABASE_URL: url },
    });
    children.add(started);
    const kept: Buffer[] = [];
    started.stdout?.on('data', (d: Buffer) => kept.push(d));
    started.stderr?.on('data', (d: Buffer) => kept.push(d));
    const code = await new Promise<number>((resolve) => {
      started.on('close', (c, signal) => resolve(c ?? (signal ? 128 + os.constants.signals[signal] : 1)));
      started.on('error', () => resolve(1));
    });
    children.delete(started);
    if (buffered) process.stdout.write(Buffer.concat(kept));
    return code;
  };
  if (shared.length > 0)
    process.stderr.write(`running ${shared.length} test file(s) in two lanes (the second lane's output follows the first's)\n`);
  const [laneA, laneB] = await Promise.all([run(lanes[0] ?? [], urls[0], false), run(lanes[1] ?? [], urls[1] ?? urls[0], true)]);
  const sharedCode = laneA !== 0 ? laneA : laneB;
  if (solo.length > 0) process.stderr.write(`running ${solo.length} test file(s) one at a time\n`);
  const soloCode = await run(solo, urls[0], false);
  const code = sharedCode !== 0 ? sharedCode : soloCode;
  if (shared.length > 0 && solo.length > 0)
    process.stderr.write(
      `npm test: ${shared.length} file(s) in two lanes ${sharedCode === 0 ? 'passed' : `FAILED (exit ${sharedCode})`}; ` +
        `${solo.length} file(s) one at a time ${soloCode === 0 ? 'passed' : `FAILED (exit ${soloCode})`}\n`,
    );
  process.removeListener('SIGINT', forward);
  process.removeListener('SIGTERM', forward);
  let stopFailed = false;
  for (const { server, dataDir } of servers) {
    try {
      await server.stop();
      // The log stays for a post-mortem; the data directory goes.
      await fs.rm(dataDir, { recursive: true, force: true });
      await fs.rm(`${dataDir}.password`, { force: true });
    } catch (err) {
      process.stderr.write(`could not stop the test Postgres: ${(err as Error).message}\n`);
      stopFailed = true;
    }
  }
  return stopFailed && code === 0 ? 1 : code;
}

/** `n` lanes of about equal work, the file's size standing in for its running time (largest first, to the lightest lane). */
function balance(files: string[], n: number): string[][] {
  const lanes = Array.from({ length: n }, () => ({ files: [] as string[], weight: 0 }));
  const sized = files.map((f) => ({ f, size: statSync(f).size })).sort((a, b) => b.size - a.size);
  for (const { f, size } of sized) {
    const lane = lanes.reduce((min, l) => (l.weight < min.weight ? l : min));
    lane.files.push(f);
    lane.weight += size;
  }
  return lanes.map((l) => l.files.sort());
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(`test runner failed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
    process.exit(1);
  },
);
