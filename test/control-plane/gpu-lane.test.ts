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
import { startControlPlane, type ControlPlane } from '../support/control-plane.js';
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
  close(): Promise<void>;
}> {
  const token = `gpu-double-${'x'.repeat(20)}`;
  const creates: Recorded[] = [];
  const live = new Map<string, GpuBinding | undefined>();
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
    if (req.method === 'GET' && path === '/v1/capacity') {
      send(200, {
        cpus: 16,
        ram_mb: 65_536,
        storage_gb: 500,
        vm_count: 8,
        arch: 'amd64',
        ...gpuCapacity(inv),
        backend: 'qemu',
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
      send(201, {
        name: body.name,
        state: 'running',
        image: body.image ?? 'base',
        tenant: body.tenant,
        ip: '10.0.0.2',
        cpus: body.cpus,
        ram_mb: body.ram_mb,
        created_at: new Date().toISOString(),
        endpoints: [],
        ...(body.files ? { files_written: body.files.length } : {}),
      });
      return;
    }
    const vm = /^\/v1\/vms\/([^/]+)$/.exec(path);
    if (req.method === 'DELETE' && vm?.[1]) {
      const name = decodeURIComponent(vm[1]);
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
    async close() {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

describe('GPU lane: placement binds a device, the create carries it to the agent', { timeout: 120_000 }, () => {
  let cp: ControlPlane | undefined;
  let agent: Awaited<ReturnType<typeof startRecordingQemuAgentDouble>> | undefined;
  let dir = '';
  const gpuUuid = deviceUuid(HOST_KEY, OFFERED_PCI);

  const vmOf = (id: string) => cp!.service.vms.get(id, { tenantId: 'admin', admin: true });

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'gpu-lane-cp-'));
    const inv = await probeGpus({ ...(await makeGpuFixture(dir)), hostKey: HOST_KEY });
    agent = await startRecordingQemuAgentDouble(inv);
    cp = await startControlPlane();
    const r = await cp.request('POST', '/v1/hosts', {
      body: { id: 'gpu1', url: agent.url, token: agent.token, backend: 'qemu', region: 'test' },
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
  });

  after(async () => {
    await cp?.close();
    await agent?.close();
    if (dir) await rm(dir, { recursive: true, force: true });
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
});
