import type { Logger } from 'pino';
import { bindAggregate, type BoundOf } from '../command-handler.js';
import { migrationAggregate } from '../../domain/migration/migration.decider.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import { AppError, ConflictError, NotFoundError, ValidationError } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import { blocksNewMigration, type MigrationCommand } from '../../domain/migration/migration.decider.js';
import type { MigrationStep } from '../../domain/migration/migration.events.js';
import { parseVmSpec, placementRequestOf } from '../../domain/vm/spec.js';
import { type ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { CommandHandler } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer } from '../placement/place-and-reserve.js';
import { bootSandbox } from '../vm/boot-sandbox.js';
import type { SnapshotCommands } from '../snapshot/snapshot-commands.js';
import { snapshotRequest } from '../snapshot/snapshot-request.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import { destroySource, switchToTarget } from './switch-host.js';
import { LiveFork, type ForkManyResult } from './fork-live.js';
import { forkSpec } from './fork-spec.js';
export { forkSpec } from './fork-spec.js';
import { LiveMigrate, type LiveMigrateResult } from './live-migrate.js';
import { QemuLiveMigrate } from './qemu-live-migrate.js';
import { LazyMigrate } from './lazy-migrate.js';
import { gpuMemoryStateUnsupported, holdsGpus } from './gpu-memory.js';

export interface ForkResult {
  readonly vm: ExistingVmState;
  readonly position: Position | undefined;
  readonly snapshotId: string;
}

export interface MigrateResult extends ForkResult {
  readonly fromHostId: string;
  /** A live migration's figures. */
  readonly live?: Pick<LiveMigrateResult, 'downtimeMs' | 'readdressed' | 'ip'> | undefined;
}

/** Backends whose agents can capture guest memory (seed: live migration needs firecracker). */
const LIVE_CAPABLE_BACKENDS: ReadonlySet<string> = new Set(['firecracker']);

/**
 * Fork (a new VM seeded from a snapshot of the source, with its own
 * credentials) and cold migration (disk snapshot → move → boot on the
 * target → destroy the source; the VM keeps its id).
 */
export class ForkMigrate {
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;
  private readonly vmHandler: BoundOf<typeof vmAggregate>;
  private readonly liveFork: LiveFork;
  private readonly liveMigrate: LiveMigrate;
  private readonly qemuLiveMigrate: QemuLiveMigrate;
  readonly lazyMigrate: LazyMigrate;

  constructor(
    private readonly handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    private readonly vms: VmCommands,
    private readonly snapshots: SnapshotCommands,
    private readonly logger: Logger,
  ) {
    this.migrationHandler = bindAggregate(handler, migrationAggregate);
    this.vmHandler = bindAggregate(handler, vmAggregate);
    this.liveFork = new LiveFork(hosts, placer, vms, snapshots, logger);
    this.liveMigrate = new LiveMigrate(handler, hosts, placer, vms, logger);
    this.qemuLiveMigrate = new QemuLiveMigrate(handler, hosts, placer, vms, logger);
    this.lazyMigrate = new LazyMigrate(handler, hosts, vms, this.liveMigrate, logger);
  }

  /** Shutdown: the background watches of lazy moves (CRIU page-in, QEMU post-copy) stop where they are. */
  /** The reconciler's LazyWatcher: a lazy move past its switch, CRIU's or QEMU's, whose watch this process has or takes up. */
  async adopt(vmId: string): Promise<boolean> {
    return (await this.qemuLiveMigrate.adopt(vmId)) || this.lazyMigrate.adopt(vmId);
  }

  async stop(): Promise<void> {
    await Promise.all([this.lazyMigrate.stop(), this.qemuLiveMigrate.stop()]);
  }

  /** Standby copies a live migrate defaults to and pulls against (CHECKPOINT_INTERVAL_MS; standby-checkpoints.ts). */
  set standby(standby: LiveMigrate['standby']) {
    this.liveMigrate.standby = standby;
  }

  /** `count` forks of one capture (fork-live.ts): live where the source's host captures memory. */
  forkMany(
    vmId: string,
    opts: { count: number; comment?: string | undefined; reuse_snapshot_id?: string | undefined },
    actor: Actor,
  ): Promise<ForkManyResult> {
    return this.liveFork.forkMany(vmId, opts, actor);
  }

