import { ConflictError } from '@fleet/agent-protocol';
import type { HostState } from '../../domain/host/host.decider.js';

/**
 * Whether a VM's memory state can leave its host: not while it holds GPUs
 * or MIG instances (QEMU cannot save a VFIO device's state; the agent
 * refuses such a pause or live checkpoint with the same code).
 */
export function holdsGpus(host: HostState, vmId: string, specGpus = 0): boolean {
  if (specGpus > 0) return true;
  if (host.status === 'unregistered') return false;
  const r = host.reservations.get(vmId);
  return (r?.gpu_uuids.length ?? 0) > 0 || (r?.mig_instance_uuids.length ?? 0) > 0;
}

export const gpuMemoryStateUnsupported = (vmId: string, what: string): ConflictError =>
  new ConflictError(
    'GPU_MEMORY_STATE_UNSUPPORTED',
    `vm ${vmId} holds GPUs, whose device state cannot be captured or streamed: ${what} is not possible; it is still running (a cold migration, live: false, moves its disk)`,
    { vm_id: vmId },
  );
