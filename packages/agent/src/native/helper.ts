import { createHash } from 'node:crypto';
import { existsSync } from 'node:fs';
import { chmod, chown, lstat, mkdir, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { featureMissing } from '../backend.js';
import { runTool } from '../backend/process/exec-util.js';

/**
 * The sandbox helper (fleet-sandbox.c) compiled static with the host's gcc
 * into `<dataDir>/runtime-helper/fleet-sandbox-<sha256 of the source>`,
 * once per source version (older builds are removed).
 * Static, so no dynamic loader ever reads an environment variable on the
 * host side of an exec.
 */

const SOURCE_NAME = 'fleet-sandbox.c';

function sourcePath(): string {
  const here = dirname(fileURLToPath(import.meta.url));
  // Built (tsconfig.build.json: src → dist), the source is still in the repository's src/.
  for (const p of [join(here, SOURCE_NAME), join(here, '..', '..', '..', 'src', 'agent', 'native', SOURCE_NAME)]) {
    if (existsSync(p)) return p;
  }
  throw featureMissing('fleet-sandbox helper source', `${SOURCE_NAME} is missing next to ${here}`);
}

const GCC_ENV = { PATH: '/usr/local/bin:/usr/bin:/bin', LANG: 'C' };

/** The helper's binary, and the host-wide directory under which each sandbox has its empty directory. */
export interface SandboxHelper {
  readonly helper: string;
  readonly emptyRoot: string;
}

/**
 * Each sandbox's masked directories (/proc/acpi, /sys/firmware, ...) are read-only binds of an empty directory of its
 * own here (emptyDirOf): bound by fleet-sandbox.c at a start and by CRIU at a restore (criu.ts). Outside the 0700 data
 * directory because CRIU binds it from inside the sandbox's user namespace, as the sandbox's root, which must be able
 * to reach it; host root's and 0555, so nothing in a sandbox can write it; one per sandbox, so no two sandboxes share
 * an inode (an inotify watch on a shared one would see another tenant list it).
 */
export const SANDBOX_EMPTY_ROOT = '/run/fleet-sandbox';

export async function ensureSandboxHelper(dataDir: string, emptyRoot = SANDBOX_EMPTY_ROOT): Promise<SandboxHelper> {
  const dir = join(dataDir, 'runtime-helper');
  await mkdir(dir, { recursive: true, mode: 0o755 });
  await mkdir(emptyRoot, { recursive: true, mode: 0o755 });
  // Made by an older agent or by hand: it must be searchable by every sandbox's root, and writable by host root only.
  await chown(emptyRoot, 0, 0);
  await chmod(emptyRoot, 0o755);
  return { helper: await buildHelper(dir), emptyRoot };
}

/** The empty directory of the sandbox whose directory is `sandboxDir` (unique per agent and name on this host). */
export const emptyDirOf = (emptyRoot: string, sandboxDir: string): string =>
  join(emptyRoot, createHash('sha256').update(sandboxDir).digest('hex').slice(0, 24));

export async function ensureEmptyDir(path: string): Promise<string> {
  await mkdir(path, { mode: 0o555 }).catch((err: unknown) => {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
  });
  const st = await lstat(path);
  if (!st.isDirectory() || (await readdir(path)).length > 0) {
    throw featureMissing(`an empty directory at ${path}`, 'something else is there: remove it, the agent makes it again');
  }
  await chown(path, 0, 0);
  await chmod(path, 0o555);
  return path;
}

async function buildHelper(dir: string): Promise<string> {
  const src = await readFile(sourcePath());
  const hash = createHash('sha256').update(src).digest('hex').slice(0, 16);
  const bin = join(dir, `fleet-sandbox-${hash}`);
  if (existsSync(bin)) return bin;
  const tmp = `${bin}.tmp-${process.pid}`;
  const srcCopy = `${tmp}.c`;
  try {
    await writeFile(srcCopy, src);
    let res;
    try {
      res = await runTool('gcc', ['-static', '-O2', '-o', tmp, srcCopy], { env: GCC_ENV, timeoutMs: 120_000 });
    } catch {
      throw featureMissing('gcc', 'the sandbox helper is compiled at start: run `apt-get install gcc libc6-dev`');
    }
    if (res.code !== 0) {
      throw featureMissing(
        'gcc with static libc',
        `compiling the sandbox helper failed (install gcc and libc6-dev): ${res.stderr.trim().slice(0, 400)}`,
      );
    }
    await chmod(tmp, 0o755);
    await rename(tmp, bin);
    // Builds of an older source: running execs hold their own inode, so they can go. So can the shell action script
    // older agents gave CRIU (the helper is that script now).
    for (const f of await readdir(dir)) {
      if ((f.startsWith('fleet-sandbox-') && join(dir, f) !== bin) || f === 'criu-netns-hook.sh') await rm(join(dir, f), { force: true });
    }
  } finally {
    await rm(tmp, { force: true });
    await rm(srcCopy, { force: true });
  }
  return bin;
}

/** The guest environment as FLEET_E<n> variables: hex, so no host program on the way reads a name or value it knows. */
export function encodeGuestEnv(env: Readonly<Record<string, string>>): Record<string, string> {
  const out: Record<string, string> = {};
  Object.entries(env).forEach(([k, v], i) => {
    out[`FLEET_E${i}`] = Buffer.from(`${k}=${v}`, 'utf8').toString('hex');
  });
  return out;
}
