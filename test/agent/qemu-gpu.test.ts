import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { pino } from 'pino';
import { AppError, createVmRequestSchema, hostCapacitySchema } from '@fleet/agent-protocol';
import { buildQemuArgs } from '../../packages/agent/src/backend/qemu/command.js';
import { bindGpus, deviceUuid, gpuCapacity, migProfileOf, probeGpus } from '../../packages/agent/src/backend/qemu/gpu-probe.js';
import { resolveQemuImage, qemuImageRoot } from '../../packages/agent/src/backend/qemu/image.js';
import { vmMachineConfig } from '../../packages/agent/src/backend/qemu/vm-boot.js';
import { allocate, createVm } from '../../packages/agent/src/backend/qemu/vm-create.js';
import { checkpointVm, pauseVm } from '../../packages/agent/src/backend/qemu/vm-memory.js';
import { QemuHost } from '../../packages/agent/src/backend/qemu/vm-host.js';
import { createSpecSchema } from '../../packages/agent/src/backend/qemu/vm-state.js';
import { CheckpointStore } from '../../packages/agent/src/backend/process/checkpoints.js';
import type { Firewall } from '../../packages/agent/src/backend/process/firewall.js';
import { parseSubnet } from '../../packages/agent/src/backend/process/network.js';
import type { CreateSpec } from '../../packages/agent/src/backend.js';
import { MDEV_A, MDEV_B, MDEV_TIMESLICED, MIG_PARENT_PCI, makeGpuFixture, OFFERED_PCI } from './gpu-fixtures.js';

/**
 * The GPU lane of the qemu backend, without GPUs: no VFIO hardware exists on
 * these machines, so NOTHING here passes a device to a running VM. What is
 * covered: the probe on a fake sysfs (gpu-fixtures.ts), the capacity it
 * offers, and the create path from a create request's bound uuids to the
 * QEMU argv (spec → allocate, which binds under the alloc lock → the
 * machine config every launch uses → command.ts), including its refusals.
 * QEMU is never started.
 */

let root: string;
let roots: { sysfsRoot: string; devRoot: string };

before(async () => {
  root = await mkdtemp(join(tmpdir(), 'gpu-lane-'));
  roots = await makeGpuFixture(join(root, 'fixture'));
});
after(async () => {
  await rm(root, { recursive: true, force: true });
});

const codeOf = (err: unknown): string => (err instanceof AppError ? err.code : String(err));

