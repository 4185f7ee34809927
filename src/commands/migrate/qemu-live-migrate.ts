import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError, ConflictError, NotFoundError, type VmInfo } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import type { HostAgent } from '../../domain/host-agent.port.js';
import type { HostState } from '../../domain/host/host.decider.js';
import { migrationAggregate, type MigrationCommand } from '../../domain/migration/migration.decider.js';
import type { MigrationStep } from '../../domain/migration/migration.events.js';
import { placementRequestOf } from '../../domain/vm/spec.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { Endpoint } from '../../domain/vm/vm.events.js';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer } from '../placement/place-and-reserve.js';
import { agentEgressOf } from '../vm/boot-sandbox.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import type { LiveMigrateResult } from './live-migrate.js';
import { adoptableMove, followPageIn } from './page-in-watch.js';
import { destroySource, switchToTarget } from './switch-host.js';

type Registered = Exclude<HostState, { status: 'unregistered' }>;
type NativeAgent = HostAgent &
  Required<Pick<HostAgent, 'migrationOffer' | 'prepareIncoming' | 'sendMigration' | 'completeIncoming' | 'abortIncoming'>>;
type Watched = {
  readonly vmId: string;
  readonly fromHostId: string;
  readonly targetId: string;
  readonly src: HostAgent;
  readonly dst: HostAgent;
};

/** A qemu host that can take a running guest's stream. */
export const receivesQemuMigration = (h: Registered): boolean => h.backend === 'qemu' && h.capacity.live_snapshot === true;

const native = (a: HostAgent): a is NativeAgent =>
  a.migrationOffer !== undefined &&
  a.prepareIncoming !== undefined &&
  a.sendMigration !== undefined &&
  a.completeIncoming !== undefined &&
  a.abortIncoming !== undefined;

/** The target gives up its listener (and what it prepared) if no stream landed by then. */
const INCOMING_TTL_S = 600;

/** The error code a VM lost with its post-copy source ends with (VmFailed, reason host_lost); the CRIU lazy path's code. */
const LAZY_SOURCE_LOST = 'LAZY_SOURCE_LOST';

/**
 * Live migration of a VM on a qemu host through QEMU's own migration, the
 * agents doing the streaming (docs/qemu-backend.md): the target is reserved
 * while the VM runs, then asked to build the source's machine and listen
 * under a key it mints for this one migration (a target that cannot is a
 * refusal; the VM never stopped). The control plane carries the key to the
 * source, whose QEMU streams memory and disk there in TLS while the guest
 * runs and stops it only for the last pages; the target then runs it as the
 * same VM (same id; its address when free there). A failed send leaves the
 * source running (QEMU resumes it itself); a failure after the send thaws
 * the stopped source, or with `keep_paused` leaves it stopped and paused.
 *
 * `lazy` (QEMU post-copy): the same steps, but the source switches the
 * stream to post-copy at once, so the guest runs on the target before its
 * memory is all there and the answer comes then; the target's QEMU pulls
 * each page it faults on while the source pushes the rest. The source's
 * QEMU holds the only copy of what has not arrived, so it stays (paused,
 * its reservation kept: the reconciler leaves a lazy move's source alone)
 * until the target's QEMU reports the stream completed; then it goes
 * (destroy_source). After the switch nothing can bring the guest back on
 * the source: a failure then, or a stream that breaks before it completed
 * (the source host or its QEMU lost), loses the VM, recorded failed
 * (host_lost, LAZY_SOURCE_LOST), with both sides removed.
 */
