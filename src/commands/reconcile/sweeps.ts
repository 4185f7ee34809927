import type { Logger } from 'pino';
import { isAbandonedRequest, isStaleReservation } from '../../domain/reconcile/reconcile.js';
import { isTerminal } from '../../domain/vm/vm.decider.js';
import type { HostCommands } from '../host/host-commands.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import type { ReconcileStore } from './reconcile-store.js';
import { errInfo, type LiveVmHint, type ReconcilerConfig, type ReconcileSummary } from './reconcile-types.js';

/** Repairs that need no agent: abandoned requests, VMs of deregistered hosts, reservations nothing holds. */
export class Sweeps {
  constructor(
    private readonly store: ReconcileStore,
    private readonly hosts: HostCommands,
    private readonly vms: VmCommands,
    private readonly config: ReconcilerConfig,
    private readonly logger: Logger,
    private readonly clock: () => Date,
  ) {}

  /** VMs still `requested` past the grace: the control plane died before (or while) reserving. */
  async abandonedRequests(live: readonly LiveVmHint[], s: ReconcileSummary, actor: Actor): Promise<void> {
    const now = this.clock().getTime();
    for (const hint of live) {
      if (hint.state !== 'requested' || now - hint.state_changed_at.getTime() < this.config.halfDoneGraceMs) continue;
      try {
        const vm = await this.store.loadVm(hint.id);
        if (!isAbandonedRequest(vm, now, this.config)) continue;
        await this.store.runVm(
          hint.id,
          {
            type: 'FailVm',
            data: {
              vm_id: hint.id,
              reason: 'orphaned',
              error: 'the control plane stopped before this VM was placed; the reconciler rolled the request back',
              error_code: 'INTERRUPTED',
            },
          },
          actor,
        );
        s.half_done_rolled_back++;
        // A reservation may have landed before the crash: the per-host sweep releases it (the VM is now terminal).
      } catch (err) {
        s.errors++;
        this.logger.warn({ vm_id: hint.id, err: errInfo(err) }, 'could not roll back an abandoned request');
      }
    }
  }

  /** A host deregistered (forced) while VMs were on it: they cannot come back; end them so they stop counting as live. */
  async vmsOfDeregisteredHosts(
    live: readonly LiveVmHint[],
    hostIds: ReadonlySet<string>,
    s: ReconcileSummary,
    actor: Actor,
  ): Promise<void> {
    const checked = new Map<string, boolean>();
    for (const hint of live) {
      if (!hint.host_id || hostIds.has(hint.host_id)) continue;
      try {
        let gone = checked.get(hint.host_id);
        if (gone === undefined) {
          const { state } = await this.hosts.load(hint.host_id);
          gone = state.status === 'deregistered';
          checked.set(hint.host_id, gone);
        }
        if (!gone) continue;
        const vm = await this.store.loadVm(hint.id);
        if (vm.status === 'initial' || isTerminal(vm.status) || vm.host_id !== hint.host_id) continue;
        await this.store.runVm(
          hint.id,
          {
            type: 'FailVm',
            data: { vm_id: hint.id, reason: 'host_lost', error: `host ${hint.host_id} was deregistered`, error_code: 'HOST_DEREGISTERED' },
          },
          actor,
        );
        s.vms_host_lost++;
      } catch (err) {
        s.errors++;
        this.logger.warn({ vm_id: hint.id, err: errInfo(err) }, 'could not end a vm of a deregistered host');
      }
    }
  }

  /** Releases every reservation on this host whose VM is gone, ended, or placed elsewhere — once no sandbox of it is listed. */
  async releaseStaleReservations(
    hostId: string,
    listed: ReadonlySet<string>,
    gone: ReadonlySet<string>,
    s: ReconcileSummary,
    actor: Actor,
  ): Promise<void> {
    const { state: host } = await this.hosts.load(hostId);
    if (host.status === 'unregistered' || host.status === 'deregistered') return;
    for (const vmId of host.reservations.keys()) {
      const name = sandboxName(vmId);
      if (listed.has(name) && !gone.has(name)) continue;
      const vm = await this.store.loadVm(vmId);
      const liveElsewhere = vm.status !== 'initial' && !isTerminal(vm.status) && vm.host_id !== hostId;
      if (
        !isStaleReservation(
          vm,
          liveElsewhere ? await this.store.loadMigration(vmId) : undefined,
          hostId,
          this.clock().getTime(),
          this.config,
        )
      )
        continue;
      try {
        await this.vms.releaseCapacity(hostId, vmId, actor);
        s.capacity_released++;
        this.logger.info(
          { vm_id: vmId, host_id: hostId, vm_status: vm.status },
          'released the reservation of a vm that no longer holds a sandbox',
        );
      } catch (err) {
        s.errors++;
        this.logger.warn({ vm_id: vmId, host_id: hostId, err: errInfo(err) }, 'could not release a stale reservation');
      }
    }
  }
}
