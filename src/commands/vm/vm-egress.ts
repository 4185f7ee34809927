import {
  AppError,
  EGRESS_PROVISION_FAILED,
  egressSpecProblems,
  ValidationError,
  type EgressSpec,
  type EgressStatus,
} from '@fleet/agent-protocol';
import { assertEgressProvisionable } from '../../domain/egress/egress-registry.js';
import type { HostCommands } from '../host/host-commands.js';
import { agentEgressOf, sandboxName } from './boot-sandbox.js';
import { egressProvisionFailure } from './egress-failures.js';
import type { VmAccess } from './vm-access.js';
import type { VmStream } from './vm-stream.js';
import type { Actor, VmCommandsConfig, VmResult } from './vm-types.js';

/** A VM's outbound policy: changed on a running VM, and read back with its host's probe. */
export class VmEgress {
  constructor(
    private readonly stream: VmStream,
    private readonly access: VmAccess,
    private readonly hosts: HostCommands,
    private readonly config: VmCommandsConfig,
  ) {}

  /**
   * Replaces a running VM's outbound policy (parsed at the edge; checked here like a create's): the
   * host applies it, then VmEgressChanged records it (a retry re-applies the
   * same policy, which the agent takes idempotently).
   */
  async changeEgress(vmId: string, egress: EgressSpec, actor: Actor): Promise<VmResult> {
    const problems = egressSpecProblems(egress);
    if (problems.length > 0)
      throw new ValidationError(
        `invalid egress policy: ${problems.map((p) => `${p.path}: ${p.message}`).join('; ')}`,
        problems.map((p) => ({ path: p.path, message: p.message })),
        problems.find((p) => p.code !== 'VALIDATION_FAILED')?.code ?? 'VALIDATION_FAILED',
      );
    assertEgressProvisionable(egress, this.config.egressRegistry);
    const { agent } = await this.access.running(vmId, actor);
    await agent.setEgress(sandboxName(vmId), agentEgressOf(egress)).catch(async (err: unknown) => {
      const egressFailed = egressProvisionFailure(vmId, egress, err);
      if (!egressFailed) throw err;
      await this.stream.run(vmId, egressFailed, actor).catch(() => undefined);
      // The same code a create ends with; the sandbox keeps the policy it had (the agent starts the proxy before it applies).
      throw new AppError(EGRESS_PROVISION_FAILED, 502, (err as Error).message, { vm_id: vmId, provider: egress.provider ?? null });
    });
    return this.stream.run(vmId, { type: 'ChangeEgress', data: { vm_id: vmId, egress } }, actor);
  }

  /**
   * The resolved policy: mode and provider from the VM's events; for a
   * running VM, the endpoint and its health as its host probes them now
   * (health `unknown` when the host does not answer). Never a fallback:
   * an unhealthy proxy is reported as such.
   */
  async egressStatus(vmId: string, actor: Actor): Promise<EgressStatus> {
    const vm = await this.stream.get(vmId, actor);
    const e = vm.spec.egress ?? { mode: 'direct' as const };
    const base: EgressStatus = { mode: e.mode, ...(e.provider !== undefined ? { provider: e.provider } : {}) };
    if (vm.status !== 'running' || !vm.host_id) return base;
    try {
      const agent = await this.hosts.agentFor(vm.host_id);
      const live = await agent.egressStatus(sandboxName(vmId), { timeoutMs: 5000 });
      return { ...live, ...base, ...(live.mode === e.mode ? {} : { health: 'unhealthy' as const }) };
    } catch {
      return { ...base, health: 'unknown' };
    }
  }
}
