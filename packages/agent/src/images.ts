import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { access, chmod, copyFile, mkdir, readdir, readFile, rename, rm, stat, symlink, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { promisify } from 'node:util';
import { AppError } from '@fleet/agent-protocol';
import { featureMissing, imageNotFound, invalidSpec } from './backend.js';

/**
 * Images are plain directories: `<imageDir>/<name>/` is the root filesystem
 * every sandbox of that image sees read-only under its own writable overlay
 * layer. An image must provide /sbin/init (pid 1: it must reap orphans;
 * busybox init does) — the process backend starts it on create.
 *
 * `buildImage` makes the small base image from the host's static busybox
 * (Debian: `apt-get install busybox-static`): /bin/sh and the usual applets,
 * /etc/passwd, /etc/group, /tmp, /proc and /dev mount points, and an
 * /etc/inittab whose only job is to announce boot on the serial log.
 * The build goes to a temporary sibling directory renamed into place, so a
 * half-built image is never resolvable.
 */

const run = promisify(execFile);

export const imageNameRe = /^[a-z0-9][a-z0-9._-]{0,62}$/;

export interface BuildImageOptions {
  /** Static busybox to install; default /bin/busybox. */
  readonly busybox?: string;
  /** Replace an existing image of that name. */
  readonly force?: boolean;
}

export interface ImageInfo {
  readonly name: string;
  readonly path: string;
}

export function validateImageName(name: string): void {
  if (!imageNameRe.test(name)) {
    throw invalidSpec(`image name "${name}" is invalid: use 1-63 of [a-z0-9._-], starting with a letter or digit`, [
      { path: 'image', message: 'must match ^[a-z0-9][a-z0-9._-]{0,62}$' },
    ]);
  }
}

/** The host directory of an image, or IMAGE_NOT_FOUND. */
export async function resolveImage(imageDir: string, name: string): Promise<string> {
  validateImageName(name);
  const path = join(imageDir, name);
  try {
    const st = await stat(path);
    if (!st.isDirectory()) throw imageNotFound(name);
  } catch (err) {
    if (err instanceof AppError) throw err;
    throw imageNotFound(name);
  }
  return path;
}

export async function listImages(imageDir: string): Promise<ImageInfo[]> {
  let names: string[];
  try {
    names = await readdir(imageDir);
  } catch {
    return [];
  }
  return names
    .filter((n) => imageNameRe.test(n))
    .sort()
    .map((name) => ({ name, path: join(imageDir, name) }));
}

const INITTAB = `# Written by the fleet image builder. pid 1 only reaps and announces boot.
::sysinit:/bin/echo "fleet sandbox up: $(/bin/hostname)"
::shutdown:/bin/echo "fleet sandbox shutting down"
`;

export async function buildImage(imageDir: string, name: string, opts: BuildImageOptions = {}): Promise<ImageInfo> {
  validateImageName(name);
  const busybox = opts.busybox ?? '/bin/busybox';
  try {
    await access(busybox);
  } catch {
    throw featureMissing('busybox', `${busybox} is absent: run \`apt-get install busybox-static\``);
  }
  // A dynamic busybox would find no libc inside the image: look for an ELF interpreter path near the start.
  const head = (await readFile(busybox)).subarray(0, 4096).toString('latin1');
  if (/\/ld-linux|\/ld-musl|\/ld64\.so/.test(head)) {
    throw featureMissing('static busybox', `${busybox} is dynamically linked: install busybox-static (not busybox)`);
  }
  const target = join(imageDir, name);
  if (!opts.force) {
    const exists = await stat(target).then(
      () => true,
      () => false,
    );
    if (exists)
      throw new AppError('IMAGE_EXISTS', 409, `image "${name}" already exists at ${target}; pass --force to rebuild it`, { image: name });
  }
  await mkdir(imageDir, { recursive: true });
  const tmp = join(imageDir, `.build-${name}-${randomBytes(4).toString('hex')}`);
  try {
    await mkdir(tmp);
    for (const d of ['bin', 'sbin', 'usr/bin', 'usr/sbin', 'etc', 'proc', 'sys', 'dev', 'root', 'home', 'var/log', 'run']) {
      await mkdir(join(tmp, d), { recursive: true });
    }
    await mkdir(join(tmp, 'tmp'));
    await chmod(join(tmp, 'tmp'), 0o1777);
    await chmod(join(tmp, 'root'), 0o700);
    await copyFile(busybox, join(tmp, 'bin/busybox'));
    await chmod(join(tmp, 'bin/busybox'), 0o755);
    const { stdout } = await run(busybox, ['--list-full']);
    for (const rel of stdout
      .split('\n')
      .map((l) => l.trim())
      .filter(Boolean)) {
      if (rel === 'bin/busybox' || rel.includes('..')) continue;
      const link = join(tmp, rel);
      await mkdir(dirname(link), { recursive: true });
      await symlink('/bin/busybox', link).catch((err: unknown) => {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      });
    }
    await writeFile(join(tmp, 'etc/passwd'), 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n');
    await writeFile(join(tmp, 'etc/group'), 'root:x:0:\nnogroup:x:65534:\n');
    await writeFile(join(tmp, 'etc/shadow'), 'root:*:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n', { mode: 0o600 });
    await writeFile(join(tmp, 'etc/hosts'), '127.0.0.1 localhost\n');
    await writeFile(join(tmp, 'etc/inittab'), INITTAB);
    await writeFile(
      join(tmp, 'etc/profile'),
      'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nexport PS1="\\h:\\w# "\n',
    );
    await access(join(tmp, 'sbin/init'));
    await access(join(tmp, 'bin/sh'));
    if (opts.force) await rm(target, { recursive: true, force: true });
    await rename(tmp, target);
  } catch (err) {
    await rm(tmp, { recursive: true, force: true });
    throw err;
  }
  return { name, path: target };
}
