import { AppError } from '@fleet/agent-protocol';
import { bindAggregate, type BoundOf } from '../command-handler.js';
import { hostAggregate } from '../../domain/host/host.aggregate.js';
import type { HostState } from '../../domain/host/host.decider.js';
import type { Placement, PlacementHost, PlacementOptions, PlacementPolicy, PlacementRequest } from '../../domain/placement/placement.js';
import type { StoredVmSpec } from '../../domain/vm/spec.js';
import type { VmReservation } from '../../domain/vm/vm.events.js';
import type { CommandHandler, CommandMeta } from '../command-handler.js';
import type { PlacementView } from './placement-view.js';
import { KeyedQueue } from '../keyed-queue.js';

/** What a VM takes on its host. */
export type ReservedShape = Pick<StoredVmSpec, 'cpus' | 'ram_mb' | 'storage_gb' | 'gpus' | 'gpu_kind' | 'gpu_profile'>;

export interface PlaceHints {
  readonly artifactHosts?: ReadonlySet<string> | undefined;
  readonly excludeHosts?: ReadonlySet<string> | undefined;
  /** The view's hold for this decision; a migration holds beside the VM's own reservation on its source. */
  readonly holdKey?: string | undefined;
}

export interface Reserved {
  readonly hostId: string;
  readonly choice: Placement;
  /** As the host stream recorded it (with the GPUs it bound). */
  readonly reservation: VmReservation;
  /** The host as its stream stood once the reservation was appended (its agent's address and token): no read to reach it. */
  readonly host: Exclude<HostState, { status: 'unregistered' }>;
}

export interface PlacerConfig {
  readonly policy: PlacementPolicy;
  /** Bounded re-decisions when a reservation loses a race for a host. */
  readonly maxAttempts?: number | undefined;
}

/**
 * Place and reserve, for every flow that puts a VM on a host (create, fork,
 * migrate): decide on the view, reserve on the chosen host's stream, and
 * re-decide when the host refuses (bounded). The decision holds its share in
 * the view at once, so concurrent creates spread out; reservations on one
 * host are queued in this process, and each is checked by the host decider
 * against the stream's state at the revision it appends after (other
 * processes lose an optimistic-concurrency conflict and re-check). Expecting
 * the decision's own revision instead made every concurrent create after the
 * first fail its append: 500 creates on 20 hosts placed 35.
 */
export class Placer {
  private readonly hostQueues = new KeyedQueue();

  private readonly hostHandler: BoundOf<typeof hostAggregate>;

  constructor(
    private readonly handler: CommandHandler,
    private readonly view: PlacementView,
    private readonly config: PlacerConfig,
  ) {
    this.hostHandler = bindAggregate(handler, hostAggregate);
  }

  async placeAndReserve(
    vmId: string,
    request: PlacementRequest,
    shape: ReservedShape,
    meta: CommandMeta,
    hints: PlaceHints = {},
  ): Promise<Reserved> {
    const placeOpts: PlacementOptions = {
      policy: this.config.policy,
      hints: { artifactHosts: hints.artifactHosts },
      excludeHosts: hints.excludeHosts,
    };
    const holdKey = hints.holdKey ?? vmId;
    const attempts = this.config.maxAttempts ?? 32;
    let reloaded = false;
    for (let attempt = 1; ; attempt++) {
      await this.view.fresh();
      let choice: Placement;
      try {
        choice = this.view.placeAndHold(holdKey, request, placeOpts);
      } catch (err) {
        // A cached view may predate a host just registered or capacity released elsewhere: refuse only on a fresh one.
        if (reloaded || !(err instanceof AppError && err.code === 'CAPACITY_EXHAUSTED')) throw err;
        reloaded = true;
        this.view.invalidate();
        await this.view.fresh();
        // The directory is a read model, which may lag the host's stream (another process released capacity there just
        // now: a resume after a pause answered by another replica); a pinned host is read from its stream itself.
        if (request.pinned_host_id !== undefined) await this.view.refresh(request.pinned_host_id);
        choice = this.view.placeAndHold(holdKey, request, placeOpts);
      }
      const hostId = choice.decision.host_id;
      try {
        const reserved = await this.onHost(hostId, () =>
          this.hostHandler.handle(
            hostId,
            {
              type: 'ReserveCapacity',
              data: {
                host_id: hostId,
                vm_id: vmId,
                cpus: shape.cpus,
                ram_mb: shape.ram_mb,
                storage_gb: shape.storage_gb,
                gpus: shape.gpus,
                gpu_kind: shape.gpu_kind,
                gpu_profile: shape.gpu_profile,
                gpu_uuids: choice.gpu_uuids.length ? choice.gpu_uuids : undefined,
                mig_instance_uuids: choice.mig_instance_uuids.length ? choice.mig_instance_uuids : undefined,
              },
            },
            meta,
          ),
        );
        this.view.set(hostId, reserved.state, reserved.revision);
        this.view.release(holdKey);
        const r = reserved.events[0]?.type === 'CapacityReserved' ? reserved.events[0].data : undefined;
        const host = reserved.state.status !== 'unregistered' ? reserved.state : undefined;
        const held = r ?? host?.reservations.get(vmId);
        if (!held || !host) throw new AppError('INTERNAL', 500, `reservation for vm ${vmId} on host ${hostId} vanished`);
        const reservation: VmReservation = {
          cpus: held.cpus,
          ram_mb: held.ram_mb,
          storage_gb: held.storage_gb,
          gpus: held.gpus,
          gpu_kind: held.gpu_kind,
          gpu_profile: held.gpu_profile,
          gpu_uuids: held.gpu_uuids,
          mig_instance_uuids: held.mig_instance_uuids,
        };
        return { hostId, choice, reservation, host };
      } catch (err) {
        this.view.release(holdKey);
        const lostRace =
          err instanceof AppError &&
          (err.code === 'CONCURRENCY_CONFLICT' ||
            err.code === 'HOST_CAPACITY_EXHAUSTED' ||
            err.code.startsWith('HOST_') ||
            err.code === 'GPU_BINDING_UNAVAILABLE');
        if (!lostRace || attempt >= attempts) throw err;
        await this.view.refresh(hostId);
      }
    }
  }

  /** The hosts as placement sees them (for a flow that must leave out hosts lacking a capability). */
  hosts(): Promise<PlacementHost[]> {
    return this.view.snapshot();
  }

  async release(hostId: string, vmId: string, meta: CommandMeta): Promise<void> {
    const r = await this.onHost(hostId, () =>
      this.hostHandler.handle(hostId, { type: 'ReleaseCapacity', data: { host_id: hostId, vm_id: vmId } }, meta),
    );
    this.view.set(hostId, r.state, r.revision);
  }

  /** Runs host-stream writes of this process one at a time per host: writers of one stream would only collide. */
  private onHost<T>(hostId: string, fn: () => Promise<T>): Promise<T> {
    return this.hostQueues.run(hostId, fn);
  }
}
