import { z } from 'zod';
import type { GpuDevice, HostCapacity, MigInstance } from '@fleet/agent-protocol';

/**
 * What is taken on a host, derived from its per-VM reservations (never stored
 * as a thing of its own: the durable truth is each VM's binding, as the seed
 * requires for GPUDeviceUUIDs/MIGInstanceUUIDs). Shared by the host decider
 * and the placement view so both judge "fits" the same way.
 */
export const hostAllocationSchema = z.object({
  cpus: z.number().int().nonnegative(),
  ram_mb: z.number().int().nonnegative(),
  storage_gb: z.number().int().nonnegative(),
  vm_count: z.number().int().nonnegative(),
  /** Whole GPUs taken, bound by uuid or counted. */
  gpus: z.number().int().nonnegative(),
  /** MIG instances taken by profile, bound by uuid or counted. */
  mig_profiles: z.record(z.string(), z.number().int().nonnegative()),
  /** Device uuids bound to VMs (hosts with gpu_devices inventory only). */
  gpu_device_uuids: z.array(z.string()),
  /** MIG instance uuids bound to VMs (hosts with mig_instances inventory only). */
  mig_instance_uuids: z.array(z.string()),
});
export type HostAllocation = z.infer<typeof hostAllocationSchema>;

export function emptyAllocation(): HostAllocation {
  return { cpus: 0, ram_mb: 0, storage_gb: 0, vm_count: 0, gpus: 0, mig_profiles: {}, gpu_device_uuids: [], mig_instance_uuids: [] };
}

/** What one VM asks of a host. `gpu_profile` set means `gpus` counts MIG instances of that profile, else whole devices. */
export interface ResourceRequest {
  readonly cpus: number;
  readonly ram_mb: number;
  readonly storage_gb: number;
  readonly gpus?: number | undefined;
  readonly gpu_kind?: string | undefined;
  readonly gpu_profile?: string | undefined;
}

/** Empty `want` matches any kind; otherwise case-insensitive equality (kinds are operator-declared, e.g. "a100"). */
export function kindMatches(have: string | undefined, want: string | undefined): boolean {
  if (!want) return true;
  return !!have && have.toLowerCase() === want.toLowerCase();
}

/** A card in MIG mode exports mdev instances and is never part of the whole-device pool (seed: the counters are independent). */
function isMigMode(d: GpuDevice): boolean {
  return !!d.mig_mode && d.mig_mode.toLowerCase() === 'enabled';
}

export function hasGpuInventory(cap: HostCapacity): cap is HostCapacity & { gpu_devices: GpuDevice[] } {
  return !!cap.gpu_devices && cap.gpu_devices.length > 0;
}

export function hasMigInventory(cap: HostCapacity): cap is HostCapacity & { mig_instances: MigInstance[] } {
  return !!cap.mig_instances && cap.mig_instances.length > 0;
}

/** The whole-device pool of a host that reports inventory. */
export function wholeGpuDevices(cap: HostCapacity): GpuDevice[] {
  return (cap.gpu_devices ?? []).filter((d) => !isMigMode(d));
}

/** Free whole GPUs of `kind` (any kind when empty). */
export function freeGpuCount(cap: HostCapacity, alloc: HostAllocation, kind: string | undefined): number {
  if (!kindMatches(cap.gpu_kind, kind)) return 0;
  if (hasGpuInventory(cap)) {
    let free = 0;
    for (const d of cap.gpu_devices) if (!isMigMode(d) && !alloc.gpu_device_uuids.includes(d.uuid)) free++;
    return free;
  }
  return Math.max(0, (cap.gpus ?? 0) - alloc.gpus);
}

/** The first `count` free device uuids in inventory order, or undefined when too few are free or the host has no inventory. */
export function pickGpuDevices(cap: HostCapacity, alloc: HostAllocation, kind: string | undefined, count: number): string[] | undefined {
  if (!hasGpuInventory(cap) || !kindMatches(cap.gpu_kind, kind)) return undefined;
  const out: string[] = [];
  for (const d of cap.gpu_devices) {
    if (out.length === count) break;
    if (!isMigMode(d) && !alloc.gpu_device_uuids.includes(d.uuid)) out.push(d.uuid);
  }
  return out.length === count ? out : undefined;
}

