import { ConflictError, NotFoundError } from '@fleet/agent-protocol';

export class VmNotFoundError extends NotFoundError {
  constructor(vmId: string) {
    super('VM_NOT_FOUND', `vm ${vmId} does not exist`, { vm_id: vmId });
  }
}

export class VmInvalidStateError extends ConflictError {
  constructor(vmId: string, status: string, action: string, hint?: string) {
    super('VM_INVALID_STATE', `vm ${vmId} is ${status}: cannot ${action}${hint ? `; ${hint}` : ''}`, { vm_id: vmId, status, action });
  }
}

export class VmAlreadyExistsError extends ConflictError {
  constructor(vmId: string) {
    super('VM_ALREADY_EXISTS', `vm ${vmId} already exists: choose another id, or retry with the same Idempotency-Key`, { vm_id: vmId });
  }
}