  async fork(
    vmId: string,
    opts: { comment?: string | undefined; reuse_snapshot_id?: string | undefined },
    actor: Actor,
  ): Promise<ForkResult> {
    const src = await this.vms.get(vmId, actor);
    let snapshotId: string;
    if (opts.reuse_snapshot_id) {
      const s = await this.snapshots.get(opts.reuse_snapshot_id, actor);
      if (s.vm_id !== vmId)
        throw new ConflictError('SNAPSHOT_NOT_OF_VM', `snapshot ${s.snapshot_id} is of vm ${s.vm_id}, not ${vmId}`, {
          snapshot_id: s.snapshot_id,
        });
      if (s.status !== 'ready')
        throw new ConflictError('SNAPSHOT_NOT_READY', `snapshot ${s.snapshot_id} is ${s.status}`, { snapshot_id: s.snapshot_id });
      snapshotId = s.snapshot_id;
    } else {
      const r = await this.snapshots.create(
        vmId,
        snapshotRequest({ mode: 'manual', comment: opts.comment ?? `fork of ${vmId}`, metadata: { fork_of: vmId } }),
        actor,
      );
      snapshotId = r.snapshot.snapshot_id;
    }
    // The create flow mints a fresh per-VM token and overwrites the copied one before the fork runs anything.
    const r = await this.vms.create(parseVmSpec(forkSpec(src.spec, snapshotId, this.vms.openGuestInputs(src))), actor);
    return { vm: r.vm, position: r.position, snapshotId };
  }

