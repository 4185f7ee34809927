import type { HostCapacity } from '@fleet/agent-protocol';
import { ValidationError, type FieldError } from '@fleet/agent-protocol';
import { wholeGpuDevices } from '../placement/fit.js';
import type { CapacityOverrides, HostBackend } from './host.events.js';

/**
 * The capacity a host is scheduled against: the probe, with operator
 * overrides on top. Where the agent reports inventory, the counters are a
 * summary of it (the seed: MIGProfiles is derived when MIGInstances is
 * reported), so an override of a counter that inventory defines is refused
 * rather than silently ignored.
 */
export function applyCapacityOverrides(probed: HostCapacity, overrides: CapacityOverrides): HostCapacity {
  const problems: FieldError[] = [];
  const cap: HostCapacity = { ...probed };
  if (overrides.cpus !== undefined) cap.cpus = overrides.cpus;
  if (overrides.ram_mb !== undefined) cap.ram_mb = overrides.ram_mb;
  if (overrides.storage_gb !== undefined) cap.storage_gb = overrides.storage_gb;
  if (overrides.vm_count !== undefined) cap.vm_count = overrides.vm_count;
  if (overrides.arch !== undefined) cap.arch = overrides.arch;
  if (overrides.gpu_kind !== undefined) cap.gpu_kind = overrides.gpu_kind;

  if (probed.gpu_devices && probed.gpu_devices.length > 0) {
    cap.gpus = wholeGpuDevices(probed).length;
    if (overrides.gpus !== undefined && overrides.gpus !== cap.gpus) {
      problems.push({ path: 'overrides.gpus', message: `the agent reports ${cap.gpus} whole GPU devices by uuid; drop the gpus override` });
    }
  } else if (overrides.gpus !== undefined) {
    cap.gpus = overrides.gpus;
  }

  if (probed.mig_instances && probed.mig_instances.length > 0) {
    const byProfile: Record<string, number> = {};
    for (const m of probed.mig_instances) byProfile[m.profile] = (byProfile[m.profile] ?? 0) + 1;
    cap.mig_profiles = byProfile;
    if (overrides.mig_profiles !== undefined) {
      problems.push({
        path: 'overrides.mig_profiles',
        message: `the agent reports ${probed.mig_instances.length} MIG instances by uuid; drop the mig_profiles override`,
      });
    }
  } else if (overrides.mig_profiles !== undefined) {
    cap.mig_profiles = { ...overrides.mig_profiles };
  }

  if (problems.length > 0)
    throw new ValidationError(
      `capacity overrides conflict with the host's reported inventory: ${problems.map((p) => `${p.path}: ${p.message}`).join('; ')}`,
      problems,
    );
  return cap;
}

/** Only qemu passes devices through (decision D5), so only a qemu host may offer GPUs or MIG instances. */
export function assertGpuBackend(backend: HostBackend, cap: HostCapacity): void {
  const gpus = (cap.gpus ?? 0) > 0 || (cap.gpu_devices?.length ?? 0) > 0;
  const mig = Object.values(cap.mig_profiles ?? {}).some((n) => n > 0) || (cap.mig_instances?.length ?? 0) > 0;
  if (backend !== 'qemu' && (gpus || mig)) {
    throw new ValidationError(
      `a ${backend} host cannot offer ${gpus ? 'GPUs' : 'MIG instances'}: only qemu hosts pass devices through; register it with backend qemu or without GPU capacity`,
      [{ path: gpus ? 'capacity.gpus' : 'capacity.mig_profiles', message: 'only qemu hosts may have GPUs or MIG instances' }],
      'HOST_GPU_REQUIRES_QEMU',
    );
  }
}
