import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError, ConflictError, NotFoundError, type Checkpoint } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import type { HostAgent, MemoryStatus } from '../../domain/host-agent.port.js';
import type { HostState } from '../../domain/host/host.decider.js';
import { migrationAggregate, type MigrationCommand } from '../../domain/migration/migration.decider.js';
import type { MigrationStep } from '../../domain/migration/migration.events.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import { bootSandbox } from '../vm/boot-sandbox.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import type { LiveMigrate, LiveMigrateResult, Registered } from './live-migrate.js';
import { adoptableMove, followPageIn } from './page-in-watch.js';
import { switchToTarget } from './switch-host.js';

export type LazyMigrateResult = LiveMigrateResult;

type LazyAgent = HostAgent & Required<Pick<HostAgent, 'lazyPauseVm' | 'createLazyVm' | 'memoryStatus' | 'releaseLazyPages'>>;
const lazyAgent = (a: HostAgent): LazyAgent | undefined =>
  a.lazyPauseVm && a.createLazyVm && a.memoryStatus && a.releaseLazyPages ? (a as LazyAgent) : undefined;
// The process backend's CRIU lazy pages; a qemu host's `lazy_pages` is QEMU's own post-copy, which this flow does not drive.
const canServeLazily = (h: HostState): h is Registered =>
  h.status !== 'unregistered' && h.backend === 'process' && h.capacity.live_snapshot === true && h.capacity.lazy_pages === true;

/** The error code a VM lost with its source ends with (VmFailed, reason host_lost). */
export const LAZY_SOURCE_LOST = 'LAZY_SOURCE_LOST';

/**
 * Lazy (post-copy) live migration of a process-backend VM: the source is
 * frozen into a checkpoint without its memory pages, which stay pinned in
 * the source agent's page server; the target pulls the checkpoint, restores
 * the processes at once and pages their memory in through the source
 * agent's grant-authenticated websocket (the agent side:
 * packages/agent/src/backend/process/criu-lazy-sandbox.ts). The VM switches
 * to the target as soon as it runs there; the answer comes then, and the
 * rest goes on in the background: once the target reports every page
 * resident the source is destroyed and its reservation released. Until
 * then the VM depends on its source: a broken page stream (the source host
 * or agent lost) loses the VM, recorded as failed (host_lost,
 * LAZY_SOURCE_LOST). The same holds for a failure between the freeze and
 * the target running: the memory is only in the pinned capture, which
 * nothing on the source can restore from, so every check that can be made
 * is made before the freeze (LiveMigrate.reserveTarget, and lazy_pages on
 * both hosts).
 */
