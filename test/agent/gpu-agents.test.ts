import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { AgentConfigError, parseAgentEnv } from '../../packages/agent/src/config.js';
import { deviceUuid } from '../../packages/agent/src/backend/qemu/gpu-probe.js';
import { qemuImageRoot } from '../../packages/agent/src/backend/qemu/image.js';
import { MDEV_A, makeGpuFixture, OFFERED_PCI } from './gpu-fixtures.js';
import { missingPrerequisite, type RunningAgent, startAgent, uniquePrefix, uniqueSubnet } from './harness.js';

/**
 * The GPU lane through real agent processes, with no VM booted and no GPU
 * present: a qemu agent whose AGENT_SYSFS_ROOT/AGENT_DEV_ROOT point at a
 * fixture reports the probed devices in GET /v1/capacity and refuses, over
 * HTTP, a create naming a device it does not offer; a process agent refuses
 * any create that carries GPUs (a namespace sandbox cannot take a PCI device).
 */

const haveQemu =
  spawnSync('sh', ['-c', 'command -v qemu-system-x86_64 && command -v qemu-img && command -v nft'], { stdio: 'ignore' }).status === 0;

async function call(agent: RunningAgent, method: string, path: string, body?: unknown): Promise<{ status: number; body: any }> {
  const r = await fetch(`${agent.url}${path}`, {
    method,
    headers: { authorization: `Bearer ${agent.token}`, ...(body !== undefined ? { 'content-type': 'application/json' } : {}) },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
  });
  return { status: r.status, body: await r.json() };
}

describe('AGENT_SYSFS_ROOT / AGENT_DEV_ROOT at the config edge', () => {
  it('default to /sys and /dev and must be absolute', () => {
    const base = { AGENT_TOKEN: 'x'.repeat(16) };
    const c = parseAgentEnv(base);
    assert.equal(c.AGENT_SYSFS_ROOT, '/sys');
    assert.equal(c.AGENT_DEV_ROOT, '/dev');
    assert.throws(
      () => parseAgentEnv({ ...base, AGENT_SYSFS_ROOT: 'fixture/sys' }),
      (err) => err instanceof AgentConfigError && err.problems.some((p) => p.startsWith('AGENT_SYSFS_ROOT: must be an absolute path')),
    );
    assert.throws(() => parseAgentEnv({ ...base, AGENT_DEV_ROOT: 'dev' }), AgentConfigError);
  });
});

