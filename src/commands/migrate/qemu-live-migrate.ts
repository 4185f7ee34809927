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
import { destroySource, switchToTarget } from './switch-host.js';

type Registered = Exclude<HostState, { status: 'unregistered' }>;
type NativeAgent = HostAgent &
  Required<Pick<HostAgent, 'migrationOffer' | 'prepareIncoming' | 'sendMigration' | 'completeIncoming' | 'abortIncoming'>>;

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
 */
export class QemuLiveMigrate {
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;
  private readonly vmHandler: BoundOf<typeof vmAggregate>;

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
    opts: { target_host_id?: string | undefined; keep_paused: boolean },
    actor: Actor,
  ): Promise<LiveMigrateResult> {
    const vmId = vm.vm_id;
    const refuse = (hostId: string, why: string): ConflictError =>
      new ConflictError(
        'LIVE_MIGRATION_TARGET_UNSUPPORTED',
        `host ${hostId} cannot receive a running qemu VM (${why}); nothing moved: vm ${vmId} still runs on ${fromHostId}`,
        { vm_id: vmId, host_id: hostId },
      );
    if (opts.target_host_id !== undefined) {
      const { state: t } = await this.hosts.load(opts.target_host_id);
      if (t.status === 'unregistered')
        throw new NotFoundError('HOST_NOT_FOUND', `host ${opts.target_host_id} is not registered`, { host_id: opts.target_host_id });
      if (!receivesQemuMigration(t))
        throw refuse(opts.target_host_id, t.backend === 'qemu' ? 'no live snapshots' : `it runs the ${t.backend} backend`);
    }
    const src = this.hosts.agentForState(source);
    if (!native(src)) throw refuse(fromHostId, 'its agent client has no native migration');
    const unfit = new Set([fromHostId]);
    for (const h of await this.placer.hosts()) if (h.backend !== 'qemu' || h.capacity.live_snapshot !== true) unfit.add(h.id);
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
        { type: 'StartMigration', data: { vm_id: vmId, from_host_id: fromHostId, target_host_id: targetId, live: true } },
        actor,
      );
    } catch (err) {
      await release();
      throw err;
    }

    const name = sandboxName(vmId);
    const migrationId = `qemu-migrate-${vmId}-${randomBytes(4).toString('hex')}`;
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
        })
        .catch((err: unknown) => {
          // The target's own answer that it cannot build this machine (another QEMU or image build, a size it lacks): a refusal.
          if (err instanceof AppError && err.status >= 400 && err.status < 500) throw refuse(targetId, `${err.code}: ${err.message}`);
          throw err;
        });
      prepared = true;
      await this.stepDone(vmId, 'place', { host_id: targetId, listener: incoming.uri }, actor);

      step = 'move';
      const sendStarted = Date.now();
      // The key goes to the source and nowhere else: it is in no event, log or answer.
      const report = await src.sendMigration(name, { to: { uri: incoming.uri, psk: incoming.psk }, lazy: false });
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
      const where = sent ? await this.afterSendFailed(vm, fromHostId, src, opts.keep_paused, actor) : 'running';
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
            : `The VM could not be resumed on ${fromHostId}; the reconciler will look at it`;
      throw new AppError(
        'MIGRATION_FAILED',
        e?.status ?? 502,
        `live migration of vm ${vmId} stopped at step "${step}": ${(err as Error).message}. ${said}`,
        { vm_id: vmId, step, from_host_id: fromHostId, target_host_id: targetId, source: where, cause_code: e?.code },
        { cause: err },
      );
    }
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
