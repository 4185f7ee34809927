import { createHash } from 'node:crypto';
import { readdir, readFile, readlink, realpath, stat } from 'node:fs/promises';
import { hostname } from 'node:os';
import { basename, dirname, join } from 'node:path';
import { AppError, type GpuDevice, type HostCapacity, type MigInstance } from '@fleet/agent-protocol';
import type { Logger } from 'pino';
import { BackendErrorCode, invalidSpec } from '../../backend.js';

/**
 * The GPU lane's host side: what this machine can pass through to a VM,
 * read from sysfs alone (no vendor tool): PCI devices bound to vfio-pci and
 * mediated devices (mdevs, e.g. MIG-backed vGPU instances). A device is
 * offered only when QEMU could open it: its IOMMU group exists, the group's
 * /dev/vfio node is there, and no device of the group is held by another
 * host driver. Everything else is left out with a reason.
 *
 * `sysfsRoot`/`devRoot` point elsewhere (AGENT_SYSFS_ROOT, AGENT_DEV_ROOT)
 * so the probe runs on fixture trees; QEMU itself always gets the real paths.
 */

export interface GpuProbeOptions {
  /** Default /sys. */
  readonly sysfsRoot: string;
  /** Default /dev (the VFIO group nodes are <devRoot>/vfio/<group>). */
  readonly devRoot: string;
  /** Mixed into whole-device uuids, so one PCI address on two machines is two devices. */
  readonly hostKey: string;
}

/** A whole device, offered as `gpu_devices[]`, passed as `-device vfio-pci,host=<pciAddress>`. */
export interface ProbedGpu {
  readonly uuid: string;
  readonly pciAddress: string;
  readonly kind: string;
  readonly device: GpuDevice;
}

/** A mediated device, offered as `mig_instances[]`, passed as `-device vfio-pci,sysfsdev=/sys/bus/mdev/devices/<mdevUuid>`. */
export interface ProbedMdev {
  readonly uuid: string;
  readonly mdevUuid: string;
  readonly instance: MigInstance;
}

export interface GpuInventory {
  readonly gpus: readonly ProbedGpu[];
  readonly mdevs: readonly ProbedMdev[];
  /** Devices seen and not offered, each with why. */
  readonly skipped: readonly { readonly id: string; readonly reason: string }[];
}

export const pciAddressRe = /^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$/;
const mdevUuidRe = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

/**
 * NVIDIA device ids → the kind placement matches (`gpu_kind`), for the data
 * centre parts a VFIO host carries. Names as in the PCI ID database
 * (pci.ids, vendor 10de). Any other device is its PCI ids ("10de:2204").
 */
const NVIDIA_KINDS: Readonly<Record<string, string>> = {
  '1db4': 'v100', // GV100GL [Tesla V100 PCIe 16GB]
  '1db6': 'v100', // GV100GL [Tesla V100 PCIe 32GB]
  '1eb8': 't4', // TU104GL [Tesla T4]
  '20b0': 'a100', // GA100 [A100 SXM4 40GB]
  '20b2': 'a100', // GA100 [A100 SXM4 80GB]
  '20b5': 'a100', // GA100 [A100 PCIe 80GB]
  '20f1': 'a100', // GA100 [A100 PCIe 40GB]
  '2236': 'a10', // GA102GL [A10]
  '2330': 'h100', // GH100 [H100 SXM5 80GB]
  '2331': 'h100', // GH100 [H100 PCIe]
  '26b9': 'l40s', // AD102GL [L40S]
  '27b8': 'l4', // AD104GL [L4]
};

export const NVIDIA_VENDOR = '10de';

/** The kind placement sees for a vendor:device pair. */
export function gpuKindOf(vendor: string, device: string): string {
  return (vendor === NVIDIA_VENDOR ? NVIDIA_KINDS[device] : undefined) ?? `${vendor}:${device}`;
}

