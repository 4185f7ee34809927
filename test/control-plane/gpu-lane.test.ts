import assert from 'node:assert/strict';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { AppError, createVmRequestSchema, type CreateVmRequest } from '@fleet/agent-protocol';
import { buildQemuArgs } from '../../packages/agent/src/backend/qemu/command.js';
import {
  bindGpus,
  deviceUuid,
  gpuCapacity,
  type GpuBinding,
  type GpuInventory,
  probeGpus,
} from '../../packages/agent/src/backend/qemu/gpu-probe.js';
import { eventually, startControlPlane, TENANT_KEYS, type ControlPlane } from '../support/control-plane.js';
import { listSchedulableHostIds } from '../../src/projections/hosts/hosts.queries.js';
import { MDEV_A, MDEV_B, makeGpuFixture, OFFERED_PCI } from '../agent/gpu-fixtures.js';

/**
 * The GPU lane from the API to the agent's create, with a RECORDING QEMU
 * AGENT DOUBLE: a small real HTTP server that answers the agent protocol's
 * capacity and create paths. Its capacity is the real GPU probe run on a
 * fixture sysfs (test/agent/gpu-fixtures.ts: one whole A100 offered, two
 * MIG 1g.5gb instances); its create parses the request with the protocol's
 * schema, binds the uuids with the real qemu backend's binding (bindGpus)
 * and records the QEMU argv command.ts builds for them. It boots nothing.
 *
 * Why a double: this machine has no VFIO device, so a real qemu agent can
 * never finish creating a GPU VM, and a failed create releases the
 * reservation the second half of this test needs held. Everything on the
 * control-plane side is real (API, Postgres event store, placement, host
 * reservations, the HTTP agent client); the real qemu agent's create path
 * (spec → allocate → machine config → argv, and its refusals) is covered in
 * test/agent/qemu-gpu.test.ts.
 */

const HOST_KEY = 'gpu-host-1';

interface Recorded {
  readonly body: CreateVmRequest;
  readonly vfio: string[];
}

