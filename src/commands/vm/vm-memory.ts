import type { Logger } from 'pino';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import { KeyedQueue } from '../keyed-queue.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer } from '../placement/place-and-reserve.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import { placementRequestOf } from '../../domain/vm/spec.js';
import type { ExistingVmState, VmCommand } from '../../domain/vm/vm.decider.js';
import type { Position } from '../../domain/event-store.port.js';
import type { MemoryStatus } from '../../domain/host-agent.port.js';
import { sandboxName, type Actor, type VmCommands } from './vm-commands.js';
import type { SnapshotCommands } from '../snapshot/snapshot-commands.js';
import { resumeElsewhere } from './resume-elsewhere.js';
import { RESUME_CLAIM_LEASE_MS, ResumeClaims } from './resume-claim.js';

export interface VmMemoryResult {
  readonly vm: ExistingVmState;
  readonly position: Position | undefined;
}

/**
 * Pause and resume of a running VM on its host (the agent's memory
 * checkpoints, CRIU): a pause checkpoints the processes, stops them and
 * releases the VM's CPU and memory reservation (its disk stays on the host,
 * counted); a resume reserves again on that host and restores the processes
 * where they stopped, with the same id, token and endpoints. Both are
 * idempotent, and serialized per VM in this process: of concurrent resumes
 * one restores and the others answer the VM it made running.
 */