/** A stable uuid for a whole device: the same address on the same host is the same device across agent restarts. */
export function deviceUuid(hostKey: string, pciAddress: string): string {
  const h = createHash('sha256').update(`fleet-gpu\0${hostKey}\0${pciAddress}`).digest();
  // RFC 4122 layout, version 8 (custom, name-derived).
  h[6] = ((h[6] ?? 0) & 0x0f) | 0x80;
  h[8] = ((h[8] ?? 0) & 0x3f) | 0x80;
  const x = h.subarray(0, 16).toString('hex');
  return `${x.slice(0, 8)}-${x.slice(8, 12)}-${x.slice(12, 16)}-${x.slice(16, 20)}-${x.slice(20, 32)}`;
}

/**
 * A MIG profile in mig-parted vocabulary from an NVIDIA vGPU type name: the
 * MIG-backed types are `<GPU>-<slices>-<GB>C` ("GRID A100-1-5C" → 1g.5gb).
 * Undefined for anything else (a time-sliced vGPU "A100-4C" is no MIG instance).
 */
export function migProfileOf(typeName: string): { profile: string; kind: string } | undefined {
  const m = /\b([A-Z]+\d+[A-Z]*)-(\d)-(\d+)C$/.exec(typeName.trim());
  if (!m?.[1] || !m[2] || !m[3]) return undefined;
  return { profile: `${m[2]}g.${m[3]}gb`, kind: m[1].toLowerCase().replace(/x$/, '') };
}

async function readId(path: string): Promise<string | undefined> {
  const v = await readFile(path, 'utf8').catch(() => undefined);
  const m = v === undefined ? null : /^0x([0-9a-f]+)\s*$/i.exec(v);
  return m?.[1]?.toLowerCase();
}

async function exists(path: string): Promise<boolean> {
  return stat(path).then(
    () => true,
    () => false,
  );
}

/** The name of the driver a sysfs device is bound to, or "" for none. */
async function driverOf(devDir: string): Promise<string> {
  return readlink(join(devDir, 'driver')).then(
    (l) => basename(l),
    () => '',
  );
}

/** Why a device's IOMMU group cannot be opened by QEMU, or "" when it can. */
async function groupProblem(o: GpuProbeOptions, devDir: string): Promise<{ group?: string; problem: string }> {
  const link = await readlink(join(devDir, 'iommu_group')).catch(() => undefined);
  if (link === undefined) return { problem: 'no IOMMU group (is the IOMMU on? intel_iommu=on / amd_iommu=on)' };
  const group = basename(link);
  if (!/^\d+$/.test(group)) return { problem: `IOMMU group "${group}" is not a number` };
  const groupDir = join(o.sysfsRoot, 'kernel', 'iommu_groups', group);
  if (!(await exists(groupDir))) return { group, problem: `IOMMU group ${group} is missing from ${dirname(groupDir)}` };
  if (!(await exists(join(o.devRoot, 'vfio', group)))) return { group, problem: `${join(o.devRoot, 'vfio', group)} is missing` };
  // VFIO opens a group only when every member is on vfio-pci, on no driver, or a PCIe port.
  for (const member of await readdir(join(groupDir, 'devices')).catch(() => [])) {
    const driver = await driverOf(join(groupDir, 'devices', member));
    if (driver !== '' && driver !== 'vfio-pci' && driver !== 'pcieport')
      return { group, problem: `IOMMU group ${group} also holds ${member}, bound to ${driver} (bind it to vfio-pci too)` };
  }
  return { group, problem: '' };
}