export class QemuLiveMigrate {
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;
  private readonly vmHandler: BoundOf<typeof vmAggregate>;
  /** Post-copy watches of this process, by VM. */
  private readonly watching = new Map<string, Promise<void>>();
  private stopped = false;

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
    source: Registered,
    opts: { target_host_id?: string | undefined; keep_paused: boolean; lazy?: boolean | undefined },
    actor: Actor,
  ): Promise<LiveMigrateResult> {
    const vmId = vm.vm_id;
    const lazy = opts.lazy === true;
    const refuse = (hostId: string, why: string): ConflictError =>
      new ConflictError(
        lazy ? 'LAZY_MIGRATION_TARGET_UNSUPPORTED' : 'LIVE_MIGRATION_TARGET_UNSUPPORTED',
        `host ${hostId} cannot receive a running qemu VM${lazy ? ' lazily' : ''} (${why}); nothing moved: vm ${vmId} still runs on ${fromHostId}`,
        { vm_id: vmId, host_id: hostId, reason: why },
      );
    if (lazy && source.capacity.lazy_pages !== true)
      throw new ConflictError(
        'LAZY_MIGRATION_UNSUPPORTED',
        `a lazy migration needs post-copy on the source (capacity lazy_pages: userfaultfd); host ${fromHostId} has none. The VM is still running on ${fromHostId}; migrate with lazy: false`,
        { vm_id: vmId, host_id: fromHostId },
      );
    if (opts.target_host_id !== undefined) {
      const { state: t } = await this.hosts.load(opts.target_host_id);
      if (t.status === 'unregistered')
        throw new NotFoundError('HOST_NOT_FOUND', `host ${opts.target_host_id} is not registered`, { host_id: opts.target_host_id });
      if (!receivesQemuMigration(t))
        throw refuse(opts.target_host_id, t.backend === 'qemu' ? 'no live snapshots' : `it runs the ${t.backend} backend`);
      // The receiving QEMU registers the guest's memory with userfaultfd before the stream starts: without it post-copy cannot begin.
      if (lazy && t.capacity.lazy_pages !== true) throw refuse(opts.target_host_id, 'no lazy_pages: post-copy needs userfaultfd');
    }
    const src = this.hosts.agentForState(source);
    if (!native(src)) throw refuse(fromHostId, 'its agent client has no native migration');
    const unfit = new Set([fromHostId]);
    for (const h of await this.placer.hosts())
      if (h.backend !== 'qemu' || h.capacity.live_snapshot !== true || (lazy && h.capacity.lazy_pages !== true)) unfit.add(h.id);
    const placed = await this.placer.placeAndReserve(
      vmId,
      {
        ...placementRequestOf(vm.spec),
        host_id: undefined,
        pinned_host_id: undefined,
        ...(opts.target_host_id ? { host_id: opts.target_host_id } : {}),
      },
      vm.spec,
      actor,
      { excludeHosts: unfit, holdKey: `${vmId}-migrate` },
    );
    const targetId = placed.hostId;
    const release = (): Promise<void> => this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
    const dst = await this.hosts.agentFor(targetId).catch(async (err: unknown) => {
      await release();
      throw err;
    });
    if (!native(dst)) {
      await release();
      throw refuse(targetId, 'its agent client has no native migration');
    }
    try {
      await this.record(
        vmId,
        {
          type: 'StartMigration',
          data: { vm_id: vmId, from_host_id: fromHostId, target_host_id: targetId, live: true, ...(lazy ? { lazy: true } : {}) },
        },
        actor,
      );
    } catch (err) {
      await release();
      throw err;
    }

    const name = sandboxName(vmId);
    const migrationId = `qemu-${lazy ? 'lazy' : 'migrate'}-${vmId}-${randomBytes(4).toString('hex')}`;
    let step: MigrationStep = 'place';
    let prepared = false;
    let sent = false;
    let switchedOver = false;
    try {
      const wantIp = (await src.getVm(name)).ip;
      const offer = await src.migrationOffer(name);
      const guest = this.vms.openGuestInputs(vm);
      const spec = vm.spec;
      const expose = [...(spec.agent?.expose ?? []), ...(spec.expose ?? [])];
      const incoming = await dst
        .prepareIncoming({
          vm: {
            name,
            ...(spec.image ? { image: spec.image } : {}),
            cpus: spec.cpus,
            ram_mb: spec.ram_mb,
            storage_gb: spec.storage_gb,
            tenant: vm.tenant_id,
            expose,
            ...(spec.net_raw ? { net_raw: true } : {}),
            egress: agentEgressOf(spec.egress),
            env: guest.secrets,
            ...(wantIp ? { ip_hint: wantIp } : {}),
          },
          machine: offer.machine,
          ttl_s: INCOMING_TTL_S,
          lazy,
        })
        .catch((err: unknown) => {
          // The target's own answer that it cannot build this machine (another QEMU or image build, a size it lacks): a refusal.
          if (err instanceof AppError && err.status >= 400 && err.status < 500) throw refuse(targetId, `${err.code}: ${err.message}`);
          throw err;
        });
      prepared = true;
      await this.stepDone(vmId, 'place', { host_id: targetId, listener: incoming.uri, migration_id: migrationId }, actor);

      step = 'move';
      const sendStarted = Date.now();
      // The key goes to the source and nowhere else: it is in no event, log or answer.
      // Lazy: answered at the switch to post-copy, the guest stopped on the source and its memory still mostly there.
      const report = await src.sendMigration(name, { to: { uri: incoming.uri, psk: incoming.psk }, lazy });
      const sentAt = Date.now();
      sent = true;

      step = 'boot';
      const info = await dst.completeIncoming(name, { keep_paused: false });
      // QEMU's stop-and-copy, then the target's load, `cont` and its guest agent answering: all the while the guest ran nowhere.
      const downtimeMs = Math.round(report.downtime_ms) + (Date.now() - sentAt);
      let endpoints = endpointsOf(info);
      if (spec.agent) {
        // The in-guest agent travelled in the guest's memory: only its ports and drain command are registered on the target.
        const started = await dst.startAgent(name, { files: {}, command: 'true', drain_command: guest.drainCommand ?? '', expose });
        endpoints = started.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol }));
      }
      await this.stepDone(
        vmId,
        'move',
        {
          host_id: targetId,
          duration_ms: String(sentAt - sendStarted),
          transferred_bytes: String(report.transferred_bytes),
          qemu_downtime_ms: String(Math.round(report.downtime_ms)),
          ...(lazy ? { lazy: 'true' } : {}),
        },
        actor,
      );
      const readdressed = wantIp !== undefined && info.ip !== wantIp;
      await this.stepDone(
        vmId,
        'boot',
        {
          host_id: targetId,
          ip: info.ip ?? '',
          readdressed: String(readdressed),
          ...(lazy ? { lazy: 'true' } : {}),
          ...(readdressed && wantIp ? { previous_ip: wantIp } : {}),
        },
        actor,
        downtimeMs,
      );

      step = 'switch';
      const switched = await switchToTarget(
        { vmHandler: this.vmHandler, vms: this.vms, logger: this.logger },
        { vmId, fromHostId, placed, snapshotId: migrationId, ip: info.ip, endpoints },
        actor,
      );
      prepared = false;
      switchedOver = true;

      if (lazy) {
        const final = await this.vms.get(vmId, actor);
        this.logger.info(
          { vm_id: vmId, from: fromHostId, to: targetId, downtime_ms: downtimeMs },
          'qemu vm lazily migrated; memory pages in',
        );
        this.follow({ vmId, fromHostId, targetId, src, dst }, migrationId, Date.now(), actor);
        return { vm: final, position: switched.position, fromHostId, checkpointId: migrationId, downtimeMs, readdressed, ip: info.ip };
      }

      // The VM runs on the target: what follows only removes the stopped source (the reconciler collects what fails).
      step = 'destroy_source';
      await destroySource(
        { vms: this.vms, logger: this.logger },
        { vmId, name, fromHostId, source: () => src },
        () => this.stepDone(vmId, 'destroy_source', { host_id: fromHostId }, actor),
        actor,
        'live-migrated, but the stopped source was not destroyed',
      );
      step = 'cleanup';
      const done = await this.stepDone(vmId, 'cleanup', { migration_id: migrationId }, actor);
      const final = await this.vms.get(vmId, actor);
      this.logger.info(
        { vm_id: vmId, from: fromHostId, to: targetId, downtime_ms: downtimeMs, readdressed, bytes: report.transferred_bytes },
        'qemu vm live-migrated',
      );
      return {
        vm: final,
        position: done ?? switched.position,
        fromHostId,
        checkpointId: migrationId,
        downtimeMs,
        readdressed,
        ip: info.ip,
      };
    } catch (err) {
      // Recorded on the target: nothing to undo (the reservation there is the VM's own now).
      if (switchedOver) throw err;
      const e = err instanceof AppError ? err : undefined;
      // A send whose answer was lost (timeout, dropped connection) may still have finished: the source's own state says.
      if (step === 'move' && !sent) sent = (await src.getVm(name).catch(() => undefined))?.state === 'paused';
      if (prepared) {
        // Not landed: its listener and address go now, not at the ttl. Landed (a later step failed): the VM goes.
        await dst.abortIncoming(name).catch(() => undefined);
        await dst.destroyVm(name, { force: true }).catch(() => undefined);
      }
      await release();
      // Before the send finished QEMU kept (or put back) the guest running on the source; after it, the source is stopped.
      // After a switch to post-copy the source's QEMU is no longer the guest's: it only serves pages, and nothing resumes it.
      const where =
        sent && lazy
          ? await this.lostAfterSwitch(vmId, fromHostId, src, `at step "${step}": ${(err as Error).message}`, actor)
          : sent
            ? await this.afterSendFailed(vm, fromHostId, src, opts.keep_paused, actor)
            : 'running';
      await this.record(
        vmId,
        { type: 'FailMigration', data: { vm_id: vmId, step, error: (err as Error).message, error_code: e?.code } },
        actor,
      ).catch(() => undefined);
      if (e?.code === 'LIVE_MIGRATION_TARGET_UNSUPPORTED') throw e;
      const said =
        where === 'running'
          ? `The VM runs on ${fromHostId}`
          : where === 'paused'
            ? `The VM is paused on ${fromHostId} (keep_paused): POST /v1/vms/${vmId}/resume runs it`
            : where === 'lost'
              ? `It had switched to post-copy, so its memory was split between the hosts: the VM is lost (state failed)`
              : `The VM could not be resumed on ${fromHostId}; the reconciler will look at it`;
      throw new AppError(
        'MIGRATION_FAILED',
        e?.status ?? 502,
        `${lazy ? 'lazy' : 'live'} migration of vm ${vmId} stopped at step "${step}": ${(err as Error).message}. ${said}`,
        { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, source: where, cause_code: e?.code },
        { cause: err },
      );
    }
  }

  /** One watch per VM in this process; a finished watch removes its own entry only. */
  private follow(w: Watched, migrationId: string, startedAt: number, actor: Actor): void {
    if (this.watching.has(w.vmId)) return;
    const watch: Promise<void> = this.watch(w, migrationId, startedAt, actor)
      .catch((err: unknown) =>
        this.logger.error({ vm_id: w.vmId, err: { message: (err as Error).message } }, 'qemu post-copy watch failed'),
      )
      .finally(() => {
        if (this.watching.get(w.vmId) === watch) this.watching.delete(w.vmId);
      });
    this.watching.set(w.vmId, watch);
  }

  /**
   * Picks up the watch of a qemu post-copy move past its switch that no
   * watch of this process follows (its control plane stopped mid-stream;
   * the reconciler asks). True while a watch of this process follows it;
   * as with LazyMigrate.adopt, two replicas watching one move record its
   * end once.
   */
  async adopt(vmId: string): Promise<boolean> {
    if (this.stopped) return false;
    if (this.watching.has(vmId)) return true;
    const m = await adoptableMove(this.migrationHandler, this.hosts, vmId);
    if (!m || m.source.status === 'unregistered' || m.target.status === 'unregistered') return false;
    if (m.source.backend !== 'qemu' || m.target.backend !== 'qemu') return false;
    if (this.watching.has(vmId)) return true;
    this.logger.info({ vm_id: vmId, from: m.fromHostId, to: m.targetId }, 'qemu post-copy: watch adopted');
    this.follow(
      {
        vmId,
        fromHostId: m.fromHostId,
        targetId: m.targetId,
        src: this.hosts.agentForState(m.source),
        dst: this.hosts.agentForState(m.target),
      },
      m.moveId,
      m.lastAt,
      m.actor,
    );
    return true;
  }

  /**
   * Shutdown: the watches stop where they are. The two QEMUs finish the
   * post-copy stream on their own; the next control plane's reconciler
   * adopts the watch (`adopt`), which ends the move.
   */
  async stop(): Promise<void> {
    this.stopped = true;
    await Promise.all(this.watching.values());
  }

  /**
   * After a lazy switch: asks the target's QEMU (the agent's memory status)
   * until the post-copy stream completed (then the source goes), broke (the
   * VM is lost with its source), or the VM ended some other way.
   */
  private async watch(m: Watched, migrationId: string, startedAt: number, actor: Actor): Promise<void> {
    const { vmId, fromHostId, targetId, src, dst } = m;
    const name = sandboxName(vmId);
    const outcome = await followPageIn(
      {
        vmId,
        targetId,
        moveId: migrationId,
        migrations: this.migrationHandler,
        vms: this.vms,
        logger: this.logger,
        isStopped: () => this.stopped,
        status: () => {
          if (!dst.memoryStatus)
            throw new AppError('LAZY_PAGES_UNSUPPORTED', 409, `the agent client of ${targetId} reads no memory status`);
          return dst.memoryStatus(name, { timeoutMs: 10_000 });
        },
      },
      actor,
    );
    if (outcome.kind === 'stopped' || outcome.kind === 'not_ours') return;
    if (outcome.kind === 'vm_ended') {
      // Destroyed (or failed) on the target: the source's pages have nobody left to serve.
      await this.dropSource(src, fromHostId, vmId, actor);
      await this.failMigration(vmId, `vm ${vmId} ended (${outcome.vm.status}) before its memory was all on ${targetId}`, 'VM_ENDED', actor);
      return;
    }
    if (outcome.kind === 'broken') {
      await this.lost(
        m,
        `its memory was still coming from host ${fromHostId} by post-copy: ${outcome.status.error ?? 'no reason'}. The VM is lost with its source`,
        actor,
      );
      return;
    }

    // Every page is on the target: the source's QEMU has nothing left to serve.
    const pagedMs = Date.now() - startedAt;
    await destroySource(
      { vms: this.vms, logger: this.logger },
      { vmId, name, fromHostId, source: () => src },
      () => this.stepDone(vmId, 'destroy_source', { host_id: fromHostId, lazy: 'true', paged_ms: String(pagedMs) }, actor),
      actor,
      'lazily migrated, but the source was not destroyed',
    );
    const position = await this.stepDone(vmId, 'cleanup', { migration_id: migrationId }, actor).catch(() => undefined);
    this.logger.info({ vm_id: vmId, from: fromHostId, to: targetId, paged_ms: pagedMs, position }, 'qemu lazy migration done');
  }

  /** The post-copy stream broke before it completed: the target's guest waits for pages that will not come. */
  private async lost(m: Watched, error: string, actor: Actor): Promise<void> {
    const { vmId, fromHostId, targetId, src, dst } = m;
    this.logger.error({ vm_id: vmId, from: fromHostId, to: targetId, error }, 'qemu post-copy: source lost before done');
    await this.failMigration(vmId, error, LAZY_SOURCE_LOST, actor);
    await dst.destroyVm(sandboxName(vmId), { force: true }).catch(() => undefined);
    await this.vms.releaseCapacity(targetId, vmId, actor).catch(() => undefined);
    await this.failVm(vmId, 'host_lost', error, LAZY_SOURCE_LOST, actor);
    await this.dropSource(src, fromHostId, vmId, actor);
  }

  /** A failure after the switch to post-copy but before the switch to the target was recorded: the VM is lost. */
  private async lostAfterSwitch(vmId: string, fromHostId: string, src: HostAgent, why: string, actor: Actor): Promise<'lost'> {
    await this.dropSource(src, fromHostId, vmId, actor);
    await this.failVm(
      vmId,
      'error',
      `a lazy migration failed after its switch to post-copy, ${why}: the guest's memory was split between the hosts`,
      'LAZY_MIGRATION_FAILED',
      actor,
    );
    return 'lost';
  }

  /** The source's QEMU and sandbox go and its reservation is freed (best effort: the host may be gone). */
  private async dropSource(src: HostAgent, hostId: string, vmId: string, actor: Actor): Promise<void> {
    await src.destroyVm(sandboxName(vmId), { force: true, timeoutMs: 30_000 }).catch(() => undefined);
    await this.vms.releaseCapacity(hostId, vmId, actor).catch(() => undefined);
  }

  private async failMigration(vmId: string, error: string, code: string, actor: Actor): Promise<void> {
    await this.record(vmId, { type: 'FailMigration', data: { vm_id: vmId, step: 'destroy_source', error, error_code: code } }, actor).catch(
      () => undefined,
    );
  }

  private async failVm(vmId: string, reason: 'host_lost' | 'error', error: string, code: string, actor: Actor): Promise<void> {
    await this.vmHandler
      .handle(vmId, { type: 'FailVm', data: { vm_id: vmId, reason, error, error_code: code } }, actor)
      .catch((err: unknown) => this.logger.error({ vm_id: vmId, err: { message: (err as Error).message } }, 'lost vm not recorded failed'));
  }

  /**
   * The source after its guest was sent: stopped in its QEMU, memory and disk intact. Thawed where
   * it stopped, or with `keep_paused` recorded paused (no checkpoint: the stopped QEMU holds the
   * state, and a resume on this host thaws it).
   */
  private async afterSendFailed(
    vm: ExistingVmState,
    hostId: string,
    src: HostAgent,
    keepPaused: boolean,
    actor: Actor,
  ): Promise<'running' | 'paused' | 'unknown'> {
    try {
      if (keepPaused) {
        await this.vmHandler.handle(vm.vm_id, { type: 'PauseVm', data: { vm_id: vm.vm_id, checkpoint_id: '', pause_ms: 0 } }, actor);
        await this.vms.releaseCapacity(hostId, vm.vm_id, actor);
        return 'paused';
      }
      await src.resumeVm(sandboxName(vm.vm_id));
      return 'running';
    } catch (err) {
      this.logger.error(
        { vm_id: vm.vm_id, err: { message: (err as Error).message } },
        'a failed qemu live migration left its source stopped',
      );
      return 'unknown';
    }
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

function endpointsOf(info: VmInfo): Endpoint[] {
  return info.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol }));
}
