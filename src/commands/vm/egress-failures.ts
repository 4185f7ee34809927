import { AppError, EGRESS_PROVISION_FAILED, type EgressSpec } from '@fleet/agent-protocol';
import type { VmCommand } from '../../domain/vm/vm.decider.js';

/** The agent's egress provision failure, as itself or inside a HostAgentError (a 5xx answer keeps the agent's code in details). */
export function isEgressProvisionFailure(err: unknown): err is AppError {
  return err instanceof AppError && (err.code === EGRESS_PROVISION_FAILED || err.details?.agent_code === EGRESS_PROVISION_FAILED);
}

/** The command recording an egress provision failure of a proxy-mode VM (VmEgressFailed), or undefined for any other error. */
export function egressProvisionFailure(vmId: string, egress: EgressSpec | undefined, err: unknown): VmCommand | undefined {
  if (egress?.mode !== 'proxy' || !isEgressProvisionFailure(err)) return undefined;
  return { type: 'RecordEgressFailure', data: { vm_id: vmId, provider: egress.provider ?? '', op: 'provision', error: err.message } };
}