export async function probeGpus(o: GpuProbeOptions): Promise<GpuInventory> {
  const gpus: ProbedGpu[] = [];
  const mdevs: ProbedMdev[] = [];
  const skipped: { id: string; reason: string }[] = [];
  const pciDevices = join(o.sysfsRoot, 'bus', 'pci', 'devices');

  const bound = (await readdir(join(o.sysfsRoot, 'bus', 'pci', 'drivers', 'vfio-pci')).catch(() => [])).filter((e) => pciAddressRe.test(e));
  for (const addr of bound.sort()) {
    const dir = join(pciDevices, addr);
    const [vendor, device, cls] = await Promise.all([readId(join(dir, 'vendor')), readId(join(dir, 'device')), readId(join(dir, 'class'))]);
    if (!vendor || !device || !cls) {
      skipped.push({ id: addr, reason: 'no vendor, device or class under sysfs' });
      continue;
    }
    // Display controllers only (class 03xxxx): a NIC or an NVMe drive on vfio-pci is not a GPU.
    if (!cls.padStart(6, '0').startsWith('03')) {
      skipped.push({ id: addr, reason: `PCI class 0x${cls} is not a display controller` });
      continue;
    }
    const { group, problem } = await groupProblem(o, dir);
    if (problem) {
      skipped.push({ id: addr, reason: problem });
      continue;
    }
    const kind = gpuKindOf(vendor, device);
    // A host reports one gpu_kind: a device of another kind than the first offered would be placed as the wrong model.
    const first = gpus[0]?.kind;
    if (first !== undefined && kind !== first) {
      skipped.push({ id: addr, reason: `kind ${kind}: this host offers ${first} (one gpu_kind per host)` });
      continue;
    }
    const uuid = deviceUuid(o.hostKey, addr);
    gpus.push({
      uuid,
      pciAddress: addr,
      kind,
      device: { uuid, model: `${vendor}:${device}`, pci_bus_id: addr, mig_capable: false, ...(group ? { iommu_group: group } : {}) },
    });
  }

  const mdevDir = join(o.sysfsRoot, 'bus', 'mdev', 'devices');
  for (const id of (await readdir(mdevDir).catch(() => [])).sort()) {
    if (!mdevUuidRe.test(id)) {
      skipped.push({ id, reason: 'not an mdev uuid' });
      continue;
    }
    // Resolved physically (the links are relative to the device's real directory): the mdev sits under its parent, .../0000:3b:00.0/<uuid>.
    const real = await realpath(join(mdevDir, id)).catch(() => undefined);
    const typeDir = await realpath(join(mdevDir, id, 'mdev_type')).catch(() => undefined);
    if (real === undefined || typeDir === undefined) {
      skipped.push({ id, reason: 'no parent device or mdev_type link' });
      continue;
    }
    const parent = basename(dirname(real));
    const typeName = (await readFile(join(typeDir, 'name'), 'utf8').catch(() => basename(typeDir))).trim();
    const { problem } = await groupProblem(o, join(mdevDir, id));
    if (problem) {
      skipped.push({ id, reason: problem });
      continue;
    }
    const mig = migProfileOf(typeName);
    if (!mig) {
      skipped.push({ id, reason: `mdev type "${typeName}" is not a MIG-backed instance (<GPU>-<slices>-<GB>C)` });
      continue;
    }
    mdevs.push({
      uuid: id,
      mdevUuid: id,
      instance: {
        uuid: id,
        profile: mig.profile,
        kind: mig.kind,
        ...(pciAddressRe.test(parent) ? { parent_gpu_uuid: deviceUuid(o.hostKey, parent) } : {}),
      },
    });
  }
  return { gpus, mdevs, skipped };
}

/** The capacity fields for what was probed (the protocol's existing ones). */
export function gpuCapacity(inv: GpuInventory): Pick<HostCapacity, 'gpus' | 'gpu_kind' | 'gpu_devices' | 'mig_instances' | 'mig_profiles'> {
  const fields: Pick<HostCapacity, 'gpus' | 'gpu_kind' | 'gpu_devices' | 'mig_instances' | 'mig_profiles'> = {};
  const [first] = inv.gpus;
  if (first) {
    fields.gpus = inv.gpus.length;
    fields.gpu_kind = first.kind;
    fields.gpu_devices = inv.gpus.map((g) => g.device);
  }
  if (inv.mdevs.length > 0) {
    fields.mig_instances = inv.mdevs.map((m) => m.instance);
    const profiles: Record<string, number> = {};
    for (const m of inv.mdevs) profiles[m.instance.profile] = (profiles[m.instance.profile] ?? 0) + 1;
    fields.mig_profiles = profiles;
  }
  return fields;
}