describe('GPU probe on a fixture sysfs', () => {
  it('offers the VFIO-bound GPU whose group QEMU can open and the MIG-backed mdevs; says why it leaves the rest out', async () => {
    const inv = await probeGpus({ ...roots, hostKey: 'host-a' });
    assert.deepEqual(
      inv.gpus.map((g) => [g.pciAddress, g.kind]),
      [[OFFERED_PCI, 'a100']],
    );
    assert.deepEqual(inv.gpus[0]?.device, {
      uuid: deviceUuid('host-a', OFFERED_PCI),
      model: '10de:20b0',
      pci_bus_id: OFFERED_PCI,
      mig_capable: false,
      iommu_group: '40',
    });
    assert.deepEqual(
      inv.mdevs.map((m) => m.instance),
      [MDEV_A, MDEV_B].map((uuid) => ({ uuid, profile: '1g.5gb', kind: 'a100', parent_gpu_uuid: deviceUuid('host-a', MIG_PARENT_PCI) })),
    );
    const why = Object.fromEntries(inv.skipped.map((s) => [s.id, s.reason]));
    assert.match(why['0000:af:00.0'] ?? '', /vfio\/41 is missing/);
    assert.match(why['0000:d8:00.0'] ?? '', /0000:d8:00\.1, bound to snd_hda_intel/);
    assert.match(why['0000:86:00.0'] ?? '', /class 0x020000 is not a display controller/);
    assert.match(why[MDEV_TIMESLICED] ?? '', /not a MIG-backed instance/);
    assert.equal(inv.skipped.length, 4);
  });

  it('reports them in the protocol capacity fields, and an empty sysfs reports none', async () => {
    const fields = gpuCapacity(await probeGpus({ ...roots, hostKey: 'host-a' }));
    const cap = hostCapacitySchema.parse({ cpus: 2, ram_mb: 1024, storage_gb: 1, vm_count: 4, ...fields });
    assert.equal(cap.gpus, 1);
    assert.equal(cap.gpu_kind, 'a100');
    assert.deepEqual(
      cap.gpu_devices?.map((d) => d.uuid),
      [deviceUuid('host-a', OFFERED_PCI)],
    );
    assert.deepEqual(cap.mig_profiles, { '1g.5gb': 2 });
    assert.deepEqual(
      cap.mig_instances?.map((m) => m.uuid),
      [MDEV_A, MDEV_B],
    );
    const empty = join(root, 'empty');
    await mkdir(empty);
    assert.deepEqual(gpuCapacity(await probeGpus({ sysfsRoot: empty, devRoot: empty, hostKey: 'host-a' })), {});
  });

  it('device uuids are stable per host and address, and differ across hosts', async () => {
    const a1 = await probeGpus({ ...roots, hostKey: 'host-a' });
    const a2 = await probeGpus({ ...roots, hostKey: 'host-a' });
    const b = await probeGpus({ ...roots, hostKey: 'host-b' });
    assert.equal(a1.gpus[0]?.uuid, a2.gpus[0]?.uuid);
    assert.notEqual(a1.gpus[0]?.uuid, b.gpus[0]?.uuid);
    assert.match(a1.gpus[0]?.uuid ?? '', /^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
  });

  it('MIG profiles come from MIG-backed vGPU type names only', () => {
    assert.deepEqual(migProfileOf('GRID A100-1-5C'), { profile: '1g.5gb', kind: 'a100' });
    assert.deepEqual(migProfileOf('NVIDIA A100X-3-20C'), { profile: '3g.20gb', kind: 'a100' });
    assert.equal(migProfileOf('GRID A100-4C'), undefined);
    assert.equal(migProfileOf('i915-GVTg_V5_4'), undefined);
  });
});

describe('create → QEMU command line (QEMU not started)', () => {
  let host: QemuHost;
  /** The agent's log lines (warn and up): where a refused create's holder goes, and only there. */
  const logged: string[] = [];
  let gpuUuid: string;
  const unusedFirewall = new Proxy(Object.create(null) as Firewall, {
    get: (_t, p) => {
      throw new Error(`the binding path must not touch the firewall (${String(p)})`);
    },
  });

  before(async () => {
    const dataDir = join(root, 'agent');
    const imageDir = join(root, 'images');
    await mkdir(join(dataDir, 'qemu', 'vms'), { recursive: true });
    // An image record only: createVm resolves it before it allocates; nothing here reads the kernel or disk.
    await mkdir(join(qemuImageRoot(imageDir), 'base'), { recursive: true });
    await writeFile(join(qemuImageRoot(imageDir), 'base', 'image.json'), JSON.stringify({ kernel_version: '6.1.0', root_bytes: 1 << 30 }));
    const store = new CheckpointStore(join(dataDir, 'checkpoints'), join(dataDir, 'staging'));
    await store.init();
    host = new QemuHost(
      {
        dataDir,
        imageDir,
        subnet: '10.231.0.0/24',
        bridgePrefix: 'gpux',
        maxSandboxes: 8,
        allowCrossTenant: false,
        publishHost: '127.0.0.1',
        defaultImage: 'base',
        bootTimeoutMs: 1_000,
        qemuBinary: 'qemu-system-x86_64',
        ...roots,
      },
      parseSubnet('10.231.0.0/24'),
      unusedFirewall,
      { accel: 'tcg', nestedVirtSupported: false, reason: 'test' },
      pino({ level: 'warn' }, { write: (line: string) => void logged.push(line) }),
      store,
      'test',
    );
    // The agent's own key (this machine's name): what its capacity reported.
    gpuUuid = deviceUuid(hostname(), OFFERED_PCI);
  });

  /** The create request as the control plane sends it, through the protocol's schema and the route's mapping. */
  function specOf(
    name: string,
    extra: { gpu_uuids?: readonly string[]; mig_instance_uuids?: readonly string[]; resume?: boolean },
  ): CreateSpec {
    const req = createVmRequestSchema.parse({ name, cpus: 1, ram_mb: 256, tenant: 'acme', ...extra });
    return {
      name: req.name,
      cpus: req.cpus,
      ram_mb: req.ram_mb,
      tenant: req.tenant,
      ...(req.resume ? { resume: true, checkpointId: 'cp-x' } : {}),
      ...(req.gpu_uuids?.length ? { gpuUuids: req.gpu_uuids } : {}),
      ...(req.mig_instance_uuids?.length ? { migInstanceUuids: req.mig_instance_uuids } : {}),
    };
  }

  async function argvOf(spec: CreateSpec): Promise<string[]> {
    const image = await resolveQemuImage(host.opts.imageDir, 'base');
    const record = await allocate(host, createSpecSchema.parse(spec), image, image.rootBytes, '');
    return buildQemuArgs(vmMachineConfig(host, record.state, image));
  }

  const devices = (args: string[]): string[] =>
    args.flatMap((a, i) => (a === '-device' && args[i + 1]?.startsWith('vfio-pci') ? [args[i + 1]!] : []));

  it('a bound GPU and MIG instance become vfio-pci devices by PCI address and by mdev path; state.json keeps the binding', async () => {
    const args = await argvOf(specOf('gpu-a', { gpu_uuids: [gpuUuid], mig_instance_uuids: [MDEV_A] }));
    assert.deepEqual(devices(args), [`vfio-pci,host=${OFFERED_PCI}`, `vfio-pci,sysfsdev=/sys/bus/mdev/devices/${MDEV_A}`]);
    const saved = await host.readRecord('gpu-a');
    assert.ok(saved);
    assert.deepEqual(saved.state.gpu, { uuids: [gpuUuid, MDEV_A], pci_addresses: [OFFERED_PCI], mdev_uuids: [MDEV_A] });
    // A later launch of the same VM (restart, restore) builds the same devices from its state.
    const image = await resolveQemuImage(host.opts.imageDir, 'base');
    assert.deepEqual(devices(buildQemuArgs(vmMachineConfig(host, saved.state, image))), devices(args));
  });

  it('a VM bound to nothing gets no vfio device', async () => {
    assert.deepEqual(devices(await argvOf(specOf('gpu-none', {}))), []);
  });

  it('refuses a device another VM of this agent holds (409 GPU_IN_USE) without naming it, and makes nothing', async () => {
    logged.length = 0;
    await assert.rejects(argvOf(specOf('gpu-b', { gpu_uuids: [gpuUuid] })), (err) => {
      assert.equal(codeOf(err), 'GPU_IN_USE');
      assert.equal((err as AppError).status, 409);
      // The holder may be another tenant's sandbox: the answer says the device is taken, not by whom.
      assert.doesNotMatch((err as Error).message, /gpu-a/);
      assert.doesNotMatch(JSON.stringify((err as AppError).details ?? {}), /gpu-a/);
      assert.match((err as Error).message, /bound to another sandbox/);
      return true;
    });
    assert.ok(
      logged.some((l) => (JSON.parse(l) as { holder?: string }).holder === 'gpu-a'),
      `the agent's log names the holder: ${logged.join('')}`,
    );
    await assert.rejects(argvOf(specOf('gpu-c', { mig_instance_uuids: [MDEV_A] })), (err) => codeOf(err) === 'GPU_IN_USE');
    assert.ok(!host.records.has('gpu-b') && !host.records.has('gpu-c'));
    assert.deepEqual((await readdir(host.vmsDir)).sort(), ['gpu-a', 'gpu-none']);
  });

  it('two creates racing for one free instance: exactly one is bound', async () => {
    const results = await Promise.allSettled([
      argvOf(specOf('race-1', { mig_instance_uuids: [MDEV_B] })),
      argvOf(specOf('race-2', { mig_instance_uuids: [MDEV_B] })),
    ]);
    assert.equal(results.filter((r) => r.status === 'fulfilled').length, 1);
    assert.deepEqual(
      results.flatMap((r) => (r.status === 'rejected' ? [codeOf(r.reason)] : [])),
      ['GPU_IN_USE'],
    );
  });

  it('through createVm: a uuid this host does not offer (409 GPU_NOT_ON_HOST), a GPU left out by the probe, a MIG uuid given as a GPU', async () => {
    for (const [name, extra] of [
      ['gpu-d', { gpu_uuids: ['00000000-0000-8000-8000-000000000000'] }],
      ['gpu-e', { gpu_uuids: [deviceUuid(hostname(), '0000:af:00.0')] }],
      ['gpu-f', { gpu_uuids: [MDEV_A] }],
      ['gpu-g', { mig_instance_uuids: [MDEV_TIMESLICED] }],
    ] as const) {
      await assert.rejects(createVm(host, { ...specOf(name, extra), egress: { mode: 'none', allow_out: [], deny_out: [] } }), (err) => {
        assert.equal(codeOf(err), 'GPU_NOT_ON_HOST', `${name}: ${String(err)}`);
        assert.equal((err as AppError).status, 409);
        return true;
      });
      assert.ok(!host.records.has(name));
    }
  });

  it('through createVm: resuming a memory state with a GPU is refused (QEMU cannot save a VM holding a VFIO device)', async () => {
    await assert.rejects(
      createVm(host, { ...specOf('gpu-h', { gpu_uuids: [gpuUuid], resume: true }), egress: { mode: 'none', allow_out: [], deny_out: [] } }),
      (err) => codeOf(err) === 'BACKEND_UNSUPPORTED',
    );
  });

  it('a running VM holding a GPU: pause and a live checkpoint are refused (409 GPU_MEMORY_STATE_UNSUPPORTED) before QEMU is asked', async () => {
    const record = host.records.get('gpu-a');
    assert.ok(record?.state.gpu);
    // What the launch (which cannot run here) would have left: a running VM. No QMP socket exists, so a capture would fail otherwise.
    record.state.status = 'running';
    for (const attempt of [() => pauseVm(host, 'gpu-a'), () => checkpointVm(host, 'gpu-a', { live: true })]) {
      await assert.rejects(attempt(), (err) => {
        assert.equal(codeOf(err), 'GPU_MEMORY_STATE_UNSUPPORTED', String(err));
        assert.equal((err as AppError).status, 409);
        return true;
      });
    }
    assert.equal(record.state.status, 'running', 'nothing changed');
  });

  it('refuses one uuid bound twice in one request (400)', () => {
    assert.throws(
      () => bindGpus({ gpus: [], mdevs: [], skipped: [] }, { migInstanceUuids: [MDEV_A, MDEV_A] }, []),
      (err) => codeOf(err) === 'INVALID_SANDBOX_SPEC' && (err as AppError).status === 400,
    );
  });
});
