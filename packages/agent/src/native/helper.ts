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

/** The helper's binary, and the empty directory its `start` binds over the masked /proc and /sys directories. */
export interface SandboxHelper {
  readonly helper: string;
  readonly emptyDir: string;
}

/**
 * What a sandbox sees in a masked directory: bound read-only by fleet-sandbox.c at a start, and by CRIU at a restore
 * (criu.ts). Host-wide and outside the 0700 data directory because CRIU binds it from inside the sandbox's user
 * namespace, as the sandbox's root, which must be able to reach it; host root's and 0555, so nothing in a sandbox
 * can write it. Every agent of the host shares it (it holds nothing).
 */
export const SANDBOX_EMPTY_DIR = '/run/fleet-sandbox/empty';

export async function ensureSandboxHelper(dataDir: string, emptyDir = SANDBOX_EMPTY_DIR): Promise<SandboxHelper> {
  const dir = join(dataDir, 'runtime-helper');
  await mkdir(dir, { recursive: true, mode: 0o755 });
  return { helper: await buildHelper(dir), emptyDir: await ensureEmptyDir(emptyDir) };
}

async function ensureEmptyDir(path: string): Promise<string> {
  await mkdir(dirname(path), { recursive: true, mode: 0o755 });
  // Agents starting together: one makes it, the others find it.
  await mkdir(path, { mode: 0o555 }).catch((err: unknown) => {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
  });
  const st = await lstat(path);
  if (!st.isDirectory() || (await readdir(path)).length > 0) {
    throw featureMissing('an empty directory at ' + path, 'something else is there: remove it, the agent makes it again');
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
    // Builds of an older source: running execs hold their own inode, so they can go.
    for (const f of await readdir(dir)) {
      if (f.startsWith('fleet-sandbox-') && join(dir, f) !== bin) await rm(join(dir, f), { force: true });
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