async function startRecordingQemuAgentDouble(inv: GpuInventory): Promise<{
  url: string;
  token: string;
  creates: Recorded[];
  live: Map<string, GpuBinding | undefined>;
  requests: string[];
  checkpoints: Array<{ name: string; live: boolean | undefined }>;
  close(): Promise<void>;
}> {
  const token = `gpu-double-${'x'.repeat(20)}`;
  const creates: Recorded[] = [];
  const live = new Map<string, GpuBinding | undefined>();
  const infos = new Map<string, Record<string, unknown>>();
  /** Every authorized request but the capacity probes, as `METHOD /path`. */
  const requests: string[] = [];
  const checkpoints: Array<{ name: string; live: boolean | undefined }> = [];
  const handle = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    const send = (status: number, body: unknown): void => {
      res.writeHead(status, { 'content-type': 'application/json' });
      res.end(JSON.stringify(body));
    };
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    if (req.headers.authorization !== `Bearer ${token}`) {
      send(401, { code: 'UNAUTHORIZED', message: 'bad token' });
      return;
    }
    const path = new URL(req.url ?? '/', 'http://double').pathname;
    if (path !== '/v1/capacity') requests.push(`${req.method ?? ''} ${path}`);
    if (req.method === 'GET' && path === '/v1/capacity') {
      send(200, {
        cpus: 16,
        ram_mb: 65_536,
        storage_gb: 500,
        vm_count: 8,
        arch: 'amd64',
        ...gpuCapacity(inv),
        backend: 'qemu',
        // As a real qemu host answers: QEMU captures and streams memory (just not a VFIO device's).
        live_snapshot: true,
        lazy_pages: true,
        vms_running: live.size,
      });
      return;
    }
    if (req.method === 'POST' && path === '/v1/vms') {
      const body = createVmRequestSchema.parse(JSON.parse(Buffer.concat(chunks).toString('utf8')));
      let gpu: GpuBinding | undefined;
      try {
        gpu = bindGpus(
          inv,
          { gpuUuids: body.gpu_uuids, migInstanceUuids: body.mig_instance_uuids },
          [...live].map(([name, g]) => ({ name, gpu: g })),
        );
      } catch (err) {
        const e = err as AppError;
        send(e.status, { code: e.code, message: e.message });
        return;
      }
      const argv = buildQemuArgs({
        processName: `fleet:gpu:${body.name}`,
        accel: 'tcg',
        cpus: body.cpus,
        memoryMb: body.ram_mb,
        kernel: '/img/vmlinuz',
        initrd: '/img/initrd.img',
        diskPath: `/vms/${body.name}/overlay.qcow2`,
        seedPath: `/vms/${body.name}/seed.tar`,
        mac: '02:00:00:00:00:01',
        tap: 'gpuvt0',
        serialSocket: `/run/${body.name}.serial`,
        qmpSocket: `/run/${body.name}.qmp`,
        pidFile: `/vms/${body.name}/qemu.pid`,
        ...(gpu ? { gpu: { pciAddresses: gpu.pci_addresses, mdevUuids: gpu.mdev_uuids } } : {}),
      });
      creates.push({ body, vfio: argv.flatMap((a, i) => (a === '-device' && argv[i + 1]?.startsWith('vfio-pci') ? [argv[i + 1]!] : [])) });
      live.set(body.name, gpu);
      const info = {
        name: body.name,
        state: 'running',
        image: body.image ?? 'base',
        tenant: body.tenant,
        ip: '10.0.0.2',
        cpus: body.cpus,
        ram_mb: body.ram_mb,
        created_at: new Date().toISOString(),
        endpoints: [],
      };
      infos.set(body.name, info);
      send(201, { ...info, ...(body.files ? { files_written: body.files.length } : {}) });
      return;
    }
    if (req.method === 'GET' && path === '/v1/vms') {
      send(200, { vms: [...infos.values()] });
      return;
    }
    const capture = /^\/v1\/vms\/([^/]+)\/checkpoints$/.exec(path);
    if (req.method === 'POST' && capture?.[1]) {
      const name = decodeURIComponent(capture[1]);
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as { id: string; comment?: string; live?: boolean };
      checkpoints.push({ name, live: body.live });
      if (!live.has(name)) {
        send(404, { code: 'SANDBOX_NOT_FOUND', message: `no sandbox ${name}` });
        return;
      }
      // As the qemu backend (vm-memory.ts): no live capture of a VM holding GPUs; a disk capture is its overlay.
      if (body.live && live.get(name)) {
        send(409, { code: 'GPU_MEMORY_STATE_UNSUPPORTED', message: 'QEMU cannot save the state of a passed-through GPU' });
        return;
      }
      send(201, {
        id: body.id,
        vm_name: name,
        comment: body.comment ?? '',
        size_bytes: 4096,
        created_at: new Date().toISOString(),
        digest: 'a'.repeat(64),
        kind: 'disk',
        image: 'base',
        files: {},
      });
      return;
    }
    const pause = /^\/v1\/vms\/([^/]+)\/pause$/.exec(path);
    if (req.method === 'POST' && pause?.[1] && live.get(decodeURIComponent(pause[1]))) {
      // What the qemu backend answers (vm-memory.ts) for a VM holding GPUs.
      send(409, { code: 'GPU_MEMORY_STATE_UNSUPPORTED', message: 'QEMU cannot save the state of a passed-through GPU' });
      return;
    }
    const vm = /^\/v1\/vms\/([^/]+)$/.exec(path);
    if (req.method === 'DELETE' && vm?.[1]) {
      const name = decodeURIComponent(vm[1]);
      infos.delete(name);
      send(200, { name, destroyed: live.delete(name), drained: false });
      return;
    }
    send(404, { code: 'NOT_FOUND', message: `double: no route ${req.method ?? ''} ${path}` });
    return;
  };
  const server: Server = createServer((req, res) => {
    handle(req, res).catch((err: unknown) => {
      if (!res.headersSent) res.writeHead(500, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ code: 'AGENT_ERROR', message: String(err) }));
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    token,
    creates,
    live,
    requests,
    checkpoints,
    async close() {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

describe('GPU lane: placement binds a device, the create carries it to the agent', { timeout: 120_000 }, () => {
  let cp: ControlPlane | undefined;
  let agent: Awaited<ReturnType<typeof startRecordingQemuAgentDouble>> | undefined;
  /** A second GPU host, registered only by the memory-state tests at the end (the capacity test above needs gpu1 alone). */
  let agent2: Awaited<ReturnType<typeof startRecordingQemuAgentDouble>> | undefined;
  let dir = '';
  let dir2 = '';
  const gpuUuid = deviceUuid(HOST_KEY, OFFERED_PCI);

  const vmOf = (id: string) => cp!.service.vms.get(id, { tenantId: 'admin', admin: true });

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'gpu-lane-cp-'));
    const inv = await probeGpus({ ...(await makeGpuFixture(dir)), hostKey: HOST_KEY });
    agent = await startRecordingQemuAgentDouble(inv);
    // No coalescing slack on idle expiry; standby checkpoints on (their timer never fires here: ticks are called).
    cp = await startControlPlane({ env: { ACTIVITY_COALESCE_MS: '0', CHECKPOINT_INTERVAL_MS: '3600000' } });
    const r = await cp.request('POST', '/v1/hosts', {
      body: { id: 'gpu1', url: agent.url, token: agent.token, backend: 'qemu', region: 'test' },
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
  });

  after(async () => {
    await cp?.close();
    await agent?.close();
    await agent2?.close();
    if (dir) await rm(dir, { recursive: true, force: true });
    if (dir2) await rm(dir2, { recursive: true, force: true });
  });

  it('a VM asking for 1 GPU is bound to the probed device uuid, which reaches the agent as a vfio-pci device', async () => {
    const r = await cp!.request('POST', '/v1/vms', {
      as: 'acme',
      body: { image: 'base', cpus: 1, ram_mb: 512, gpus: 1, gpu_kind: 'a100' },
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    const vm = await vmOf(r.body.id);
    assert.equal(vm.status, 'running');
    assert.equal(vm.host_id, 'gpu1');
    const created = agent!.creates.at(-1);
    assert.deepEqual(created?.body.gpu_uuids, [gpuUuid]);
    assert.equal(created.body.mig_instance_uuids, undefined);
    assert.deepEqual(created.vfio, [`vfio-pci,host=${OFFERED_PCI}`]);
  });

  it('a second GPU VM on this one-GPU host is refused CAPACITY_EXHAUSTED, and the agent never sees it', async () => {
    const before = agent!.creates.length;
    const r = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', cpus: 1, ram_mb: 512, gpus: 1 } });
    assert.equal(r.body.code, 'CAPACITY_EXHAUSTED', JSON.stringify(r.body));
    assert.equal(agent!.creates.length, before);
  });

  it('MIG instances are bound by uuid and reach the agent as mdevs; a VM without GPUs carries none', async () => {
    const mig = await cp!.request('POST', '/v1/vms', {
      as: 'acme',
      body: { image: 'base', cpus: 1, ram_mb: 512, gpus: 2, gpu_profile: '1g.5gb' },
    });
    assert.equal(mig.status, 201, JSON.stringify(mig.body));
    const created = agent!.creates.at(-1);
    assert.deepEqual([...(created?.body.mig_instance_uuids ?? [])].sort(), [MDEV_A, MDEV_B]);
    assert.equal(created?.body.gpu_uuids, undefined);
    assert.deepEqual(
      created?.vfio.sort(),
      [MDEV_A, MDEV_B].map((u) => `vfio-pci,sysfsdev=/sys/bus/mdev/devices/${u}`),
    );
    const plain = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', cpus: 1, ram_mb: 512 } });
    assert.equal(plain.status, 201, JSON.stringify(plain.body));
    const last = agent!.creates.at(-1);
    assert.equal(last?.body.gpu_uuids, undefined);
    assert.equal(last?.body.mig_instance_uuids, undefined);
    assert.deepEqual(last?.vfio, []);
  });

  it('once the GPU VM is destroyed its device is free again and the next GPU VM gets it', async () => {
    const holder = [...agent!.live].find(([, g]) => g?.uuids.includes(gpuUuid))?.[0];
    assert.ok(holder);
    const d = await cp!.request('DELETE', `/v1/vms/${holder.replace(/^fl-/, '')}`, { as: 'acme' });
    assert.ok(d.status < 300, JSON.stringify(d.body));
    const r = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', cpus: 1, ram_mb: 512, gpus: 1 } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    assert.deepEqual(agent!.creates.at(-1)?.body.gpu_uuids, [gpuUuid]);
  });
  const gpuHolders = (): string[] => [...agent!.live].filter(([, g]) => g !== undefined).map(([name]) => name.replace(/^fl-/, ''));

  it('a live or lazy migration of a VM holding GPUs is refused 409 GPU_MEMORY_STATE_UNSUPPORTED before any target is reserved or asked', async () => {
    dir2 = await mkdtemp(join(tmpdir(), 'gpu-lane-cp2-'));
    agent2 = await startRecordingQemuAgentDouble(await probeGpus({ ...(await makeGpuFixture(dir2)), hostKey: 'gpu-host-2' }));
    const reg = await cp!.request('POST', '/v1/hosts', {
      body: { id: 'gpu2', url: agent2.url, token: agent2.token, backend: 'qemu', region: 'test' },
    });
    assert.equal(reg.status, 201, JSON.stringify(reg.body));
    const holders = gpuHolders();
    assert.equal(holders.length, 2, 'the whole-GPU VM and the MIG VM');
    for (const id of holders) {
      for (const body of [{ live: true, target_host_id: 'gpu2' }, { live: true, lazy: true, target_host_id: 'gpu2' }, { live: true }]) {
        const r = await cp!.request('POST', `/v1/vms/${id}/migrate`, { as: 'acme', body });
        assert.equal(r.status, 409, JSON.stringify(r.body));
        assert.equal(r.body.code, 'GPU_MEMORY_STATE_UNSUPPORTED', JSON.stringify(r.body));
        assert.equal((await vmOf(id)).host_id, 'gpu1', 'it runs on where it was');
      }
    }
    assert.deepEqual(agent2.requests, [], 'the would-be target was asked nothing');
    assert.deepEqual(
      agent!.requests.filter((p) => /migration/.test(p)),
      [],
      'the source was asked for no offer or send',
    );
    const { state: h2 } = await cp!.service.hosts.load('gpu2');
    assert.ok(h2.status !== 'unregistered' && h2.reservations.size === 0, 'nothing reserved on the target');
  });

  it('standby checkpoints pass over VMs holding GPUs (their host would refuse each tick) and still take the others', async () => {
    const holders = gpuHolders();
    const plain = [...agent!.live].find(([, g]) => g === undefined)?.[0];
    assert.ok(plain, 'the VM without GPUs');
    // The tick reads the hosts read model, which follows the log: under load gpu2's registration (the test
    // before) may not be in it yet, and with no other host there is no standby to checkpoint to.
    await eventually(
      async () => (await listSchedulableHostIds(cp!.service.pool)).some((h) => h.id === 'gpu2'),
      10_000,
      'gpu2 in the hosts read model',
    );
    agent!.requests.length = 0;
    await cp!.service.standby.tick();
    const asked = agent!.requests.filter((p) => /^POST .*\/checkpoints$/.test(p));
    assert.deepEqual(asked, [`POST /v1/vms/${plain}/checkpoints`], 'only the VM without GPUs was checkpointed');
    for (const id of holders) assert.equal(asked.filter((p) => p.includes(id)).length, 0);
  });

  it('an idle GPU VM whose on_idle is pause is destroyed (its state cannot be saved), not retried each cycle', async () => {
    // The whole GPU is free once its holder goes; the idle one takes it.
    const whole = [...agent!.live].find(([, g]) => g?.uuids.includes(gpuUuid))?.[0];
    assert.ok(whole);
    assert.ok((await cp!.request('DELETE', `/v1/vms/${whole.replace(/^fl-/, '')}`, { as: 'acme' })).status < 300);
    const r = await cp!.request('POST', '/v1/vms', {
      as: 'acme',
      body: { image: 'base', cpus: 1, ram_mb: 512, gpus: 1, idle_timeout_s: 1, on_idle: 'pause' },
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    const id = r.body.id as string;
    await new Promise((res) => setTimeout(res, 1500));
    agent!.requests.length = 0;
    await cp!.service.reconciler.reconcileOnce();
    assert.ok(agent!.requests.includes(`POST /v1/vms/fl-${id}/pause`), 'the pause was tried first');
    assert.ok(agent!.requests.includes(`DELETE /v1/vms/fl-${id}`), 'then the VM was destroyed');
    const vm = await vmOf(id);
    assert.ok(['destroyed', 'destroying'].includes(vm.status), `status ${vm.status}`);
    assert.equal(agent!.live.has(`fl-${id}`), false, 'its GPU is free again');
  });

  it('the E2B fork of a VM holding a GPU captures its disk, never asks its host for a live capture', async (t) => {
    const r = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', cpus: 1, ram_mb: 512, gpus: 1 } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    const id = r.body.id as string;
    agent!.checkpoints.length = 0;
    const fork = await cp!.request('POST', `/e2b/sandboxes/${id}/fork`, {
      headers: { 'x-api-key': TENANT_KEYS.acme },
      body: { count: 1 },
    });
    // The fork itself needs the other host's GPU and the capture moved there, which this double does not serve.
    t.diagnostic(`fork answered ${fork.status}: ${JSON.stringify(fork.body)}`);
    assert.notEqual((fork.body as { code?: string } | undefined)?.code, 'GPU_MEMORY_STATE_UNSUPPORTED', JSON.stringify(fork.body));
    assert.deepEqual(agent!.checkpoints, [{ name: `fl-${id}`, live: false }], 'one disk capture of the source');
    // E2B's createSnapshot likewise takes its disk.
    agent!.checkpoints.length = 0;
    const snap = await cp!.request('POST', `/e2b/sandboxes/${id}/snapshots`, { headers: { 'x-api-key': TENANT_KEYS.acme }, body: {} });
    assert.equal(snap.status, 201, JSON.stringify(snap.body));
    assert.deepEqual(agent!.checkpoints, [{ name: `fl-${id}`, live: false }], 'createSnapshot: a disk capture');
  });
});
