import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import type { Logger } from '../logger.js';
import { EmbeddedPostgresError, USER } from './embedded-common.js';
import type { RunAs, ServerView } from './embedded-server-view.js';

export function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

export async function waitForExit(pid: number, timeoutMs: number): Promise<boolean> {
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
export async function clearStaleLock(dataDir: string, logger: Logger | undefined, seenDataDir?: string): Promise<void> {
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
export async function assertPortFree(port: number): Promise<void> {
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

export async function isInitialised(dataDir: string): Promise<boolean> {
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

export function spawnLogged(view: ServerView, cmd: string, args: string[], logFd: fs.FileHandle): ChildProcess {
  const w = view.wrap(cmd, args);
  return spawn(w.cmd, w.args, {
    stdio: ['ignore', logFd.fd, logFd.fd],
    // Not our environment: the server has no business with the admin key or the token-encryption key.
    env: { PATH: process.env.PATH ?? '/usr/sbin:/usr/bin:/sbin:/bin', LC_MESSAGES: 'C', LANG: 'C', LC_ALL: 'C' },
  });
}

export async function tail(file: string, lines = 15): Promise<string> {
  try {
    return (await fs.readFile(file, 'utf8')).trimEnd().split('\n').slice(-lines).join('\n');
  } catch {
    return '';
  }
}

export async function initdb(view: ServerView, password: string, runAs: RunAs, logFile: string, logFd: fs.FileHandle): Promise<void> {
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

export const AUTH_FAILED = '28P01';

export async function waitUntilReady(
  url: string,
  child: ChildProcess,
  logFile: string,
  timeoutMs: number,
): Promise<'ready' | 'auth_failed'> {
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

/** Fast shutdown (SIGINT); SIGQUIT then SIGKILL if it hangs. Resolves once the postmaster has exited. */
export async function stopChild(child: ChildProcess): Promise<void> {
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
