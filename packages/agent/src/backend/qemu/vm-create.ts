import { randomBytes, randomUUID } from 'node:crypto';
import { chmod, mkdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';
import { AppError } from '@fleet/agent-protocol';
import {
  capacityExhausted,
  type Checkpoint,
  type CreateSpec,
  invalidSpec,
  sandboxExists,
  sandboxFailed,
  type SandboxInfo,
} from '../../backend.js';
import { mustRun } from '../process/exec-util.js';
import { allocateBridge } from '../process/network.js';
import { bridgeKeyOf, reserveAddress } from '../process/sandbox-cluster.js';
import { type QemuImage, resolveQemuImage } from './image.js';
import { DISK_FILE, type QemuMeta, readMeta } from './state.js';
import { createSpecSchema, unsupportedByQemu, type VmRecord, type VmState } from './vm-state.js';
import { checkMachine, checkSize, virtualSize } from './vm-machine.js';
import { diskFromCheckpoint, launchQemu, loadInto, publish, waitForGuest } from './vm-boot.js';
import { plugNetwork } from './vm-network.js';
import { bindGpus, probeHostGpus } from './gpu-probe.js';
import { teardown } from './vm-teardown.js';
import type { QemuHost } from './vm-host.js';

/** Create: spec checks, allocation (address, MAC, tap, bridge), disk and seed, then boot or load a checkpoint. */

export async function createVm(qemu: QemuHost, input: CreateSpec): Promise<SandboxInfo> {
  if (qemu.closed) throw sandboxFailed('the qemu backend is closed');
  // Its taps have no NAT or egress proxy yet: a VM asking for outbound access is refused, never booted without it.
  if (input.egress && input.egress.mode !== 'none')
    throw unsupportedByQemu(`egress mode "${input.egress.mode}" (create with egress {"mode":"none"})`);
  const parsed = createSpecSchema.safeParse(input);
  if (!parsed.success) {
    throw invalidSpec(
      `invalid sandbox spec: ${parsed.error.issues.map((i) => `${i.path.join('.') || '(spec)'}: ${i.message}`).join('; ')}`,
      parsed.error.issues.map((i) => ({ path: i.path.join('.'), message: i.message })),
    );
  }
  const spec = parsed.data;
  if (spec.resume && !spec.checkpointId) {
    throw invalidSpec('resume needs a checkpointId (a live checkpoint)', [{ path: 'resume', message: 'needs checkpointId' }]);
  }
  if (spec.resume && (spec.gpuUuids?.length || spec.migInstanceUuids?.length)) {
    // No memory state of a GPU VM exists to resume: QEMU refuses to save a VM holding a VFIO device (a migration blocker).
    throw unsupportedByQemu('resuming a memory state with GPUs or MIG instances bound (create it cold from the checkpoint)');
  }
  if (spec.pids_max !== undefined) {
    throw invalidSpec('pids_max does not apply to a VM (the guest runs its own kernel)', [{ path: 'pids_max', message: 'not supported' }]);
  }
  const ports = new Set<string>();
  for (const e of spec.expose ?? []) {
    const key = `${e.protocol ?? 'tcp'}/${e.port}`;
    if (ports.has(key)) throw invalidSpec(`port ${key} is exposed twice`, [{ path: 'expose', message: 'duplicate port' }]);
    ports.add(key);
  }
  return qemu.locks.run(`vm:${spec.name}`, async () => {
    if (qemu.records.has(spec.name) || qemu.creating.has(spec.name)) throw sandboxExists(spec.name);
    const from = spec.checkpointId ? await fromCheckpoint(qemu, spec) : undefined;
    const image = await resolveQemuImage(qemu.opts.imageDir, from?.cp.image ?? spec.image ?? qemu.opts.defaultImage);
    if (from?.meta) await checkMachine(qemu, from.cp, from.meta, image);
    qemu.creating.add(spec.name);
    try {
      return await createLocked(qemu, spec, image, from);
    } finally {
      qemu.creating.delete(spec.name);
    }
  });
}

/** A create from a checkpoint: the checkpoint, and for a resume the machine its state needs (the spec must agree with it). */
export async function fromCheckpoint(qemu: QemuHost, spec: z.infer<typeof createSpecSchema>): Promise<{ cp: Checkpoint; meta?: QemuMeta }> {
  const cp = await qemu.store.get(spec.checkpointId ?? '');
  if (spec.image && spec.image !== cp.image) {
    throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", not "${spec.image}": omit image or name the checkpoint's`, [
      { path: 'image', message: 'conflicts with the checkpoint' },
    ]);
  }
  if (!spec.resume) return { cp };
  const meta = await readMeta(qemu.store, cp);
  checkSize(qemu, spec, meta, `checkpoint "${cp.id}"`);
  return { cp, meta };
}

