import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError, ConflictError, NotFoundError } from '@fleet/agent-protocol';
import type { ArtifactMoved, Checkpoint } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import type { HostState } from '../../domain/host/host.decider.js';
import { migrationAggregate, type MigrationCommand } from '../../domain/migration/migration.decider.js';
import type { MigrationStep } from '../../domain/migration/migration.events.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import { placementRequestOf } from '../../domain/vm/spec.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer, Reserved } from '../placement/place-and-reserve.js';
import { bootSandbox } from '../vm/boot-sandbox.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import type { StandbyCheckpoints } from './standby-checkpoints.js';
import { destroySource, switchToTarget } from './switch-host.js';

export interface LiveMigrateResult {
  readonly vm: ExistingVmState;
  readonly position: Position | undefined;
  readonly fromHostId: string;
  /** The agent's checkpoint the processes travelled in (removed from both hosts afterwards). */
  readonly checkpointId: string;
  readonly downtimeMs: number;
  /** The target could not give the VM its old address: it runs under `ip` now. */
  readonly readdressed: boolean;
  readonly ip: string | undefined;
}

export type Registered = Exclude<HostState, { status: 'unregistered' }>;
const canRestoreMemory = (h: HostState): h is Registered => h.status !== 'unregistered' && h.capacity.live_snapshot === true;

/**
 * Live migration of a process-backend VM (CRIU): the target is chosen and
 * reserved while the VM still runs; then the source is frozen into a
 * checkpoint (its processes stop), the checkpoint is pulled by the target
 * under a grant and verified by its sha256s, and restored there as the same
 * VM (same id; its address when free on the target). Never a cold fallback:
 * a target that cannot restore memory is refused before anything freezes,
 * and a failure after the freeze resumes the source where it stopped, or,
 * with `keep_paused`, leaves it paused for the caller to resume.
 */
