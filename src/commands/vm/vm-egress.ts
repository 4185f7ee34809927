import { egressSpecProblems, egressSpecSchema, ValidationError, type EgressStatus } from '@fleet/agent-protocol';
import { assertEgressProvisionable } from '../../domain/egress/egress-registry.js';
import { validationErrorFromZod } from '../../domain/vm/spec.js';
import type { HostCommands } from '../host/host-commands.js';
import { agentEgressOf, sandboxName } from './boot-sandbox.js';
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
   * Replaces a running VM's outbound policy: validated like a create's, the
   * host applies it, then VmEgressChanged records it (a retry re-applies the
   * same policy, which the agent takes idempotently).
   */
  async changeEgress(vmId: string, input: unknown, actor: Actor): Promise<VmResult> {
    const parsed = egressSpecSchema.safeParse(input);
    if (!parsed.success) throw validationErrorFromZod(parsed.error, 'egress policy');
    const problems = egressSpecProblems(parsed.data);
    if (problems.length > 0)
      throw new ValidationError(
        `invalid egress policy: ${problems.map((p) => `${p.path}: ${p.message}`).join('; ')}`,
        problems.map((p) => ({ path: p.path, message: p.message })),
        problems.find((p) => p.code !== 'VALIDATION_FAILED')?.code ?? 'VALIDATION_FAILED',
      );
    assertEgressProvisionable(parsed.data, this.config.egressRegistry);
    const { agent } = await this.access.running(vmId, actor);
    await agent.setEgress(sandboxName(vmId), agentEgressOf(parsed.data));
    return this.stream.run(vmId, { type: 'ChangeEgress', data: { vm_id: vmId, egress: parsed.data } }, actor);
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