export class VmMemory {
  private readonly vmHandler: BoundOf<typeof vmAggregate>;
  private readonly queue = new KeyedQueue();
  private readonly claims: ResumeClaims;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    private readonly vms: VmCommands,
    private readonly snapshots: SnapshotCommands,
    private readonly logger: Logger,
  ) {
    this.vmHandler = bindAggregate(handler, vmAggregate);
    this.claims = new ResumeClaims(handler, RESUME_CLAIM_LEASE_MS, 100, logger);
  }

  pause(vmId: string, actor: Actor): Promise<VmMemoryResult> {
    return this.queue.run(vmId, async () => {
      const vm = await this.vms.get(vmId, actor);
      if (vm.status === 'paused') return { vm, position: undefined };
      if (vm.status !== 'running')
        throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: only a running VM can be paused`, {
          vm_id: vmId,
          status: vm.status,
        });
      const { state: host } = await this.hosts.load(vm.host_id);
      if (host.status === 'unregistered' || host.capacity.live_snapshot !== true) {
        throw new ConflictError(
          'MEMORY_CHECKPOINT_UNSUPPORTED',
          `host ${vm.host_id} cannot checkpoint memory (no CRIU); vm ${vmId} is still running`,
          { vm_id: vmId, host_id: vm.host_id },
        );
      }
      const agent = await this.hosts.agentFor(vm.host_id);
      const paused = await agent.pauseVm(sandboxName(vmId), { id: `pause-${vmId}`, comment: 'pause' });
      const r = await this.run(
        vmId,
        { type: 'PauseVm', data: { vm_id: vmId, checkpoint_id: paused.checkpoint.id, pause_ms: paused.checkpoint.pause_ms ?? 0 } },
        actor,
      );
      await this.vms.releaseCapacity(vm.host_id, vmId, actor);
      this.logger.info({ vm_id: vmId, host_id: vm.host_id, pause_ms: paused.checkpoint.pause_ms }, 'vm paused');
      return r;
    });
  }

  resume(vmId: string, actor: Actor): Promise<VmMemoryResult> {
    // Paused: undefined. Running: answered as it is (a resume is idempotent). Anything else: refused.
    const settled = async (): Promise<VmMemoryResult | undefined> => {
      const vm = await this.vms.get(vmId, actor);
      if (vm.status === 'paused') return undefined;
      if (vm.status === 'running') return { vm, position: undefined };
      throw new AppError('VM_NOT_PAUSED', 409, `vm ${vmId} is ${vm.status}: only a paused VM can be resumed`, {
        vm_id: vmId,
        status: vm.status,
      });
    };
    return this.queue.run(vmId, async () => {
      const done = await settled();
      if (done) return done;
      // Another replica may be resuming it right now: one restore, whoever asked where.
      return this.claims.run(vmId, actor, () => this.resumePaused(vmId, actor), settled);
    });
  }

  private async resumePaused(vmId: string, actor: Actor): Promise<VmMemoryResult> {
    const vm = await this.vms.get(vmId, actor);
    if (vm.status !== 'paused') throw new AppError('VM_NOT_PAUSED', 409, `vm ${vmId} is ${vm.status}`, { vm_id: vmId, status: vm.status });
    const started = Date.now();
    // Its disk and checkpoint are on its host: it resumes there, with its CPU and memory reserved again.
    const placed = await this.placer
      .placeAndReserve(vmId, { ...placementRequestOf(vm.spec), pinned_host_id: vm.host_id }, vm.spec, actor)
      .catch((err: unknown) => {
        if (err instanceof AppError && err.code === 'CAPACITY_EXHAUSTED') return undefined;
        throw err;
      });
    // No room there any more: the checkpoint moves to a host that has some (not a network member: its network is on this host).
    if (!placed) {
      if (vm.spec.network_id)
        throw new AppError(
          'CAPACITY_EXHAUSTED',
          409,
          `host ${vm.host_id} has no room to resume vm ${vmId}, and as a member of network ${vm.spec.network_id} it cannot resume elsewhere; it stays paused`,
          { vm_id: vmId, host_id: vm.host_id, network_id: vm.spec.network_id },
        );
      return this.resumeOnAnotherHost(vm, started, actor);
    }
    try {
      const agent = await this.hosts.agentFor(placed.hostId);
      const info = await agent.resumeVm(sandboxName(vmId));
      const endpoints = info.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol }));
      return await this.run(
        vmId,
        {
          type: 'ResumeVm',
          data: {
            vm_id: vmId,
            host_id: placed.hostId,
            decision: placed.choice.decision,
            reservation: placed.reservation,
            endpoints,
            resume_ms: Date.now() - started,
          },
        },
        actor,
      );
    } catch (err) {
      await this.vms.releaseCapacity(placed.hostId, vmId, actor).catch(() => undefined);
      throw err;
    }
  }

  /**
   * Where the VM's memory is (the seed's MemoryStatus). A full restore
   * copies the whole image before the processes run: done, nothing
   * outstanding. After a lazy migration (lazy-migrate.ts), and after any
   * restore on a host with lazy_pages (its agent pages the checkpoint in from
   * its own files), the VM runs on its host before its memory is there, and
   * that host's agent counts the pages in (`resident_chunks` of
   * `total_chunks`; `error` when the stream from the source broke, or the
   * host's own paging failed, which loses the VM's processes).
   */
  async memoryStatus(vmId: string, actor: Actor): Promise<MemoryStatus> {
    const vm = await this.vms.get(vmId, actor);
    if (vm.status !== 'running' && vm.status !== 'paused')
      throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: it has no memory to report on`, {
        vm_id: vmId,
        status: vm.status,
      });
    if (vm.status === 'running') {
      const { state: host } = await this.hosts.load(vm.host_id);
      if (host.status !== 'unregistered' && host.capacity.lazy_pages === true) {
        const agent = this.hosts.agentForState(host);
        if (agent.memoryStatus) return agent.memoryStatus(sandboxName(vmId));
      }
    }
    return { resident_chunks: 0, total_chunks: 0, done: true };
  }

  private async resumeOnAnotherHost(
    vm: Extract<ExistingVmState, { status: 'paused' }>,
    started: number,
    actor: Actor,
  ): Promise<VmMemoryResult> {
    const vmId = vm.vm_id;
    const moved = await resumeElsewhere({ hosts: this.hosts, placer: this.placer, vms: this.vms, logger: this.logger }, vm, actor);
    const shown = this.vms.ingress ? await this.vms.ingress.present(vmId, moved.endpoints) : undefined;
    const r = await this.run(
      vmId,
      {
        type: 'ResumeVm',
        data: {
          vm_id: vmId,
          host_id: moved.placed.hostId,
          decision: moved.placed.choice.decision,
          reservation: moved.placed.reservation,
          endpoints: shown?.endpoints ?? moved.endpoints,
          resume_ms: Date.now() - started,
        },
      },
      actor,
    );
    await this.vms.ingress
      ?.adopt(vmId, moved.placed.hostId, moved.endpoints, actor)
      .catch((err: unknown) =>
        this.logger.error(
          { vm_id: vmId, err: { message: (err as Error).message } },
          'resumed elsewhere, but its ingress routes still name the origin',
        ),
      );
    await moved.cleanup();
    return r;
  }

  /**
   * Puts a running VM back to one of its own snapshots, on its host: a live
   * one resumes the processes it captured, a disk one boots afresh over its
   * layer. The snapshot must be on the VM's host (move it there first).
   */
  restore(vmId: string, snapshotId: string, actor: Actor): Promise<VmMemoryResult> {
    return this.queue.run(vmId, async () => {
      const vm = await this.vms.get(vmId, actor);
      if (vm.status !== 'running')
        throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: only a running VM can be restored`, {
          vm_id: vmId,
          status: vm.status,
        });
      const snap = await this.snapshots.get(snapshotId, actor);
      if (snap.vm_id !== vmId)
        throw new ConflictError('SNAPSHOT_NOT_OF_VM', `snapshot ${snapshotId} is of vm ${snap.vm_id}, not ${vmId}`, {
          snapshot_id: snapshotId,
        });
      if (snap.status !== 'ready')
        throw new ConflictError('SNAPSHOT_NOT_READY', `snapshot ${snapshotId} is ${snap.status}`, { snapshot_id: snapshotId });
      if (!snap.holders.includes(vm.host_id))
        throw new ConflictError('SNAPSHOT_NOT_ON_HOST', `snapshot ${snapshotId} is not on host ${vm.host_id}, where vm ${vmId} runs`, {
          snapshot_id: snapshotId,
          host_id: vm.host_id,
        });
      const started = Date.now();
      const agent = await this.hosts.agentFor(vm.host_id);
      const info = await agent.restoreVm(sandboxName(vmId), { checkpoint_id: snapshotId });
      const endpoints = info.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol }));
      return this.run(
        vmId,
        { type: 'RestoreVm', data: { vm_id: vmId, snapshot_id: snapshotId, kind: snap.kind, endpoints, restore_ms: Date.now() - started } },
        actor,
      );
    });
  }

  private async run(vmId: string, command: VmCommand, actor: Actor): Promise<VmMemoryResult> {
    const r = await this.vmHandler.handle(vmId, command, actor);
    if (r.state.status === 'initial') throw new AppError('INTERNAL', 500, `vm ${vmId} has no state after ${command.type}`);
    return { vm: r.state, position: r.position };
  }
}
