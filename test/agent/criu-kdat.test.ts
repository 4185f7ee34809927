import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, copyFile, mkdtemp, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { installKdatCache } from '../../packages/agent/src/backend/process/criu.js';

/*
 * CRIU's kernel-probe cache where the directory is no tmpfs (CRIU would not write it there):
 * made by a real criu in a private mount namespace, kept while its sidecar names this boot, kernel and criu, made again otherwise.
 * Written under a scratch directory on the disk, never /run.
 */

function missing(): string | undefined {
  if (process.platform !== 'linux' || process.getuid?.() !== 0) return 'Linux and root';
  const criu = process.env.CRIU_PATH;
  if (!criu || !existsSync(criu)) return 'CRIU (set CRIU_PATH to the binary scripts/criu/build.sh prints)';
  if (spawnSync(criu, ['check']).status !== 0) return `a working CRIU (${criu} check fails)`;
  return undefined;
}

const skip = missing();
if (skip && process.env.CI === 'true') test('CRIU is available in CI', () => assert.fail(`missing: ${skip}`));

// Under the repository (a disk filesystem), not os.tmpdir(), which may be a tmpfs.
const dir = await mkdtemp(join(process.cwd(), '.criu-kdat-test-'));
after(() => rm(dir, { recursive: true, force: true }));

test('a kernel-probe cache is made off tmpfs, kept for this boot, kernel and criu, made again for any other', { skip }, async () => {
  const criu = process.env.CRIU_PATH!;
  const target = join(dir, 'criu.kdat');
  const made = await installKdatCache(criu, target);
  assert.match(made ?? '', /cached in/);
  const first = await stat(target);
  // CRIU's struct kerndat, with its two magic numbers: far more than a few bytes.
  assert.ok(first.size > 64, `kdat of ${first.size} bytes`);
  const id = JSON.parse(await readFile(`${target}.id`, 'utf8'));
  assert.equal(id.boot_id, (await readFile('/proc/sys/kernel/random/boot_id', 'utf8')).trim());
  assert.match((await installKdatCache(criu, target)) ?? '', /made in this boot by this criu/);
  assert.equal((await stat(target)).mtimeMs, first.mtimeMs, 'kept, not made again');

  const remade = async (why: string): Promise<void> => {
    await writeFile(target, 'stale');
    assert.match((await installKdatCache(criu, target)) ?? '', /\(\/run is not a tmpfs/, why);
    assert.equal((await stat(target)).size, first.size, why);
    assert.notEqual((await readFile(target)).toString(), 'stale', why);
  };
  // Another boot (perhaps another kernel), though the file looks newer than this boot (a clock that was ahead).
  await writeFile(`${target}.id`, JSON.stringify({ ...id, boot_id: '00000000-0000-0000-0000-000000000000' }));
  await remade('another boot');
  // No sidecar (a crash between the file and its sidecar).
  await rm(`${target}.id`);
  await remade('no sidecar');
  // Another criu binary (rebuilt or upgraded): its own copy made in the same boot.
  const other = join(dir, 'criu-copy');
  await copyFile(criu, other);
  await chmod(other, 0o755);
  const before = await readFile(`${target}.id`, 'utf8');
  await writeFile(target, 'stale');
  assert.match((await installKdatCache(other, target)) ?? '', /\(\/run is not a tmpfs/);
  assert.notEqual(await readFile(`${target}.id`, 'utf8'), before);
  assert.notEqual((await readFile(target)).toString(), 'stale');
});

test('nothing is made where the directory is a tmpfs: CRIU keeps the cache there itself', { skip }, async () => {
  const tmpfs = spawnSync('findmnt', ['-n', '-t', 'tmpfs', '-o', 'TARGET', '/dev/shm'], { encoding: 'utf8' }).stdout.trim();
  if (tmpfs !== '/dev/shm') return;
  assert.equal(await installKdatCache(process.env.CRIU_PATH!, '/dev/shm/criu-kdat-test-never-made'), null);
  assert.equal(existsSync('/dev/shm/criu-kdat-test-never-made'), false);
});