/** What a VM is bound to, in its state.json: the control plane's uuids and what QEMU is given for them. */
export interface GpuBinding {
  readonly uuids: string[];
  readonly pci_addresses: string[];
  readonly mdev_uuids: string[];
}

/**
 * The create's bound uuids mapped back through the probe. Every uuid must
 * be one this host offers now (GPU_NOT_ON_HOST) and held by no other VM of
 * this agent (GPU_IN_USE): the control plane's reservation is its own
 * bookkeeping, this host's devices are the truth. Which sandbox holds a
 * device goes to `log` only: the answer reaches a caller who may be
 * another tenant.
 */
export function bindGpus(
  inv: GpuInventory,
  want: { readonly gpuUuids?: readonly string[] | undefined; readonly migInstanceUuids?: readonly string[] | undefined },
  others: readonly { readonly name: string; readonly gpu?: GpuBinding | undefined }[],
  log?: Pick<Logger, 'warn'>,
): GpuBinding | undefined {
  const gpuUuids = want.gpuUuids ?? [];
  const migUuids = want.migInstanceUuids ?? [];
  if (gpuUuids.length === 0 && migUuids.length === 0) return undefined;
  const all = [...gpuUuids, ...migUuids];
  const twice = all.find((u, i) => all.indexOf(u) !== i);
  if (twice !== undefined) throw invalidSpec(`device "${twice}" is bound twice`, [{ path: 'gpu_uuids', message: 'duplicate uuid' }]);
  const pci: string[] = [];
  const mdev: string[] = [];
  for (const u of gpuUuids) {
    const g = inv.gpus.find((x) => x.uuid === u);
    if (!g) throw notOnHost(u, 'GPU', inv.gpus.length);
    pci.push(g.pciAddress);
  }
  for (const u of migUuids) {
    const m = inv.mdevs.find((x) => x.uuid === u);
    if (!m) throw notOnHost(u, 'MIG instance', inv.mdevs.length);
    mdev.push(m.mdevUuid);
  }
  for (const o of others) {
    const held = all.find((u) => o.gpu?.uuids.includes(u));
    const heldAddr = pci.find((a) => o.gpu?.pci_addresses.includes(a)) ?? mdev.find((m) => o.gpu?.mdev_uuids.includes(m));
    if (held !== undefined || heldAddr !== undefined) {
      log?.warn({ uuid: held ?? heldAddr, holder: o.name }, 'a create asked for a device another sandbox holds');
      throw new AppError(BackendErrorCode.GpuInUse, 409, `device "${held ?? heldAddr ?? ''}" is bound to another sandbox on this host`, {
        uuid: held ?? heldAddr,
      });
    }
  }
  return { uuids: all, pci_addresses: pci, mdev_uuids: mdev };
}

function notOnHost(uuid: string, what: string, offered: number): AppError {
  return new AppError(
    BackendErrorCode.GpuNotOnHost,
    409,
    `${what} "${uuid}" is not offered by this host (${offered} offered now): it was never probed here, or is no longer usable`,
    { uuid },
  );
}

/** The probe as the qemu backend runs it: its roots (AGENT_SYSFS_ROOT, AGENT_DEV_ROOT) and this machine's name as the host key. */
export function probeHostGpus(opts: {
  readonly sysfsRoot?: string | undefined;
  readonly devRoot?: string | undefined;
}): Promise<GpuInventory> {
  return probeGpus({ sysfsRoot: opts.sysfsRoot ?? '/sys', devRoot: opts.devRoot ?? '/dev', hostKey: hostname() });
}