  async migrate(
    vmId: string,
    opts: { target_host_id?: string | undefined; live: boolean; lazy?: boolean | undefined; keep_paused?: boolean | undefined },
    actor: Actor,
  ): Promise<MigrateResult> {
    const vm = await this.vms.get(vmId, actor);
    if (vm.status !== 'running' || !vm.host_id)
      throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: only a running VM can be migrated`, {
        vm_id: vmId,
        status: vm.status,
      });
    const fromHostId = vm.host_id;
    // Before any reservation: a lazy migration still paging in holds one on its source under this VM's id.
    const { state: inFlight } = await this.migrationHandler.load(vmId);
    if (blocksNewMigration(inFlight, new Date()))
      throw new ConflictError(
        'MIGRATION_IN_PROGRESS',
        `vm ${vmId} is already being migrated (last step: ${inFlight.last_step ?? 'started'}); wait for it to finish`,
        {
          vm_id: vmId,
        },
      );
    // A network spans one host (docs/networking.md): booted elsewhere, the member would leave its network for its tenant's bridge.
    if (vm.spec.network_id)
      throw new ConflictError(
        'NETWORK_MEMBER_PINNED',
        `vm ${vmId} is a member of network ${vm.spec.network_id}, which spans one host: it cannot move off ${fromHostId}`,
        { vm_id: vmId, network_id: vm.spec.network_id, host_id: fromHostId },
      );
    const { state: source } = await this.hosts.load(fromHostId);
    const backend = source.status === 'unregistered' ? 'unknown' : source.backend;
    if (opts.lazy && !opts.live) throw new ValidationError('lazy needs live: true', [{ path: 'lazy', message: 'needs live' }]);
    if (opts.keep_paused && !opts.live)
      throw new ValidationError('keep_paused needs live: true', [{ path: 'keep_paused', message: 'needs live' }]);
    if (opts.target_host_id === fromHostId)
      throw new ValidationError(
        `target_host_id ${fromHostId} is the VM's own host: pick another`,
        [{ path: 'target_host_id', message: 'same as the source host' }],
        'MIGRATION_TARGET_IS_SOURCE',
      );
    if (opts.lazy && opts.keep_paused)
      throw new ValidationError(
        'keep_paused cannot be combined with lazy: a lazy move runs the VM on the target before its memory is there',
        [{ path: 'keep_paused', message: 'not with lazy' }],
      );
    // Before any reservation on a target: QEMU's VFIO migration blocker would only fail the send after placement.
    if (opts.live && holdsGpus(source, vmId, vm.spec.gpus))
      throw gpuMemoryStateUnsupported(vmId, opts.lazy ? 'a lazy migration' : 'a live migration');
    // A host that checkpoints memory (CRIU) migrates live itself; lazily (memory paged in afterwards) in lazy-migrate.ts.
    const criuSource = source.status !== 'unregistered' && source.capacity.live_snapshot === true;
    if (opts.live && criuSource && source.backend === 'qemu') {
      // A qemu host streams the running guest itself (QEMU's migration; lazy: its post-copy); a CRIU host moves a checkpoint.
      const r = await this.qemuLiveMigrate.migrate(
        vm,
        fromHostId,
        source,
        { target_host_id: opts.target_host_id, keep_paused: opts.keep_paused ?? false, lazy: opts.lazy ?? false },
        actor,
      );
      return { vm: r.vm, position: r.position, snapshotId: r.checkpointId, fromHostId, live: r };
    }
    if (opts.lazy && criuSource) {
      const r = await this.lazyMigrate.migrate(vm, fromHostId, source, { target_host_id: opts.target_host_id }, actor);
      return { vm: r.vm, position: r.position, snapshotId: r.checkpointId, fromHostId, live: r };
    }
    if (opts.live && criuSource) {
      const r = await this.liveMigrate.migrate(
        vm,
        fromHostId,
        source,
        { target_host_id: opts.target_host_id, keep_paused: opts.keep_paused ?? false },
        actor,
      );
      return { vm: r.vm, position: r.position, snapshotId: r.checkpointId, fromHostId, live: r };
    }
    if (opts.live && !LIVE_CAPABLE_BACKENDS.has(backend)) {
      // Never a silent cold fallback: the caller asked for processes to survive and hears, while the source still runs, that they would not.
      throw new ConflictError(
        'LIVE_MIGRATION_UNSUPPORTED',
        `live migration needs a backend that captures guest memory; host ${fromHostId} runs the ${backend} backend. The VM is still running on ${fromHostId}; migrate with live: false for a cold migration`,
        {
          vm_id: vmId,
          host_id: fromHostId,
          backend,
        },
      );
    }
    if (opts.live)
      throw new AppError(
        'LIVE_MIGRATION_UNSUPPORTED',
        501,
        `live migration is not implemented by this control plane yet; vm ${vmId} is still running on ${fromHostId}`,
        { vm_id: vmId },
      );
    if (opts.target_host_id !== undefined) {
      const { state: t } = await this.hosts.load(opts.target_host_id);
      if (t.status === 'unregistered')
        throw new NotFoundError('HOST_NOT_FOUND', `host ${opts.target_host_id} is not registered`, { host_id: opts.target_host_id });
    }

