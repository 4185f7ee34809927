/**
 * `npm test`: one embedded Postgres for the whole run (unless
 * TEST_DATABASE_URL names a server), then Node's test runner over every
 * test/**\/*.test.ts, one file at a time. Node 20's `--test` does not expand
 * globs, so we find the files. Optional arguments keep only the files whose
 * path contains one of them. Output is the runner's own, so the run ends with
 * its summary lines; the exit code is the runner's.
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

  const child = spawn(process.execPath, ['--import', 'tsx', '--test', '--test-concurrency=1', ...files], { stdio: 'inherit', env });
  const forward = (signal: NodeJS.Signals): void => {
    child.kill(signal);
  };
  process.on('SIGINT', forward);
  process.on('SIGTERM', forward);
  const code = await new Promise<number>((resolve) => {
    child.on('exit', (c, signal) => resolve(c ?? (signal ? 128 + os.constants.signals[signal] : 1)));
    child.on('error', () => resolve(1));
  });
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
