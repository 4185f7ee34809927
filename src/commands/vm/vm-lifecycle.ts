import { AppError, NotFoundError } from '@fleet/agent-protocol';
import type { Logger } from 'pino';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import { isTerminal, type ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { VmMetadata } from '../../domain/vm/vm.lifecycle.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Actor, VmCommands, VmResult } from './vm-commands.js';

export type WaitTarget = 'running' | 'destroyed';

export interface DrainResult {
  readonly host_id: string;
  /** Running VMs destroyed with reason `evicted` (already ended ones included on a retry). */
  readonly evicted: string[];
  /** VMs still being created or destroyed on the host: call drain again once they settle. */
  readonly pending: string[];
  readonly failed: Array<{ vm_id: string; code: string; message: string }>;
}

/**
 * What a VM's lifecycle offers beyond create and destroy: its timeout and
 * metadata changed (PATCH), a wait for a state, and the operator's drain of a
 * host, which ends its VMs with reason `evicted`.
 */
export class VmLifecycle {
  private readonly vmHandler: BoundOf<typeof vmAggregate>;

  constructor(
    handler: CommandHandler,
    private readonly vms: VmCommands,
    private readonly hosts: HostCommands,
    private readonly logger: Logger,
  ) {
    this.vmHandler = bindAggregate(handler, vmAggregate);
  }

  /** Sets the timeout from now (running VMs only) and/or replaces the metadata, as one append. */
  async update(
    vmId: string,
    input: { timeout_s?: number | undefined; metadata?: VmMetadata | undefined },
    actor: Actor,
  ): Promise<VmResult> {
    await this.vms.get(vmId, actor);
    const r = await this.vmHandler.handle(vmId, { type: 'UpdateVm', data: { vm_id: vmId, ...input } }, actor);
    if (r.state.status === 'initial') throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`, { vm_id: vmId });
    return { vm: r.state, position: r.position };
  }

  /**
   * Resolves with the VM once it is `running` (target running) or has ended
   * (target destroyed: destroyed or failed). A VM that ended before it ran
   * never will: VM_STATE_UNREACHABLE. Past `timeoutMs`: WAIT_TIMEOUT.
   * Polls its stream (the source of truth), backing off to 500 ms.
   */
  async wait(vmId: string, target: WaitTarget, timeoutMs: number, actor: Actor, signal?: AbortSignal): Promise<ExistingVmState> {
    const deadline = Date.now() + timeoutMs;
    let delay = 50;
    for (;;) {
      const vm = await this.vms.get(vmId, actor);
      if (target === 'running' && vm.status === 'running') return vm;
      if (target === 'destroyed' && isTerminal(vm.status)) return vm;
      if (target === 'running' && (vm.status === 'destroying' || isTerminal(vm.status)))
        throw new AppError('VM_STATE_UNREACHABLE', 409, `vm ${vmId} is ${vm.status}: it will not be running`, {
          vm_id: vmId,
          status: vm.status,
        });
      const left = deadline - Date.now();
      if (left <= 0 || signal?.aborted)
        throw new AppError('WAIT_TIMEOUT', 408, `vm ${vmId} is still ${vm.status} after ${timeoutMs} ms (waited for ${target})`, {
          vm_id: vmId,
          status: vm.status,
        });
      await new Promise((resolve) => setTimeout(resolve, Math.min(delay, left)));
      delay = Math.min(delay * 2, 500);
    }
  }

  /**
   * Cordons the host, then destroys every VM running on it with reason
   * `evicted`. VMs still booting (or being destroyed) are reported as
   * pending, not touched: a destroy racing a boot would end the VM as a boot
   * error. Safe to retry: ended VMs are skipped, destroy is idempotent.
   */
  async drain(hostId: string, meta: CommandMeta): Promise<DrainResult> {
    const { state: host } = await this.hosts.load(hostId);
    if (host.status === 'unregistered' || host.status === 'deregistered')
      throw new NotFoundError('HOST_NOT_FOUND', `host ${hostId} is not registered`, { host_id: hostId });
    if (!host.cordoned) await this.hosts.cordon(hostId, 'drained by the operator', meta);
    const actor: Actor = { ...meta, tenantId: 'admin', admin: true };
    const out: DrainResult = { host_id: hostId, evicted: [], pending: [], failed: [] };
    const ids = [...host.reservations.keys()];
    const work = async (vmId: string): Promise<void> => {
      const { state: vm } = await this.vmHandler.load(vmId);
      if (vm.status === 'initial' || vm.host_id !== hostId) return;
      if (vm.status === 'destroyed' || vm.status === 'failed') {
        if (vm.reason === 'evicted') out.evicted.push(vmId);
        return;
      }
      if (vm.status !== 'running') return void out.pending.push(vmId);
      try {
        await this.vms.destroy(vmId, actor, 'evicted');
        out.evicted.push(vmId);
      } catch (err) {
        const e = err instanceof AppError ? err : undefined;
        this.logger.warn({ vm_id: vmId, host_id: hostId, err: { message: (err as Error).message } }, 'drain: evict failed');
        out.failed.push({ vm_id: vmId, code: e?.code ?? 'INTERNAL', message: e?.message ?? 'internal error' });
      }
    };
    // A few at a time: each destroy runs the VM's drain command on the host.
    for (let i = 0; i < ids.length; i += 4) await Promise.all(ids.slice(i, i + 4).map(work));
    for (const list of [out.evicted, out.pending]) list.sort();
    return out;
  }
}