export class LiveMigrate {
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;
  private readonly vmHandler: BoundOf<typeof vmAggregate>;
  /** Standby copies (CHECKPOINT_INTERVAL_MS): the target defaults to the VM's standby, and the move pulls against its copy. */
  standby: Pick<StandbyCheckpoints, 'baseOn' | 'standbyHostOf'> | undefined;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    private readonly vms: VmCommands,
    private readonly logger: Logger,
  ) {
    this.migrationHandler = bindAggregate(handler, migrationAggregate);
    this.vmHandler = bindAggregate(handler, vmAggregate);
  }

  async migrate(
    vm: ExistingVmState,
    fromHostId: string,
    source: HostState,
    opts: { target_host_id?: string | undefined; keep_paused: boolean },
    actor: Actor,
  ): Promise<LiveMigrateResult> {
    const vmId = vm.vm_id;
    if (!canRestoreMemory(source)) {
      throw new ConflictError(
        'LIVE_MIGRATION_UNSUPPORTED',
        `live migration needs a host that captures memory (CRIU); host ${fromHostId} cannot. The VM is still running on ${fromHostId}; migrate with live: false for a cold migration`,
        { vm_id: vmId, host_id: fromHostId },
      );
    }
    const { placed, targetId } = await this.reserveTarget(vm, fromHostId, source, opts, actor);

    const name = sandboxName(vmId);
    const src = this.hosts.agentForState(source);
    const dst = await this.hosts.agentFor(targetId);
    const cpId = `migrate-${vmId}-${randomBytes(4).toString('hex')}`;
    let step: MigrationStep = 'snapshot';
    let frozenAt: number | undefined;
    let pulled = false;
    let booted = false;
    const isBooted = (): boolean => booted;
    try {
      const wantIp = (await src.getVm(name)).ip;
      frozenAt = Date.now();
      // From here the source's processes are stopped: every failure below puts them back (or leaves them paused on request).
      const { checkpoint } = await src.pauseVm(name, { id: cpId, comment: `live migrate ${vmId} to ${targetId}` });
      await this.stepDone(
        vmId,
        'snapshot',
        { checkpoint_id: cpId, size_bytes: String(checkpoint.size_bytes), pause_ms: String(checkpoint.pause_ms ?? 0) },
        actor,
      );
      step = 'place';
      await this.stepDone(vmId, 'place', { host_id: targetId }, actor);

      step = 'move';
      const moveStarted = Date.now();
      const base = await this.standby?.baseOn(vmId, targetId);
      const moved = await this.pull(source, cpId, checkpoint, targetId, base);
      pulled = true;
      await this.stepDone(
        vmId,
        'move',
        {
          host_id: targetId,
          duration_ms: String(Date.now() - moveStarted),
          moved_bytes: String(moved.size_bytes),
          reused_bytes: String(moved.reused_bytes ?? 0),
          ...(base ? { standby_checkpoint_id: base } : {}),
        },
        actor,
      );

      step = 'boot';
      const guest = this.vms.openGuestInputs(vm);
      const { info, endpoints } = await bootSandbox(
        dst,
        {
          vmId,
          tenantId: vm.tenant_id,
          spec: vm.spec,
          checkpointId: cpId,
          resume: true,
          ipHint: wantIp,
          env: guest.secrets,
          // The in-guest agent travelled with the processes: only its ports and drain command are registered on the target.
          agent: vm.spec.agent ? { command: 'true', drainCommand: guest.drainCommand ?? '', files: {} } : undefined,
          reservation: placed.reservation,
        },
        { onCreated: () => (booted = true) },
      );
      const downtimeMs = Date.now() - frozenAt;
      const readdressed = wantIp !== undefined && info.ip !== wantIp;
      await this.stepDone(
        vmId,
        'boot',
        {
          host_id: targetId,
          ip: info.ip ?? '',
          readdressed: String(readdressed),
          ...(readdressed && wantIp ? { previous_ip: wantIp } : {}),
        },
        actor,
        downtimeMs,
      );

      step = 'switch';
      const switched = await switchToTarget(
        { vmHandler: this.vmHandler, vms: this.vms, logger: this.logger },
        { vmId, fromHostId, placed, snapshotId: cpId, ip: info.ip, endpoints },
        actor,
      );
      booted = false;

      // The VM runs on the target: what follows only removes the source's leftovers (the reconciler collects what fails).
      step = 'destroy_source';
      await destroySource(
        { vms: this.vms, logger: this.logger },
        { vmId, name, fromHostId, source: () => src },
        () => this.stepDone(vmId, 'destroy_source', { host_id: fromHostId }, actor),
        actor,
        'live-migrated, but the paused source was not destroyed',
      );
      step = 'cleanup';
      await Promise.all(
        [src, dst].map((a) =>
          a
            .deleteCheckpoint(cpId)
            .catch((err: unknown) =>
              this.logger.warn({ checkpoint: cpId, err: { message: (err as Error).message } }, 'migrate checkpoint not deleted'),
            ),
        ),
      );
      const done = await this.stepDone(vmId, 'cleanup', { checkpoint_id: cpId }, actor);
      const final = await this.vms.get(vmId, actor);
      this.logger.info({ vm_id: vmId, from: fromHostId, to: targetId, downtime_ms: downtimeMs, readdressed }, 'vm live-migrated');
      return { vm: final, position: done ?? switched.position, fromHostId, checkpointId: cpId, downtimeMs, readdressed, ip: info.ip };
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      if (isBooted()) await dst.destroyVm(name, { force: true }).catch(() => undefined);
      if (pulled) await dst.deleteCheckpoint(cpId).catch(() => undefined);
      await this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
      let source: 'running' | 'paused' | 'unknown' = 'running';
      if (frozenAt !== undefined) source = await this.afterFreezeFailed(vm, fromHostId, cpId, opts.keep_paused, actor);
      await this.record(
        vmId,
        { type: 'FailMigration', data: { vm_id: vmId, step, error: (err as Error).message, error_code: e?.code } },
        actor,
      ).catch(() => undefined);
      const where =
        source === 'running'
          ? `The VM runs on ${fromHostId} again`
          : source === 'paused'
            ? `The VM is paused on ${fromHostId} (keep_paused): POST /v1/vms/${vmId}/resume runs it`
            : `The VM could not be resumed on ${fromHostId}; the reconciler will look at it`;
      throw new AppError(
        'MIGRATION_FAILED',
        e?.status ?? 502,
        `live migration of vm ${vmId} stopped at step "${step}": ${(err as Error).message}. ${where}`,
        { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, source, cause_code: e?.code },
        { cause: err },
      );
    }
  }

  /**
   * The refusals before anything freezes, then the target chosen and
   * reserved and the migration started; shared with the lazy migrate, whose
   * `also` narrows the targets and marks the start.
   */
  async reserveTarget(
    vm: ExistingVmState,
    fromHostId: string,
    source: Registered,
    opts: { target_host_id?: string | undefined },
    actor: Actor,
    also: { unfit?: (capacity: Registered['capacity']) => boolean; lazy?: boolean } = {},
  ): Promise<{ placed: Reserved; targetId: string }> {
    const vmId = vm.vm_id;
    if (opts.target_host_id !== undefined) {
      const { state: t } = await this.hosts.load(opts.target_host_id);
      if (t.status === 'unregistered')
        throw new NotFoundError('HOST_NOT_FOUND', `host ${opts.target_host_id} is not registered`, { host_id: opts.target_host_id });
      if (!canRestoreMemory(t) || t.backend !== source.backend)
        throw new ConflictError(
          'LIVE_MIGRATION_TARGET_UNSUPPORTED',
          `host ${opts.target_host_id} cannot restore a ${source.backend} memory checkpoint (no CRIU, or another backend); nothing was frozen: vm ${vmId} still runs on ${fromHostId}`,
          { vm_id: vmId, host_id: opts.target_host_id },
        );
    }
    // The target is reserved while the VM still runs: no fit is a refusal before anything freezes.
    const unfit = new Set([fromHostId]);
    for (const h of await this.placer.hosts())
      if (h.capacity.live_snapshot !== true || h.backend !== source.backend || also.unfit?.(h.capacity) === true) unfit.add(h.id);
    const place = (hostId: string | undefined) =>
      this.placer.placeAndReserve(
        vmId,
        { ...placementRequestOf(vm.spec), host_id: undefined, pinned_host_id: undefined, ...(hostId ? { host_id: hostId } : {}) },
        vm.spec,
        actor,
        { excludeHosts: unfit, holdKey: `${vmId}-migrate` },
      );
    // No target named: the VM's standby first, where a copy waits (a lazy move pages memory in and pulls no base).
    const standbyHost = opts.target_host_id === undefined && !also.lazy ? await this.standby?.standbyHostOf(vmId) : undefined;
    const placed =
      standbyHost && !unfit.has(standbyHost) ? await place(standbyHost).catch(() => place(undefined)) : await place(opts.target_host_id);
    const targetId = placed.hostId;
    try {
      await this.record(
        vmId,
        {
          type: 'StartMigration',
          data: { vm_id: vmId, from_host_id: fromHostId, target_host_id: targetId, live: true, ...(also.lazy ? { lazy: true } : {}) },
        },
        actor,
      );
    } catch (err) {
      await this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
      throw err;
    }
    return { placed, targetId };
  }

  /** The frozen source, after a failed move: resumed where it stopped, or kept paused (recorded so) for its caller. */
  private async afterFreezeFailed(
    vm: ExistingVmState,
    hostId: string,
    cpId: string,
    keepPaused: boolean,
    actor: Actor,
  ): Promise<'running' | 'paused' | 'unknown'> {
    const name = sandboxName(vm.vm_id);
    try {
      const src = await this.hosts.agentFor(hostId);
      if (keepPaused) {
        await this.vmHandler.handle(vm.vm_id, { type: 'PauseVm', data: { vm_id: vm.vm_id, checkpoint_id: cpId, pause_ms: 0 } }, actor);
        await this.vms.releaseCapacity(hostId, vm.vm_id, actor);
        return 'paused';
      }
      await src.resumeVm(name);
      return 'running';
    } catch (err) {
      this.logger.error({ vm_id: vm.vm_id, err: { message: (err as Error).message } }, 'a failed live migration left its source frozen');
      return 'unknown';
    }
  }

  private async pull(source: Registered, cpId: string, cp: Checkpoint, targetId: string, base?: string): Promise<ArtifactMoved> {
    if (!cp.digest || !/^[0-9a-f]{64}$/.test(cp.digest))
      throw new ConflictError('ARTIFACT_DIGEST_UNKNOWN', `checkpoint ${cpId} has no digest: a copy could not be verified`);
    const src = this.hosts.agentForState(source);
    const dst = await this.hosts.agentFor(targetId);
    const grant = await src.grantArtifact(cpId, 600);
    return dst.pullArtifact({
      snapshot_id: cpId,
      digest: cp.digest,
      from: { url: source.url, grant: grant.grant, host_id: source.host_id },
      files: { ...cp.files },
      ...(base ? { base_snapshot_id: base } : {}),
    });
  }

  private async stepDone(
    vmId: string,
    step: MigrationStep,
    detail: Record<string, string>,
    actor: Actor,
    downtimeMs?: number,
  ): Promise<Position | undefined> {
    return this.record(vmId, { type: 'CompleteMigrationStep', data: { vm_id: vmId, step, detail, downtime_ms: downtimeMs } }, actor);
  }

  private async record(vmId: string, command: MigrationCommand, actor: Actor): Promise<Position | undefined> {
    return (await this.migrationHandler.handle(vmId, command, actor)).position;
  }
}
