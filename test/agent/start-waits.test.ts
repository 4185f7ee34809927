import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { findHostTools, launchInit, type HostTools } from '../../packages/agent/src/backend/process/launch.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { emptyDirOf, ensureEmptyDir, ensureSandboxHelper } from '../../packages/agent/src/native/helper.js';

/**
 * The helper's start waits for two of the agent's steps (the root mount,
 * eth0 moved into its network namespace) until the agent's own ready
 * timeout (15 s), not a count of short sleeps: an agent slowed by a loaded
 * host that moves eth0 in 7 s after the spawn still gets a booted sandbox
 * (the count gave up after ~4 s: "eth0 never arrived", exit 66). A real
 * start (launchInit) with a real veth; no cgroup is joined.
 */

function missingFeature(): string | undefined {
  if (process.platform !== 'linux') return 'Linux (namespaces)';
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  if (spawnSync('sh', ['-c', 'command -v gcc && command -v ip']).status !== 0) return 'gcc and ip';
  return undefined;
}
const skip = missingFeature();

describe(
  'sandbox start: the helper waits for the agent until its ready timeout',
  { skip: skip ? `host feature missing: ${skip}` : false, timeout: 60_000 },
  () => {
    let root: string;
    let tools: HostTools;
    const links: string[] = [];

    before(async () => {
      root = await mkdtemp(join(tmpdir(), 'start-waits-'));
      await buildImage(join(root, 'images'), 'base');
      tools = { ...findHostTools(), ...(await ensureSandboxHelper(join(root, 'data'))) };
    });

    after(async () => {
      for (const link of links) spawnSync('ip', ['link', 'del', link]);
      await rm(emptyDirOf(tools.emptyRoot, root), { recursive: true, force: true });
      await rm(root, { recursive: true, force: true });
    });

    test('eth0 moved in 7 s after the spawn: the sandbox still boots and is configured', async () => {
      const dir = join(root, 'sb');
      await mkdir(join(dir, 'layer', 'upper'), { recursive: true });
      await mkdir(join(dir, 'layer', 'work'));
      await mkdir(join(dir, 'root'));
      const host = `sw${randomBytes(3).toString('hex')}`;
      links.push(host);
      const net = `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}`;
      const t0 = performance.now();
      let attachedAt = 0;
      const launched = await launchInit({
        imageDir: join(root, 'images', 'base'),
        upper: join(dir, 'layer', 'upper'),
        work: join(dir, 'layer', 'work'),
        rootMount: join(dir, 'root'),
        hostname: 'slow-net',
        uidBase: 200_000 + 65_536 * (randomBytes(1)[0]! % 16),
        cgroupProcs: [],
        consoleLog: join(dir, 'console.log'),
        consoleLogMaxBytes: 1 << 20,
        initStatus: join(dir, 'init.status'),
        address: `${net}.2/24`,
        gateway: `${net}.1`,
        tools,
        netRaw: false,
        emptyDir: await ensureEmptyDir(emptyDirOf(tools.emptyRoot, root)),
        attachNetwork: async (nsPid) => {
          await new Promise((r) => setTimeout(r, 7000));
          const made = spawnSync('ip', ['link', 'add', host, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', String(nsPid)], {
            encoding: 'utf8',
          });
          assert.equal(made.status, 0, made.stderr);
          spawnSync('ip', ['link', 'set', host, 'up']);
          attachedAt = performance.now() - t0;
        },
      });
      try {
        assert.ok(attachedAt >= 7000, `eth0 came ${attachedAt} ms after the spawn`);
        // The guest's eth0 has the address and the default route stage 2 gave it.
        const inside = spawnSync('nsenter', ['-t', String(launched.initPid), '-n', 'ip', '-4', 'addr', 'show', 'eth0'], {
          encoding: 'utf8',
        });
        assert.match(inside.stdout, new RegExp(`inet ${net.replaceAll('.', '\\.')}\\.2/24`));
        const route = spawnSync('nsenter', ['-t', String(launched.initPid), '-n', 'ip', 'route', 'show', 'default'], { encoding: 'utf8' });
        assert.match(route.stdout, new RegExp(`default via ${net.replaceAll('.', '\\.')}\\.1 dev eth0`));
        assert.match(await readFile(join(dir, 'init.status'), 'utf8'), new RegExp(`^${launched.initPid} \\d+ running`));
      } finally {
        // The init has a session of its own (busybox init): the reaper's group does not hold it.
        process.kill(launched.initPid, 'SIGKILL');
        process.kill(-launched.unsharePid, 'SIGKILL');
      }
    });
  },
);
