import type { VmState, ExistingVmState, VmCommand } from '../../domain/vm/vm.decider.js';
import type { MigrationInFlight } from '../../domain/reconcile/reconcile.js';
import { hostAggregate } from '../../domain/host/host.aggregate.js';
import type { HostCommand } from '../../domain/host/host.decider.js';
import { migrationAggregate } from '../../domain/migration/migration.decider.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta } from '../command-handler.js';

/** Follows a lazy migration's page-in after its switch (LazyMigrate.adopt): true while a watch of this process does. */
export interface LazyWatcher {
  adopt(vmId: string): Promise<boolean>;
}

/** The streams the reconciler reads and appends to: VM, migration and host, each through its bound handler. */
export class ReconcileStore {
  /** Wired after construction (service.ts); without it a lazy move's source is kept for the grace only. */
  lazyWatcher: LazyWatcher | undefined;

  readonly vmHandler: BoundOf<typeof vmAggregate>;
  private readonly hostHandler: BoundOf<typeof hostAggregate>;
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;

  constructor(handler: CommandHandler) {
    this.hostHandler = bindAggregate(handler, hostAggregate);
    this.migrationHandler = bindAggregate(handler, migrationAggregate);
    this.vmHandler = bindAggregate(handler, vmAggregate);
  }

  /** Through the VM decider, so it shares the command handler's state cache with VmCommands. */
  async loadVm(vmId: string): Promise<VmState> {
    return (await this.vmHandler.load(vmId)).state;
  }

  /**
   * A migration of the VM in flight before its switch (its steps are on the VM stream, ignored by the VM decider), or a
   * lazy one after it, whose source still serves the VM's memory pages: that one is handed to the lazy watcher, so a
   * control plane restarted mid page-in picks the watch up again (the watch, not the grace, then ends the source).
   */
  async loadMigration(vmId: string): Promise<MigrationInFlight | undefined> {
    const { state: m } = await this.migrationHandler.load(vmId);
    if (m.status !== 'in_progress') return undefined;
    if (!m.switched) return { target: m.target_host_id, lastStepAt: Date.parse(m.last_at) };
    if (!m.lazy) return undefined;
    const watched = (await this.lazyWatcher?.adopt(vmId)) ?? false;
    return { target: m.target_host_id, pinnedSource: m.from_host_id, lastStepAt: Date.parse(m.last_at), watched };
  }

  async runVm(vmId: string, command: VmCommand, meta: CommandMeta): Promise<ExistingVmState | undefined> {
    const r = await this.vmHandler.handle(vmId, command, meta);
    return r.state.status === 'initial' ? undefined : r.state;
  }

  async runHost(hostId: string, command: HostCommand, meta: CommandMeta): Promise<void> {
    await this.hostHandler.handle(hostId, command, meta);
  }
}
