import { AppError, NotFoundError } from '@fleet/agent-protocol';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { ExistingVmState, VmCommand } from '../../domain/vm/vm.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta, type HandleOptions } from '../command-handler.js';
import type { Actor, VmResult } from './vm-types.js';

/** The VM stream (`vm-<id>`) through its bound handler, and the caller's view of it. */
export class VmStream {
  readonly vmHandler: BoundOf<typeof vmAggregate>;

  constructor(handler: CommandHandler) {
    this.vmHandler = bindAggregate(handler, vmAggregate);
  }

  /** The VM as its stream says, for this caller: another tenant's VM does not exist (404, not 403). */
  async get(vmId: string, actor: Pick<Actor, 'tenantId' | 'admin'>): Promise<ExistingVmState> {
    if (!/^[a-z0-9-]{1,64}$/.test(vmId)) throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`);
    const { state } = await this.vmHandler.load(vmId);
    if (state.status === 'initial' || (!actor.admin && state.tenant_id !== actor.tenantId))
      throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`, { vm_id: vmId });
    return state;
  }

  /** A list of commands is decided in order and appended together (one durable append). */
  async run(vmId: string, command: VmCommand | readonly VmCommand[], meta: CommandMeta, options?: HandleOptions): Promise<VmResult> {
    const r = await this.vmHandler.handle(vmId, command, meta, options);
    if (r.state.status === 'initial')
      throw new AppError(
        'INTERNAL',
        500,
        `vm ${vmId} has no state after ${[command]
          .flat()
          .map((c) => c.type)
          .join(', ')}`,
      );
    return { vm: r.state, position: r.position };
  }
}