export async function createLocked(
  qemu: QemuHost,
  spec: z.infer<typeof createSpecSchema>,
  image: QemuImage,
  from?: { cp: Checkpoint; meta?: QemuMeta },
): Promise<SandboxInfo> {
  const dir = qemu.vmDir(spec.name);
  const record = await allocate(
    qemu,
    spec,
    image,
    from?.meta?.disk_bytes ?? Math.max(image.rootBytes, (spec.storage_gb ?? 0) * 1024 ** 3),
    from?.cp.id ?? '',
  );
  const state = record.state;
  const started = Date.now();
  try {
    await plugNetwork(qemu, state);
    await qemu.firewall.apply(() => qemu.firewallState());
    if (from) {
      await diskFromCheckpoint(qemu, state, from.cp, image);
      // A cold boot over a checkpoint's disk may grow it (the guest grows its filesystem at boot); a resumed state may not.
      if (!from.meta && state.disk_bytes > (await virtualSize(join(dir, DISK_FILE)))) {
        await mustRun('qemu-img', ['resize', '-q', join(dir, DISK_FILE), String(state.disk_bytes)]);
      }
      if (!from.meta) state.disk_bytes = Math.max(state.disk_bytes, await virtualSize(join(dir, DISK_FILE)));
    } else {
      await mustRun('qemu-img', [
        'create',
        '-q',
        '-f',
        'qcow2',
        '-b',
        image.rootfs,
        '-F',
        'qcow2',
        join(dir, DISK_FILE),
        String(state.disk_bytes),
      ]);
    }
    await writeSeed(qemu, state);
    if (from?.meta) {
      await loadInto(qemu, record, from.cp, image, started);
    } else {
      await launchQemu(qemu, state, image);
      await qemu.writeState(state);
      await qemu.startConsole(record);
      await waitForGuest(qemu, state, started);
    }
    await publish(qemu, record);
    state.status = 'running';
    await qemu.writeState(state);
  } catch (err) {
    await teardown(qemu, record, { graceMs: 0 }).catch(() => undefined);
    throw err instanceof AppError ? err : sandboxFailed(`creating VM "${spec.name}" failed: ${(err as Error).message}`, {}, err);
  }
  qemu.log?.info({ vm: spec.name, ip: state.ip, accel: state.accel, boot_ms: Date.now() - started }, 'VM created');
  return qemu.info(record);
}

/** Name, address, MAC, tap and bridge, taken under one lock and recorded (status `creating`) before anything is made. */
export async function allocate(
  qemu: QemuHost,
  spec: z.infer<typeof createSpecSchema>,
  image: QemuImage,
  diskBytes: number,
  checkpointId: string,
): Promise<VmRecord> {
  const dir = qemu.vmDir(spec.name);
  // Addresses, taps and bridges are host-wide: allocate under one lock and record before anything is made.
  return qemu.locks.run('alloc', async () => {
    // Every VM past this point (being created or running) is in records.
    if (qemu.records.size >= qemu.opts.maxSandboxes) {
      throw capacityExhausted(`${qemu.opts.maxSandboxes} VMs already run here`, { max: qemu.opts.maxSandboxes });
    }
    const others = [...qemu.records.values()].map((r) => r.state);
    // Under this lock: two creates naming one device cannot both get it.
    const gpu =
      spec.gpuUuids?.length || spec.migInstanceUuids?.length ? bindGpus(await probeHostGpus(qemu.opts), spec, others, qemu.log) : undefined;
    const { ip, mac } = reserveAddress(qemu.subnet, spec.name, spec.network, spec.ipHint, others);
    // A network's members get a bridge of their own (never the shared one): the firewall keeps each frame on its bridge.
    const bridge = allocateBridge(
      qemu.bridgeStem(),
      bridgeKeyOf(spec),
      qemu.opts.allowCrossTenant && !spec.network,
      others.map((s) => ({ tenant: bridgeKeyOf(s), bridge: s.bridge })),
    );
    let tap = '';
    for (let i = 0; ; i++) {
      tap = `${qemu.opts.bridgePrefix}vt${i}`;
      if (!others.some((s) => s.tap === tap)) break;
    }
    const st: VmState = {
      name: spec.name,
      status: 'creating',
      paused_checkpoint: '',
      checkpoint_id: checkpointId,
      vmgenid: randomUUID(),
      tenant: spec.tenant,
      image: image.name,
      ip,
      mac,
      cpus: spec.cpus,
      ram_mb: spec.ram_mb,
      storage_gb: spec.storage_gb ?? 0,
      disk_bytes: diskBytes,
      created_at: new Date().toISOString(),
      bridge,
      tap,
      token: randomBytes(24).toString('hex'),
      accel: qemu.accel.accel,
      env: spec.env ?? {},
      expose: spec.expose ?? [],
      endpoints: [],
      pid: 0,
      pid_start: '',
      ...(spec.network ? { network: spec.network } : {}),
      ...(gpu ? { gpu } : {}),
    };
    await rm(dir, { recursive: true, force: true });
    await mkdir(dir, { recursive: true, mode: 0o700 });
    await qemu.writeState(st);
    // Recorded now so the next allocation sees its address, tap and bridge taken.
    const record: VmRecord = { state: st, proxies: [] };
    qemu.records.set(spec.name, record);
    return record;
  });
}

/** The seed disk: a tar the initramfs unpacks into a tmpfs (/run/fleet), so the token never lands on the VM's disk. */
export async function writeSeed(qemu: QemuHost, s: VmState): Promise<void> {
  const dir = qemu.vmDir(s.name);
  const seed = join(dir, 'seed');
  await rm(seed, { recursive: true, force: true });
  await mkdir(seed, { mode: 0o700 });
  const net = {
    FLEET_HOSTNAME: s.name,
    FLEET_IP: s.ip,
    FLEET_PREFIX: String(qemu.subnet.prefixLen),
    FLEET_GATEWAY: qemu.subnet.gateway,
    FLEET_MAC: s.mac,
  };
  await writeFile(
    join(seed, 'net.env'),
    Object.entries(net)
      .map(([k, v]) => `${k}=${v}\n`)
      .join(''),
  );
  await writeFile(join(seed, 'token'), s.token, { mode: 0o600 });
  await mustRun('tar', ['-cf', join(dir, 'seed.tar'), '--owner=0', '--group=0', '-C', seed, '.']);
  await chmod(join(dir, 'seed.tar'), 0o600);
  await rm(seed, { recursive: true, force: true });
}