export class LazyMigrate {
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;
  private readonly vmHandler: BoundOf<typeof vmAggregate>;
  /** Background page-in watches of this process, by VM. */
  private readonly watching = new Map<string, Promise<void>>();
  private stopped = false;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly vms: VmCommands,
    private readonly live: LiveMigrate,
    private readonly logger: Logger,
  ) {
    this.migrationHandler = bindAggregate(handler, migrationAggregate);
    this.vmHandler = bindAggregate(handler, vmAggregate);
  }

  async migrate(
    vm: ExistingVmState,
    fromHostId: string,
    source: HostState,
    opts: { target_host_id?: string | undefined },
    actor: Actor,
  ): Promise<LazyMigrateResult> {
    const vmId = vm.vm_id;
    const src = canServeLazily(source) ? lazyAgent(this.hosts.agentForState(source)) : undefined;
    if (!src || !canServeLazily(source))
      throw new ConflictError(
        'LAZY_MIGRATION_UNSUPPORTED',
        `a lazy migration needs a process-backend source host that serves memory pages (capacity lazy_pages); host ${fromHostId} cannot. The VM is still running on ${fromHostId}; migrate with lazy: false`,
        { vm_id: vmId, host_id: fromHostId },
      );
    if (opts.target_host_id !== undefined) {
      const { state: t } = await this.hosts.load(opts.target_host_id);
      if (t.status === 'unregistered')
        throw new NotFoundError('HOST_NOT_FOUND', `host ${opts.target_host_id} is not registered`, { host_id: opts.target_host_id });
      if (!canServeLazily(t))
        throw new ConflictError(
          'LAZY_MIGRATION_TARGET_UNSUPPORTED',
          `host ${opts.target_host_id} cannot restore lazily (a process-backend host with capacity lazy_pages); nothing was frozen: vm ${vmId} still runs on ${fromHostId}`,
          { vm_id: vmId, host_id: opts.target_host_id },
        );
    }
    const { placed, targetId } = await this.live.reserveTarget(vm, fromHostId, source, opts, actor, {
      unfit: (c) => c.lazy_pages !== true,
      lazy: true,
    });

    const name = sandboxName(vmId);
    const dstAgent = await this.hosts.agentFor(targetId);
    const dst = lazyAgent(dstAgent);
    const cpId = `lazy-${vmId}-${randomBytes(4).toString('hex')}`;
    let step: MigrationStep = 'snapshot';
    let frozenAt: number | undefined;
    let sourceUnknown = false;
    const isSourceUnknown = (): boolean => sourceUnknown;
    let pulled = false;
    let booted = false;
    const isBooted = (): boolean => booted;
    try {
      if (!dst) throw new ConflictError('LAZY_MIGRATION_TARGET_UNSUPPORTED', `the agent of host ${targetId} has no lazy restore`);
      const wantIp = (await src.getVm(name)).ip;
      const freezing = Date.now();
      let checkpoint: Checkpoint;
      try {
        ({ checkpoint } = await src.lazyPauseVm(name, { id: cpId, comment: `lazy migrate ${vmId} to ${targetId}` }));
      } catch (err) {
        // The agent puts a sandbox whose lazy dump failed back to running; only a pause that went through (its answer lost) froze it.
        const now = await src.getVm(name).catch(() => undefined);
        if (now === undefined) sourceUnknown = true;
        else if (now.state !== 'running') frozenAt = freezing;
        throw err;
      }
      // From here the processes exist only in the source's pinned capture: a failure below loses the VM.
      frozenAt = freezing;
      await this.stepDone(
        vmId,
        'snapshot',
        { checkpoint_id: cpId, size_bytes: String(checkpoint.size_bytes), pause_ms: String(checkpoint.pause_ms ?? 0), lazy: 'true' },
        actor,
      );
      step = 'place';
      await this.stepDone(vmId, 'place', { host_id: targetId }, actor);

      step = 'move';
      const moveStarted = Date.now();
      if (!checkpoint.digest || !/^[0-9a-f]{64}$/.test(checkpoint.digest))
        throw new ConflictError('ARTIFACT_DIGEST_UNKNOWN', `checkpoint ${cpId} has no digest: a copy could not be verified`);
      // One grant for both: the checkpoint's files now, its pages from the restore on (checked when the page stream opens).
      const grant = await src.grantArtifact(cpId, 600);
      await dst.pullArtifact({
        snapshot_id: cpId,
        digest: checkpoint.digest,
        from: { url: source.url, grant: grant.grant, host_id: source.host_id },
        files: { ...checkpoint.files },
      });
      pulled = true;
      await this.stepDone(vmId, 'move', { host_id: targetId, duration_ms: String(Date.now() - moveStarted) }, actor);

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
          agent: vm.spec.agent ? { command: 'true', drainCommand: guest.drainCommand ?? '', files: {} } : undefined,
          reservation: placed.reservation,
        },
        {
          onCreated: () => (booted = true),
          create: (req) => dst.createLazyVm({ ...req, checkpoint_id: cpId, from: { url: source.url, grant: grant.grant } }),
        },
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
          lazy: 'true',
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
      const final = await this.vms.get(vmId, actor);
      this.logger.info({ vm_id: vmId, from: fromHostId, to: targetId, downtime_ms: downtimeMs }, 'vm lazily migrated; memory pages in');
      this.follow({ vmId, fromHostId, targetId, cpId, src, dst, startedAt: Date.now() }, actor);
      return { vm: final, position: switched.position, fromHostId, checkpointId: cpId, downtimeMs, readdressed, ip: info.ip };
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      if (isBooted()) await dstAgent.destroyVm(name, { force: true }).catch(() => undefined);
      if (pulled) await dstAgent.deleteCheckpoint(cpId).catch(() => undefined);
      await this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
      await this.record(
        vmId,
        { type: 'FailMigration', data: { vm_id: vmId, step, error: (err as Error).message, error_code: e?.code } },
        actor,
      ).catch(() => undefined);
      if (isSourceUnknown())
        throw new AppError(
          'MIGRATION_FAILED',
          e?.status ?? 502,
          `lazy migration of vm ${vmId} stopped at the freeze: ${(err as Error).message}, and host ${fromHostId} could not say whether the VM still runs; the reconciler will look at it`,
          { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, source: 'unknown', cause_code: e?.code },
          { cause: err },
        );
      if (frozenAt === undefined) {
        throw new AppError(
          'MIGRATION_FAILED',
          e?.status ?? 502,
          `lazy migration of vm ${vmId} stopped at step "${step}" before the freeze: ${(err as Error).message}. The VM runs on ${fromHostId}`,
          { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, source: 'running', cause_code: e?.code },
          { cause: err },
        );
      }
      await this.dropSource(src, fromHostId, vmId, cpId, actor);
      await this.failVm(
        vmId,
        'error',
        `a lazy migration to ${targetId} failed after the freeze, at step "${step}": ${(err as Error).message}`,
        'LAZY_MIGRATION_FAILED',
        actor,
      );
      throw new AppError(
        'MIGRATION_FAILED',
        e?.status ?? 502,
        `lazy migration of vm ${vmId} stopped at step "${step}" after the freeze: ${(err as Error).message}. Its processes were only in the source's pinned capture: the VM is lost (state failed)`,
        { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, source: 'lost', cause_code: e?.code },
        { cause: err },
      );
    }
  }

  /**
   * Picks up the page-in watch of a lazy migration past its switch that no
   * watch of this process follows (its control plane stopped or died mid
   * page-in; the reconciler asks, on each cycle that lists the source).
   * True while a watch of this process follows it. Two replicas may both
   * watch one page-in: each outcome is recorded at most once (the
   * migration decider refuses a second) and the source's teardown is
   * idempotent.
   */
  async adopt(vmId: string): Promise<boolean> {
    if (this.stopped) return false;
    if (this.watching.has(vmId)) return true;
    const m = await adoptableMove(this.migrationHandler, this.hosts, vmId);
    if (!m || !canServeLazily(m.source) || !canServeLazily(m.target)) return false;
    const src = lazyAgent(this.hosts.agentForState(m.source));
    const dst = lazyAgent(this.hosts.agentForState(m.target));
    if (!src || !dst) return false;
    // Checked again after the awaits: a watch may have started meanwhile.
    if (this.watching.has(vmId)) return true;
    this.logger.info({ vm_id: vmId, from: m.fromHostId, to: m.targetId }, 'lazy migration: page-in watch adopted');
    this.follow({ vmId, fromHostId: m.fromHostId, targetId: m.targetId, cpId: m.moveId, src, dst, startedAt: m.lastAt }, m.actor);
    return true;
  }

  private follow(m: Parameters<LazyMigrate['watch']>[0], actor: Actor): void {
    const watch = this.watch(m, actor)
      .catch((err: unknown) =>
        this.logger.error({ vm_id: m.vmId, err: { message: (err as Error).message } }, 'lazy migration watch failed'),
      )
      .finally(() => this.watching.delete(m.vmId));
    this.watching.set(m.vmId, watch);
  }

  /**
   * Shutdown: the watches stop where they are. The target keeps paging in
   * on its own and the source's capture ends once served; what the watch
   * would have done after (destroy the source, release its reservation,
   * record the end) is picked up by the next control plane's reconciler
   * (`adopt`).
   */
  async stop(): Promise<void> {
    this.stopped = true;
    await Promise.all(this.watching.values());
  }

  /**
   * After the switch: reads the target's memory status until every page is
   * resident (then the source goes), the stream breaks (the VM is lost with
   * its source), or the VM ends some other way (its leftovers go).
   */
  private async watch(
    m: {
      readonly vmId: string;
      readonly fromHostId: string;
      readonly targetId: string;
      readonly cpId: string;
      readonly src: LazyAgent;
      readonly dst: LazyAgent;
      readonly startedAt: number;
    },
    actor: Actor,
  ): Promise<void> {
    const { vmId, fromHostId, targetId, cpId, src, dst } = m;
    const name = sandboxName(vmId);
    const outcome = await followPageIn(
      {
        vmId,
        targetId,
        moveId: cpId,
        migrations: this.migrationHandler,
        vms: this.vms,
        logger: this.logger,
        isStopped: () => this.stopped,
        status: () => dst.memoryStatus(name, { timeoutMs: 10_000 }),
      },
      actor,
    );
    if (outcome.kind === 'stopped' || outcome.kind === 'not_ours') return;
    if (outcome.kind === 'vm_ended') {
      await this.dropSource(src, fromHostId, vmId, cpId, actor);
      await dst.deleteCheckpoint(cpId).catch(() => undefined);
      await this.record(
        vmId,
        {
          type: 'FailMigration',
          data: {
            vm_id: vmId,
            step: 'destroy_source',
            error: `vm ${vmId} ended (${outcome.vm.status}) before its memory was all on ${targetId}`,
            error_code: 'VM_ENDED',
          },
        },
        actor,
      ).catch(() => undefined);
      return;
    }
    if (outcome.kind === 'broken') {
      await this.lost(m, outcome.status, actor);
      return;
    }
    const last = outcome.status;

    // Every page is on the target: the source's capture has ended (criu exits once served); its sandbox and reservation go.
    const pagedMs = Date.now() - m.startedAt;
    let position: Position | undefined;
    try {
      await src.releaseLazyPages(cpId);
      await src.destroyVm(name, { force: true });
      await this.vms.releaseCapacity(fromHostId, vmId, actor);
      position = await this.stepDone(
        vmId,
        'destroy_source',
        {
          host_id: fromHostId,
          resident_chunks: String(last.resident_chunks),
          total_chunks: String(last.total_chunks),
          paged_ms: String(pagedMs),
        },
        actor,
      );
    } catch (err) {
      this.logger.warn(
        { vm_id: vmId, host_id: fromHostId, err: { message: (err as Error).message } },
        'lazily migrated, but the source was not destroyed; the reconciler will',
      );
    }
    await Promise.all(
      [src, dst].map((a) =>
        a
          .deleteCheckpoint(cpId)
          .catch((err: unknown) =>
            this.logger.warn({ checkpoint: cpId, err: { message: (err as Error).message } }, 'migrate checkpoint not deleted'),
          ),
      ),
    );
    position = (await this.stepDone(vmId, 'cleanup', { checkpoint_id: cpId }, actor).catch(() => undefined)) ?? position;
    this.logger.info(
      { vm_id: vmId, from: fromHostId, to: targetId, paged_ms: pagedMs, pages: last.total_chunks, position },
      'lazy migration done',
    );
  }

  /** The page stream broke before every page was in: the target has killed the processes; the VM is lost with its source. */
  private async lost(
    m: {
      readonly vmId: string;
      readonly fromHostId: string;
      readonly targetId: string;
      readonly cpId: string;
      readonly src: LazyAgent;
      readonly dst: LazyAgent;
    },
    status: MemoryStatus,
    actor: Actor,
  ): Promise<void> {
    const { vmId, fromHostId, targetId, cpId, src, dst } = m;
    const error = `its memory was still paged in from host ${fromHostId} when that stream broke (${status.error ?? 'no reason'}); ${status.resident_chunks} of ${status.total_chunks} pages had arrived: the VM is lost with its source`;
    this.logger.error({ vm_id: vmId, from: fromHostId, to: targetId, error }, 'lazy migration: source lost before done');
    await this.record(
      vmId,
      { type: 'FailMigration', data: { vm_id: vmId, step: 'destroy_source', error, error_code: LAZY_SOURCE_LOST } },
      actor,
    ).catch(() => undefined);
    await dst.destroyVm(sandboxName(vmId), { force: true }).catch(() => undefined);
    await dst.deleteCheckpoint(cpId).catch(() => undefined);
    await this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
    await this.failVm(vmId, 'host_lost', error, LAZY_SOURCE_LOST, actor);
    await this.dropSource(src, fromHostId, vmId, cpId, actor);
  }

  /** Ends the source's pinned capture and its paused sandbox, and frees its reservation (best effort: the host may be gone). */
  private async dropSource(src: LazyAgent, hostId: string, vmId: string, cpId: string, actor: Actor): Promise<void> {
    const quick = { timeoutMs: 10_000 };
    await src.releaseLazyPages(cpId, quick).catch(() => undefined);
    await src.destroyVm(sandboxName(vmId), { force: true, ...quick }).catch(() => undefined);
    await src.deleteCheckpoint(cpId, quick).catch(() => undefined);
    await this.vms.releaseCapacity(hostId, vmId, actor).catch(() => undefined);
  }

  private async failVm(vmId: string, reason: 'host_lost' | 'error', error: string, code: string, actor: Actor): Promise<void> {
    await this.vmHandler
      .handle(vmId, { type: 'FailVm', data: { vm_id: vmId, reason, error, error_code: code } }, actor)
      .catch((err: unknown) => this.logger.error({ vm_id: vmId, err: { message: (err as Error).message } }, 'lost vm not recorded failed'));
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
