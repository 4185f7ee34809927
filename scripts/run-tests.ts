/**
 * `npm test`: one embedded Postgres for the whole run (unless
 * TEST_DATABASE_URL names a server), then Node's test runner over every
 * test/**\/*.test.ts: the files that share nothing two at a time, then the
 * rest one at a time (SOLO below). Node 20's `--test` does not expand
 * globs, so we find the files. Optional arguments keep only the files whose
 * path contains one of them. Output is the runner's own, each phase ending
 * with its summary lines, then one line for both; the exit code is the first
 * failed phase's.
 */
import { spawn } from 'node:child_process';
import { promises as fs } from 'node:fs';
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
 * space). Every other file shares nothing but the one Postgres server (a
 * database of its own each, names, prefixes and subnets random): those run
 * two at a time first, which on two cores mostly overlaps one file's start-up
 * and waits with another's work.
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

  let server: EmbeddedPostgres | undefined;
  const env = { ...process.env };
  if (kindArg === 'unit') {
    delete env.TEST_DATABASE_URL;
  } else if (!env.TEST_DATABASE_URL) {
    // One directory per run: two runs at once (a developer's and an editor's) must not wipe each other's server.
    const dataDir = path.resolve('.tmp', `test-pg-${process.pid}`);
    await fs.rm(dataDir, { recursive: true, force: true });
    await fs.rm(`${dataDir}.log`, { force: true });
    await fs.rm(`${dataDir}.password`, { force: true });
    const port = await freePort();
    process.stderr.write(
      `starting embedded Postgres for the tests on 127.0.0.1:${port} (data ${path.relative('.', dataDir)}, log ${path.relative('.', dataDir)}.log)\n`,
    );
    server = await startEmbeddedPostgres({ dataDir, port, database: 'postgres', logger: createLogger('warn', 'test-runner') });
    env.TEST_DATABASE_URL = server.adminUrl;
  } else {
    process.stderr.write('using the Postgres server in TEST_DATABASE_URL\n');
  }

  const shared = files.filter((f) => !isSolo(f));
  const solo = files.filter(isSolo);
  let child: ReturnType<typeof spawn> | undefined;
  const forward = (signal: NodeJS.Signals): void => {
    child?.kill(signal);
  };
  process.on('SIGINT', forward);
  process.on('SIGTERM', forward);
  const phase = async (list: string[], concurrency: number): Promise<number> => {
    if (list.length === 0) return 0;
    process.stderr.write(`running ${list.length} test file(s), ${concurrency === 1 ? 'one at a time' : `${concurrency} at a time`}\n`);
    const started = spawn(process.execPath, ['--import', 'tsx', '--test', `--test-concurrency=${concurrency}`, ...list], {
      stdio: 'inherit',
      env,
    });
    child = started;
    return new Promise<number>((resolve) => {
      started.on('exit', (c, signal) => resolve(c ?? (signal ? 128 + os.constants.signals[signal] : 1)));
      started.on('error', () => resolve(1));
    });
  };
  const sharedCode = await phase(shared, 2);
  const soloCode = await phase(solo, 1);
  const code = sharedCode !== 0 ? sharedCode : soloCode;
  if (shared.length > 0 && solo.length > 0)
    process.stderr.write(
      `npm test: ${shared.length} file(s) two at a time ${sharedCode === 0 ? 'passed' : `FAILED (exit ${sharedCode})`}; ` +
        `${solo.length} file(s) one at a time ${soloCode === 0 ? 'passed' : `FAILED (exit ${soloCode})`}\n`,
    );
  process.removeListener('SIGINT', forward);
  process.removeListener('SIGTERM', forward);
  if (server) {
    try {
      await server.stop();
      // The log stays for a post-mortem; the data directory goes.
      await fs.rm(path.resolve('.tmp', `test-pg-${process.pid}`), { recursive: true, force: true });
      await fs.rm(path.resolve('.tmp', `test-pg-${process.pid}.password`), { force: true });
    } catch (err) {
      process.stderr.write(`could not stop the test Postgres: ${(err as Error).message}\n`);
      return code === 0 ? 1 : code;
    }
  }
  return code;
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(`test runner failed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
    process.exit(1);
  },
);
