import { createHash } from 'node:crypto';
import { existsSync } from 'node:fs';
import { chmod, mkdir, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
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

export async function ensureSandboxHelper(dataDir: string): Promise<string> {
  const src = await readFile(sourcePath());
  const hash = createHash('sha256').update(src).digest('hex').slice(0, 16);
  const dir = join(dataDir, 'runtime-helper');
  const bin = join(dir, `fleet-sandbox-${hash}`);
  if (existsSync(bin)) return bin;
  await mkdir(dir, { recursive: true, mode: 0o755 });
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
