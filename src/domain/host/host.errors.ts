import { ConflictError, NotFoundError } from '@fleet/agent-protocol';
import { describeShortfall, type ResourceRequest, type Shortfall } from '../placement/fit.js';

export class HostNotFoundError extends NotFoundError {
  constructor(hostId: string) {
    super('HOST_NOT_FOUND', `host ${hostId} is not registered`, { host_id: hostId });
  }
}

/** A reservation that does not fit: the command layer re-places elsewhere (this is "refuses for capacity", not "failed"). */
export class HostCapacityExhaustedError extends ConflictError {
  readonly shortfalls: readonly Shortfall[];
  constructor(hostId: string, vmId: string, shortfalls: readonly Shortfall[], req: ResourceRequest) {
    super(
      'HOST_CAPACITY_EXHAUSTED',
      `host ${hostId} cannot fit vm ${vmId}: ${shortfalls.map((s) => describeShortfall(s, req)).join(', ')}`,
      { host_id: hostId, vm_id: vmId, short: shortfalls.map((s) => ({ ...s })) },
    );
    this.shortfalls = shortfalls;
  }
}

export type HostUnschedulableReason = 'cordoned' | 'unreachable' | 'deregistered';

/** Codes: HOST_CORDONED, HOST_UNREACHABLE, HOST_DEREGISTERED (all 409). */
export class HostUnschedulableError extends ConflictError {
  readonly reason: HostUnschedulableReason;
  constructor(hostId: string, reason: HostUnschedulableReason, doing: string) {
    super(`HOST_${reason.toUpperCase()}`, `host ${hostId} is ${reason}: cannot ${doing}`, { host_id: hostId, reason });
    this.reason = reason;
  }
}

export class HostHasVmsError extends ConflictError {
  constructor(hostId: string, vmIds: readonly string[]) {
    const shown = vmIds.slice(0, 10).join(', ') + (vmIds.length > 10 ? `, … (${vmIds.length - 10} more)` : '');
    super('HOST_HAS_VMS', `host ${hostId} still holds ${vmIds.length} VM(s) (${shown}): destroy them first or deregister with force`, {
      host_id: hostId,
      vm_ids: vmIds.slice(0, 100),
      vm_count: vmIds.length,
    });
  }
}

export class HostAlreadyRegisteredError extends ConflictError {
  constructor(hostId: string, url: string) {
    super('HOST_ALREADY_REGISTERED', `host ${hostId} is already registered at ${url}: deregister it first to change its url or backend`, {
      host_id: hostId,
    });
  }
}

/** The caller named GPU/MIG uuids this host cannot bind (unknown, wrong kind, or already bound). */
export class GpuBindingUnavailableError extends ConflictError {
  constructor(hostId: string, message: string, uuids: readonly string[]) {
    super('GPU_BINDING_UNAVAILABLE', `host ${hostId}: ${message}`, { host_id: hostId, uuids: [...uuids] });
  }
}
