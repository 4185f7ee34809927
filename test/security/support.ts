import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { chmod, mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { CreateSpec } from '../../packages/agent/src/backend.js';
import { ProcessBackend } from '../../packages/agent/src/backend/process/process-backend.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { collect, type Ran } from '../support/process.js';

export { collect, type Ran };

/** Shared set-up of the review's attack tests: one process backend on a scratch data dir, real sandboxes. */

export function missingFeature(): string | undefined {
  if (process.platform !== 'linux') return 'Linux (namespaces)';
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  if (spawnSync('sh', ['-c', 'command -v gcc && command -v setpriv']).status !== 0) return 'gcc and setpriv';
  return undefined;
}

export async function sh(b: ProcessBackend, name: string, script: string): Promise<Ran> {
  return collect(await b.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }));
}

export interface Lab {
  readonly root: string;
  readonly dataDir: string;
  readonly backend: ProcessBackend;
  /** A static binary compiled from `source` on the host. */
  compile(name: string, source: string): Promise<Buffer>;
  close(): Promise<void>;
}

/**
 * A backend whose data directory is world-traversable (0755), as a package
 * or an operator's mkdir leaves one: what sandboxes put on the host must
 * still be out of a host user's reach.
 */
export async function openLab(
  sandboxes: ReadonlyArray<Omit<CreateSpec, 'cpus' | 'ram_mb'>>,
  options: { consoleLogMaxBytes?: number } = {},
): Promise<Lab> {
  const root = await mkdtemp(join(tmpdir(), 'sec-review-'));
  await chmod(root, 0o755);
  await buildImage(join(root, 'images'), 'base');
  const dataDir = join(root, 'data');
  await mkdir(dataDir, { mode: 0o755 });
  await chmod(dataDir, 0o755);
  let backend: ProcessBackend | undefined;
  const close = async (): Promise<void> => {
    if (backend) {
      for (const s of await backend.list().catch(() => [])) await backend.destroy(s.name).catch(() => undefined);
      await backend.prune().catch(() => undefined);
      await backend.close().catch(() => undefined);
    }
    await rm(root, { recursive: true, force: true });
  };
  try {
    backend = await ProcessBackend.open({
      dataDir,
      imageDir: join(root, 'images'),
      subnet: `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`,
      bridgePrefix: `r${randomBytes(2).toString('hex')}`,
      maxSandboxes: 4,
      ...options,
    });
    for (const s of sandboxes) await backend.create({ cpus: 1, ram_mb: 128, ...s });
  } catch (err) {
    await close();
    throw err;
  }
  const b = backend;
  return {
    root,
    dataDir,
    backend: b,
    async compile(name, source) {
      await writeFile(join(root, `${name}.c`), source);
      const cc = spawnSync('gcc', ['-static', '-O1', '-o', join(root, name), join(root, `${name}.c`)], { encoding: 'utf8' });
      assert.equal(cc.status, 0, cc.stderr);
      return readFile(join(root, name));
    },
    close,
  };
}