describe(
  'a qemu agent on a fixture sysfs',
  { skip: haveQemu ? false : 'qemu-system-x86_64, qemu-img or nft missing', timeout: 120_000 },
  () => {
    let root = '';
    let agent: RunningAgent | undefined;
    const prefix = uniquePrefix();

    before(async () => {
      root = await mkdtemp(join(tmpdir(), 'gpu-agent-'));
      const fixture = await makeGpuFixture(join(root, 'fixture'));
      const imageDir = join(root, 'images');
      // An image record only: a create resolves it before it binds devices; nothing here boots.
      await mkdir(join(qemuImageRoot(imageDir), 'base'), { recursive: true });
      await writeFile(
        join(qemuImageRoot(imageDir), 'base', 'image.json'),
        JSON.stringify({ kernel_version: '6.1.0', root_bytes: 1 << 30 }),
      );
      agent = await startAgent({
        dataDir: join(root, 'd'),
        imageDir,
        subnet: uniqueSubnet(),
        bridgePrefix: prefix,
        env: { AGENT_BACKEND: 'qemu', AGENT_QEMU_ACCEL: 'tcg', AGENT_SYSFS_ROOT: fixture.sysfsRoot, AGENT_DEV_ROOT: fixture.devRoot },
      });
    });

    after(async () => {
      await agent?.stop();
      spawnSync('nft', ['delete', 'table', 'inet', `fleet_${prefix}v`], { stdio: 'ignore' });
      spawnSync('nft', ['delete', 'table', 'bridge', `fleet_${prefix}v`], { stdio: 'ignore' });
      if (root) await rm(root, { recursive: true, force: true });
    });

    it('reports the probed GPU and MIG instances in its capacity, and logs why it left devices out', async () => {
      const cap = await call(agent!, 'GET', '/v1/capacity');
      assert.equal(cap.status, 200);
      assert.equal(cap.body.backend, 'qemu');
      assert.equal(cap.body.gpus, 1);
      assert.equal(cap.body.gpu_kind, 'a100');
      assert.deepEqual(
        cap.body.gpu_devices.map((d: { uuid: string; pci_bus_id: string }) => [d.uuid, d.pci_bus_id]),
        [[deviceUuid(hostname(), OFFERED_PCI), OFFERED_PCI]],
      );
      assert.deepEqual(cap.body.mig_profiles, { '1g.5gb': 2 });
      assert.match(agent!.output(), /vfio\/41 is missing/);
    });

    it('refuses over HTTP a create naming a device it does not offer (409 GPU_NOT_ON_HOST), and makes nothing', async () => {
      const r = await call(agent!, 'POST', '/v1/vms', {
        name: 'gpu-x',
        cpus: 1,
        ram_mb: 256,
        egress: { mode: 'none', allow_out: [], deny_out: [] },
        gpu_uuids: [deviceUuid(hostname(), '0000:af:00.0')],
      });
      assert.equal(r.status, 409, JSON.stringify(r.body));
      assert.equal(r.body.code, 'GPU_NOT_ON_HOST');
      assert.deepEqual((await call(agent!, 'GET', '/v1/vms')).body.vms, []);
    });

    it('refuses a device uuid that is not a uuid-like token at the edge (400)', async () => {
      const r = await call(agent!, 'POST', '/v1/vms', { name: 'gpu-y', cpus: 1, ram_mb: 256, gpu_uuids: ['../../etc/passwd'] });
      assert.equal(r.status, 400, JSON.stringify(r.body));
    });
  },
);

describe('a process agent', { timeout: 120_000 }, () => {
  let root = '';
  let agent: RunningAgent | undefined;
  let skip: string | undefined;

  before(async () => {
    skip = await missingPrerequisite();
    if (skip) return;
    root = await mkdtemp(join(tmpdir(), 'gpu-proc-'));
    agent = await startAgent({
      dataDir: join(root, 'd'),
      imageDir: join(root, 'images'),
      subnet: uniqueSubnet(),
      bridgePrefix: uniquePrefix(),
    });
  });

  after(async () => {
    await agent?.stop();
    await agent?.cleanupHost();
    if (root) await rm(root, { recursive: true, force: true });
  });

  it('refuses a create or a lazy restore that carries GPUs (409 GPU_PASSTHROUGH_UNSUPPORTED) instead of ignoring them', async (t) => {
    if (skip) return t.skip(skip);
    const create = await call(agent!, 'POST', '/v1/vms', {
      name: 'gpu-p',
      cpus: 1,
      ram_mb: 256,
      gpu_uuids: [deviceUuid('h', OFFERED_PCI)],
    });
    assert.equal(create.status, 409, JSON.stringify(create.body));
    assert.equal(create.body.code, 'GPU_PASSTHROUGH_UNSUPPORTED');
    const lazy = await call(agent!, 'POST', '/v1/vms/lazy', {
      name: 'gpu-q',
      cpus: 1,
      ram_mb: 256,
      checkpoint_id: 'cp-1',
      from: { url: 'http://127.0.0.1:1', grant: 'g' },
      mig_instance_uuids: [MDEV_A],
    });
    assert.equal(lazy.status, 409, JSON.stringify(lazy.body));
    assert.equal(lazy.body.code, 'GPU_PASSTHROUGH_UNSUPPORTED');
    assert.deepEqual((await call(agent!, 'GET', '/v1/vms')).body.vms, []);
    const cap = await call(agent!, 'GET', '/v1/capacity');
    assert.equal(cap.body.gpus, undefined);
    assert.equal(cap.body.gpu_devices, undefined);
  });
});