    await this.record(
      vmId,
      { type: 'StartMigration', data: { vm_id: vmId, from_host_id: fromHostId, target_host_id: opts.target_host_id, live: false } },
      actor,
    );
    let step: MigrationStep = 'snapshot';
    let snapshotId: string | undefined;
    let targetId: string | undefined;
    let reserved = false;
    let booted = false;
    // `booted` flips in the onCreated callback: read it through a call, not a narrowed local.
    const isBooted = (): boolean => booted;
    try {
      const snap = await this.snapshots.create(
        vmId,
        snapshotRequest({ mode: 'migrate', no_lineage: true, comment: `migrate ${vmId} from ${fromHostId}` }),
        actor,
      );
      snapshotId = snap.snapshot.snapshot_id;
      await this.stepDone(
        vmId,
        'snapshot',
        { snapshot_id: snapshotId, kind: snap.snapshot.kind, size_bytes: String(snap.snapshot.size_bytes) },
        actor,
      );

      step = 'place';
      const request = {
        ...placementRequestOf(vm.spec),
        host_id: undefined,
        pinned_host_id: undefined,
        ...(opts.target_host_id ? { host_id: opts.target_host_id } : {}),
      };
      const spec = vm.spec;
      const placed = await this.placer.placeAndReserve(vmId, request, spec, actor, {
        excludeHosts: new Set([fromHostId]),
        artifactHosts: new Set(snap.snapshot.holders),
        holdKey: `${vmId}-migrate`,
      });
      targetId = placed.hostId;
      reserved = true;
      await this.stepDone(vmId, 'place', { host_id: targetId, artifact_local: String(placed.choice.decision.artifact_local) }, actor);

      step = 'move';
      await this.snapshots.ensureOn(snapshotId, targetId, actor);
      await this.stepDone(vmId, 'move', { host_id: targetId, transferred: String(!placed.choice.decision.artifact_local) }, actor);

      step = 'boot';
      const agent = await this.hosts.agentFor(targetId);
      const name = sandboxName(vmId);
      const guest = this.vms.openGuestInputs(vm);
      // The disk carries the guest's files and token; the target publishes the same ports and starts the same in-guest agent.
      const { info, endpoints } = await bootSandbox(
        agent,
        {
          vmId,
          tenantId: vm.tenant_id,
          spec,
          checkpointId: snapshotId,
          env: guest.secrets,
          agent: spec.agent ? { command: guest.agentCommand ?? 'true', drainCommand: guest.drainCommand ?? '', files: {} } : undefined,
          reservation: placed.reservation,
        },
        { onCreated: () => (booted = true) },
      );
      await this.stepDone(vmId, 'boot', { host_id: targetId }, actor);

      step = 'switch';
      // With an ingress the VM keeps its URLs; the routes are pointed at the target right after the switch.
      const switched = await switchToTarget(
        { vmHandler: this.vmHandler, vms: this.vms, logger: this.logger },
        { vmId, fromHostId, placed, snapshotId: snapshotId, ip: info.ip, endpoints },
        actor,
      );
      let position = switched.position;
      let final = switched.state;
      booted = false;
      reserved = false;

      // From here the VM runs on the target: a failure only leaves garbage on the source, which the reconciler collects.
      step = 'destroy_source';
      await destroySource(
        { vms: this.vms, logger: this.logger },
        { vmId, name, fromHostId, source: () => this.hosts.agentFor(fromHostId) },
        () => this.stepDone(vmId, 'destroy_source', { host_id: fromHostId }, actor),
        actor,
        'migrated, but the source sandbox was not destroyed',
      );
      step = 'cleanup';
      await this.snapshots
        .delete(snapshotId, actor, { force: true, reason: 'migrate' })
        .catch((err: unknown) =>
          this.logger.warn({ snapshot_id: snapshotId, err: { message: (err as Error).message } }, 'migrate snapshot not deleted'),
        );
      const done = await this.stepDone(vmId, 'cleanup', { snapshot_id: snapshotId }, actor);
      position = done ?? position;
      const reread = await this.vms.get(vmId, actor);
      final = reread;
      return { vm: final, position, snapshotId, fromHostId };
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      // Undo on the target only: the source was never touched and still runs.
      if (isBooted() && targetId) {
        await this.hosts
          .agentFor(targetId)
          .then((a) => a.destroyVm(sandboxName(vmId), { force: true }))
          .catch(() => undefined);
      }
      if (reserved && targetId) await this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
      if (snapshotId) await this.snapshots.delete(snapshotId, actor, { force: true, reason: 'migrate' }).catch(() => undefined);
      await this.record(
        vmId,
        { type: 'FailMigration', data: { vm_id: vmId, step, error: (err as Error).message, error_code: e?.code } },
        actor,
      ).catch(() => undefined);
      throw new AppError(
        'MIGRATION_FAILED',
        e?.status ?? 502,
        `migration of vm ${vmId} stopped at step "${step}": ${(err as Error).message}. The VM is still running on ${fromHostId}`,
        { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, cause_code: e?.code },
        { cause: err },
      );
    }
  }

  private async stepDone(vmId: string, step: MigrationStep, detail: Record<string, string>, actor: Actor): Promise<Position | undefined> {
    return this.record(vmId, { type: 'CompleteMigrationStep', data: { vm_id: vmId, step, detail } }, actor);
  }

  private async record(vmId: string, command: MigrationCommand, actor: Actor): Promise<Position | undefined> {
    const r = await this.migrationHandler.handle(vmId, command, actor);
    return r.position;
  }
}