/** Free MIG instances of `profile` on a kind-matching parent (instance kind, else the host's gpu_kind). */
export function freeMigCount(cap: HostCapacity, alloc: HostAllocation, profile: string, kind: string | undefined): number {
  if (hasMigInventory(cap)) {
    let free = 0;
    for (const m of cap.mig_instances) {
      if (m.profile === profile && kindMatches(m.kind ?? cap.gpu_kind, kind) && !alloc.mig_instance_uuids.includes(m.uuid)) free++;
    }
    return free;
  }
  if (!kindMatches(cap.gpu_kind, kind)) return 0;
  return Math.max(0, (cap.mig_profiles?.[profile] ?? 0) - (alloc.mig_profiles[profile] ?? 0));
}

export function pickMigInstances(
  cap: HostCapacity,
  alloc: HostAllocation,
  profile: string,
  kind: string | undefined,
  count: number,
): string[] | undefined {
  if (!hasMigInventory(cap)) return undefined;
  const out: string[] = [];
  for (const m of cap.mig_instances) {
    if (out.length === count) break;
    if (m.profile === profile && kindMatches(m.kind ?? cap.gpu_kind, kind) && !alloc.mig_instance_uuids.includes(m.uuid)) out.push(m.uuid);
  }
  return out.length === count ? out : undefined;
}

/** vCPUs a host may hand out: its CPUs times its overcommit ratio (the epsilon keeps 3 × 1.1 at 3, not 3.3000000000000003 → 3). */
export function schedulableCpus(cap: HostCapacity, cpuOvercommitRatio = 1): number {
  return Math.floor(cap.cpus * cpuOvercommitRatio + 1e-9);
}

export type ShortResource = 'cpus' | 'ram_mb' | 'storage_gb' | 'vm_count' | 'gpus' | 'mig_instances';

export interface Shortfall {
  readonly resource: ShortResource;
  readonly need: number;
  readonly free: number;
  /** CPUs on an overcommitted host: need and free are vCPUs, out of cores × ratio. */
  readonly overcommit?: CpuOvercommit | undefined;
}

export interface CpuOvercommit {
  readonly ratio: number;
  readonly cores: number;
  readonly schedulable: number;
}

/** Every resource the request does not fit, in gate order; empty when it fits. */
export function shortfalls(cap: HostCapacity, alloc: HostAllocation, req: ResourceRequest, cpuOvercommitRatio = 1): Shortfall[] {
  const out: Shortfall[] = [];
  const check = (resource: ShortResource, need: number, free: number): void => {
    if (need > free) out.push({ resource, need, free: Math.max(0, free) });
  };
  const cpus = schedulableCpus(cap, cpuOvercommitRatio);
  if (req.cpus > cpus - alloc.cpus) {
    out.push({
      resource: 'cpus',
      need: req.cpus,
      free: Math.max(0, cpus - alloc.cpus),
      ...(cpuOvercommitRatio !== 1 ? { overcommit: { ratio: cpuOvercommitRatio, cores: cap.cpus, schedulable: cpus } } : {}),
    });
  }
  check('ram_mb', req.ram_mb, cap.ram_mb - alloc.ram_mb);
  check('storage_gb', req.storage_gb, cap.storage_gb - alloc.storage_gb);
  check('vm_count', 1, cap.vm_count - alloc.vm_count);
  const gpus = req.gpus ?? 0;
  if (gpus > 0) {
    if (req.gpu_profile) check('mig_instances', gpus, freeMigCount(cap, alloc, req.gpu_profile, req.gpu_kind));
    else check('gpus', gpus, freeGpuCount(cap, alloc, req.gpu_kind));
  }
  return out;
}

/** "short of RAM (need 4096 MB, free 2048 MB)": the words shared by host and placement errors. */
export function describeShortfall(s: Shortfall, req: ResourceRequest, freeWord = 'free'): string {
  switch (s.resource) {
    case 'cpus':
      if (s.overcommit) {
        const o = s.overcommit;
        return `short of CPUs (need ${s.need} vCPUs, ${freeWord} ${s.free} of ${o.schedulable}: ${o.cores} cores × ${o.ratio} overcommit)`;
      }
      return `short of CPUs (need ${s.need}, ${freeWord} ${s.free})`;
    case 'ram_mb':
      return `short of RAM (need ${s.need} MB, ${freeWord} ${s.free})`;
    case 'storage_gb':
      return `short of storage (need ${s.need} GB, ${freeWord} ${s.free})`;
    case 'vm_count':
      return `with no VM slot free (limit reached)`;
    case 'gpus':
      return `short of ${req.gpu_kind ? `${req.gpu_kind} ` : ''}GPUs (need ${s.need}, ${freeWord} ${s.free})`;
    case 'mig_instances':
      return `short of MIG ${req.gpu_profile ?? ''}${req.gpu_kind ? ` (${req.gpu_kind})` : ''} instances (need ${s.need}, ${freeWord} ${s.free})`;
  }
}
