import { randomUUID } from 'node:crypto';
import { DeadLetters } from '../dead-letters/dead-letters.js';
import { HealthProbes } from './health-probes.js';
import {
  emptySummary,
  errInfo,
  type LiveVmHint,
  type ReconcileReadModel,
  type ReconcilerConfig,
  type ReconcileSummary,
} from './reconcile-types.js';
export type {
  LiveVmHint,
  ReconcileReadModel,
  ReconcilerConfig,
  ReconcileSummary,
  SummaryCounter,
  VmHealthcheck,
} from './reconcile-types.js';
export { deadLetterId } from '../dead-letters/dead-letters.js';
import {
  decideVm,
  isAbandonedRequest,
  isOrphan,
  isStaleReservation,
  suspect,
  type MigrationInFlight,
  type VmHint,
} from '../../domain/reconcile/reconcile.js';
import { assertNever } from '../../domain/decider.js';
import { bindAggregate, type BoundOf } from '../command-handler.js';
import { hostAggregate } from '../../domain/host/host.aggregate.js';
import { migrationAggregate } from '../../domain/migration/migration.decider.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { Logger } from 'pino';
import { type DeadLetterState } from '../../domain/deadletter/deadletter.decider.js';

import { classifyHostAgentError, type HostAgent } from '../../domain/host-agent.port.js';
import { type HostCommand } from '../../domain/host/host.decider.js';

import { isValidId } from '../../domain/ids.js';
import { isTerminal, vmDecider, type ExistingVmState, type VmCommand, type VmState } from '../../domain/vm/vm.decider.js';
import type { CommandHandler, CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import { SANDBOX_PREFIX, sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';

const SYSTEM: Actor = { correlationId: 'reconciler', actor: 'reconciler', tenantId: 'system', admin: true };

/**
 * The reconcile loop: every interval, per host, compares what the streams
 * say with what the agent lists and repairs the difference — orphans
 * destroyed (dead-lettered after repeated failures), missing VMs failed,
 * stuck and idle VMs ended, work a crashed control plane left half done
 * rolled back or completed, reservations of VMs that no longer hold a
 * sandbox released, unanswering hosts marked unreachable and back.
 *
 * It keeps no state that matters across restarts: everything is re-read
 * from the streams each cycle (counters of consecutive failures restart at
 * zero on another replica, which only delays a dead letter). Every action is
 * a command appended at the revision it was decided on, so a second
 * reconciler or a racing API call costs a retry, never a wrong state.
 */
export class Reconciler {
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<void> | undefined;
  private active = false;
  /** Bumped by each start(): a cycle of an earlier run must not reschedule itself (a lease lost and re-won mid-cycle). */
  private generation = 0;
  private cycleNo = 0;
  private last: ReconcileSummary | undefined;
  private readonly hostMisses = new Map<string, number>();
  /** VMs seen absent from their host's listing: failed `missing` only on the second listing in a row. */
  private readonly absent = new Map<string, number>();
  private readonly health: HealthProbes;
  private readonly deadLetters: DeadLetters;

  private readonly hostHandler: BoundOf<typeof hostAggregate>;
  private readonly migrationHandler: BoundOf<typeof migrationAggregate>;
  private readonly vmHandler: BoundOf<typeof vmAggregate>;

  constructor(
    private readonly handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly vms: VmCommands,
    private readonly readModel: ReconcileReadModel,
    private readonly config: ReconcilerConfig,
    private readonly logger: Logger,
    private readonly onCycle: (summary: ReconcileSummary) => void = () => undefined,
    private readonly clock: () => Date = () => new Date(),
  ) {
    this.hostHandler = bindAggregate(handler, hostAggregate);
    this.migrationHandler = bindAggregate(handler, migrationAggregate);
    this.vmHandler = bindAggregate(handler, vmAggregate);
    this.health = new HealthProbes(handler, config, logger, clock);
    this.deadLetters = new DeadLetters(handler, hosts, (id) => this.loadVm(id), config, logger, clock);
  }

  get isActive(): boolean {
    return this.active;
  }

  get lastSummary(): ReconcileSummary | undefined {
    return this.last;
  }

  /** Starts cycling (first cycle at once). Called when this replica takes the lease. */
  start(): void {
    if (this.active) return;
    this.active = true;
    const generation = ++this.generation;
    this.logger.info({ interval_ms: this.config.intervalMs }, 'reconciler started');
    void (this.running ?? Promise.resolve()).then(() => this.schedule(0, generation));
  }

  /** Stops cycling and waits for a cycle in flight. Called on shutdown or when the lease is lost. */
  async stop(): Promise<void> {
    if (!this.active) return;
    this.active = false;
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    await this.running?.catch(() => undefined);
    this.logger.info('reconciler stopped');
  }

  private schedule(ms: number, generation: number): void {
    if (!this.active || generation !== this.generation) return;
    this.timer = setTimeout(() => {
      this.running = this.reconcileOnce()
        .then(() => undefined)
        .catch((err: unknown) => this.logger.error({ err }, 'reconcile cycle failed'))
        .finally(() => {
          this.running = undefined;
          this.schedule(this.config.intervalMs, generation);
        });
    }, ms);
    this.timer.unref();
  }

  /** One full cycle over every host. Public for tests and for an operator-triggered run. */
  async reconcileOnce(): Promise<ReconcileSummary> {
    const started = this.clock();
    const s = emptySummary(++this.cycleNo, started);
    const meta: CommandMeta = { correlationId: `reconcile-${randomUUID()}`, actor: 'reconciler', tenantId: 'system' };
    const actor: Actor = { ...SYSTEM, correlationId: meta.correlationId };

    // Read the hints BEFORE listing agents: a VM running before a listing must appear in it.
    const [hostIds, live] = await Promise.all([this.readModel.hostIds(), this.readModel.liveVms()]);
    s.tracked_vms = live.length;
    const liveIds = new Set(live.map((v) => v.id));
    this.health.keepOnly(liveIds);
    for (const id of this.absent.keys()) if (!liveIds.has(id)) this.absent.delete(id);
    const byHost = new Map<string, LiveVmHint[]>();
    for (const v of live) {
      if (!v.host_id) continue;
      const list = byHost.get(v.host_id) ?? [];
      list.push(v);
      byHost.set(v.host_id, list);
    }

    await this.abandonedRequests(live, s, actor);
    await this.vmsOfDeregisteredHosts(live, new Set(hostIds), s, actor);
    await Promise.all(
      hostIds.map((hostId) =>
        this.reconcileHost(hostId, byHost.get(hostId) ?? [], s, actor).catch((err: unknown) => {
          s.errors++;
          this.logger.warn({ host_id: hostId, err: errInfo(err) }, 'reconcile of host failed');
        }),
      ),
    );
    s.duration_ms = this.clock().getTime() - started.getTime();
    this.last = s;
    this.logger[s.errors > 0 ? 'warn' : 'info']({ summary: s }, 'reconcile cycle');
    this.onCycle(s);
    return s;
  }

  /** VMs still `requested` past the grace: the control plane died before (or while) reserving. */
  private async abandonedRequests(live: readonly LiveVmHint[], s: ReconcileSummary, actor: Actor): Promise<void> {
    const now = this.clock().getTime();
    for (const hint of live) {
      if (hint.state !== 'requested' || now - hint.state_changed_at.getTime() < this.config.halfDoneGraceMs) continue;
      try {
        const vm = await this.loadVm(hint.id);
        if (!isAbandonedRequest(vm, now, this.config)) continue;
        await this.runVm(
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
  private async vmsOfDeregisteredHosts(
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
        const vm = await this.loadVm(hint.id);
        if (vm.status === 'initial' || isTerminal(vm.status) || vm.host_id !== hint.host_id) continue;
        await this.runVm(
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

  private async reconcileHost(hostId: string, hints: readonly LiveVmHint[], s: ReconcileSummary, actor: Actor): Promise<void> {
    const { state: host } = await this.hosts.load(hostId);
    if (host.status === 'unregistered' || host.status === 'deregistered') return;
    s.hosts_checked++;
    const agent = this.hosts.agentForState(host);

    const listStarted = this.clock().getTime();
    let listed: Set<string>;
    /** Listed sandboxes whose init is no longer running. */
    let stopped: Set<string>;
    try {
      const vms = (await agent.listVms(SANDBOX_PREFIX, { timeoutMs: this.config.agentTimeoutMs })).filter((v) =>
        v.name.startsWith(SANDBOX_PREFIX),
      );
      listed = new Set(vms.map((v) => v.name));
      stopped = new Set(vms.filter((v) => v.state === 'stopped').map((v) => v.name));
    } catch (err) {
      if (classifyHostAgentError(err) !== 'host') {
        // It answered, with a refusal (a token that no longer matches, an agent without the route): reachable, but nothing to compare.
        s.errors++;
        this.logger.error({ host_id: hostId, err: errInfo(err) }, 'host agent refused the reconciler listing; host skipped this cycle');
        return;
      }
      s.hosts_unanswered++;
      const misses = (this.hostMisses.get(hostId) ?? 0) + 1;
      this.hostMisses.set(hostId, misses);
      this.logger.warn({ host_id: hostId, misses, err: errInfo(err) }, 'host agent did not answer the reconciler');
      if (misses >= this.config.hostUnreachableAfterCycles && host.reachable) {
        await this.runHost(
          hostId,
          {
            type: 'MarkHostUnreachable',
            data: { host_id: hostId, reason: `agent did not answer ${misses} reconcile cycles in a row: ${(err as Error).message}` },
          },
          actor,
        );
        s.hosts_marked_unreachable++;
        this.logger.warn({ host_id: hostId, misses }, 'host marked unreachable');
      }
      return;
    }
    this.hostMisses.delete(hostId);
    if (!host.reachable) {
      await this.runHost(hostId, { type: 'MarkHostReachable', data: { host_id: hostId } }, actor);
      s.hosts_recovered++;
      this.logger.info({ host_id: hostId }, 'host answers again: marked reachable');
    }
    s.provider_vms += listed.size;
    const gone = new Set<string>();
    const now = this.clock().getTime();

    // Orphans: a listed sandbox whose VM is not live on this host.
    const liveHere = new Set(hints.map((h) => sandboxName(h.id)));
    for (const name of listed) {
      if (liveHere.has(name)) continue;
      const vmId = name.slice(SANDBOX_PREFIX.length);
      const vm = isValidId(vmId) ? await this.loadVm(vmId) : vmDecider.initialState;
      const migration = isValidId(vmId) ? await this.loadMigration(vmId) : undefined;
      if (!isOrphan(vm, migration, hostId, now, this.config)) continue;
      if (await this.deadLetters.destroyOrphan(hostId, agent, name, vm.status === 'initial' ? undefined : vm.vm_id, s, actor))
        gone.add(name);
    }

    for (const hint of hints) {
      try {
        await this.reconcileVm(hostId, agent, hint, listed, stopped, listStarted, now, gone, s, actor);
      } catch (err) {
        s.errors++;
        this.logger.warn({ vm_id: hint.id, host_id: hostId, err: errInfo(err) }, 'reconcile of vm failed');
      }
    }

    await this.releaseStaleReservations(hostId, listed, gone, s, actor);

    await this.reassertNetwork(hostId, agent, s);

    const probed = hints.filter(
      (h) => h.state === 'running' && h.healthcheck && listed.has(sandboxName(h.id)) && !gone.has(sandboxName(h.id)),
    );
    await Promise.all(
      probed.map((h) =>
        this.health.probe(agent, h, s, actor).catch((err: unknown) => {
          s.errors++;
          this.logger.warn({ vm_id: h.id, err: errInfo(err) }, 'health probe could not be recorded');
        }),
      ),
    );
  }

  /**
   * The host puts its sandbox network boundary back wherever something
   * changed it since the last cycle (a sysctl reload, a hand-edited ruleset);
   * the repairs are counted, and each one is a finding worth a look.
   */
  private async reassertNetwork(hostId: string, agent: HostAgent, s: ReconcileSummary): Promise<void> {
    try {
      const r = await agent.reassertNetwork({ timeoutMs: this.config.agentTimeoutMs });
      s.network_repairs += r.repaired;
      if (r.repaired > 0) this.logger.warn({ host_id: hostId, repairs: r.repairs }, 'host network boundary had drifted: repaired');
    } catch (err) {
      s.errors++;
      this.logger.warn({ host_id: hostId, err: errInfo(err) }, 'host could not reassert its network boundary');
    }
  }

  private async reconcileVm(
    hostId: string,
    agent: HostAgent,
    hint: LiveVmHint,
    listed: ReadonlySet<string>,
    stopped: ReadonlySet<string>,
    listStarted: number,
    now: number,
    gone: Set<string>,
    s: ReconcileSummary,
    actor: Actor,
  ): Promise<void> {
    const name = sandboxName(hint.id);
    const listedHere = listed.has(name);
    if (hint.state === 'running' && listedHere) this.absent.delete(hint.id);
    const suspicion = suspect(vmHintOf(hint), listedHere, now, this.config, stopped.has(name));
    if (suspicion === undefined) return;
    if (suspicion === 'stuck') s.stuck_tasks_suspected++;
    if (suspicion === 'idle') s.idle_vms_suspected++;
    const vm = await this.loadVm(hint.id);
    const verdict = decideVm(
      suspicion,
      vmHintOf(hint),
      vm,
      {
        hostId,
        listed: listedHere,
        listStarted,
        now,
        absentBefore: this.absent.get(hint.id) ?? 0,
        // The agent protocol reports no exit code yet: the VM ends `exited` without one until the host says more.
        stopped: stopped.has(name) ? {} : undefined,
      },
      this.config,
    );
    switch (verdict.kind) {
      case 'none':
        return;
      case 'absent_once':
        this.absent.set(hint.id, (this.absent.get(hint.id) ?? 0) + 1);
        this.logger.info(
          { vm_id: hint.id, host_id: hostId },
          'running vm not listed by its host; failed as missing if still absent next cycle',
        );
        return;
      case 'fail_missing':
        this.absent.delete(hint.id);
        await this.runVm(
          hint.id,
          {
            type: 'FailVm',
            data: {
              vm_id: hint.id,
              reason: 'host_lost',
              error: `host ${hostId} no longer lists sandbox ${name}`,
              error_code: 'SANDBOX_MISSING',
            },
          },
          actor,
        );
        s.vms_missing_provider++;
        gone.add(name);
        this.logger.warn({ vm_id: hint.id, host_id: hostId }, 'running vm missing from its host: failed');
        return;
      case 'fail_stuck':
        await this.runVm(
          hint.id,
          { type: 'FailVm', data: { vm_id: hint.id, reason: verdict.reason, error: verdict.error, error_code: verdict.code } },
          actor,
        );
        s.stuck_tasks_failed++;
        this.logger.warn({ vm_id: hint.id, host_id: hostId, reason: verdict.reason }, 'stuck vm failed; destroying its sandbox');
        if (await this.tryDestroy(agent, name, hint.id, hostId)) gone.add(name);
        return;
      case 'fail_exited':
        await this.runVm(
          hint.id,
          {
            type: 'FailVm',
            data: { vm_id: hint.id, reason: verdict.reason, error: verdict.error, error_code: verdict.code, exit_code: verdict.exit_code },
          },
          actor,
        );
        s.vms_exited++;
        this.logger.info({ vm_id: hint.id, host_id: hostId, reason: verdict.reason }, 'vm init ended; destroying its sandbox');
        if (await this.tryDestroy(agent, name, hint.id, hostId)) gone.add(name);
        return;
      case 'destroy_idle':
        this.logger.info({ vm_id: hint.id, host_id: hostId, idle_ms: verdict.idleMs }, 'idle vm: destroying');
        try {
          await this.vms.destroy(hint.id, actor, 'idle');
          s.idle_vms_failed++;
          gone.add(name);
        } catch (err) {
          // Left `destroying`: completed by a later cycle once the grace has passed.
          s.errors++;
          this.logger.warn({ vm_id: hint.id, err: errInfo(err) }, 'idle destroy did not finish');
        }
        return;
      case 'complete_destroy':
        if (!(await this.tryDestroy(agent, name, hint.id, hostId))) return;
        gone.add(name);
        await this.vms.releaseCapacity(hostId, hint.id, actor);
        await this.runVm(hint.id, { type: 'ConfirmDestroyed', data: { vm_id: hint.id } }, actor);
        s.half_done_completed++;
        this.logger.info({ vm_id: hint.id, host_id: hostId }, 'half-done destroy completed');
        return;
      case 'roll_back_boot':
        await this.runVm(
          hint.id,
          { type: 'FailVm', data: { vm_id: hint.id, reason: 'orphaned', error: verdict.error, error_code: 'INTERRUPTED' } },
          actor,
        );
        s.half_done_rolled_back++;
        this.logger.warn({ vm_id: hint.id, host_id: hostId, phase: verdict.phase, sandbox: listedHere }, 'half-done create rolled back');
        if (!listedHere || (await this.tryDestroy(agent, name, hint.id, hostId))) gone.add(name);
        return;
      default:
        assertNever(verdict, 'reconcile verdict');
    }
  }

  /** Releases every reservation on this host whose VM is gone, ended, or placed elsewhere — once no sandbox of it is listed. */
  private async releaseStaleReservations(
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
      const vm = await this.loadVm(vmId);
      const liveElsewhere = vm.status !== 'initial' && !isTerminal(vm.status) && vm.host_id !== hostId;
      if (!isStaleReservation(vm, liveElsewhere ? await this.loadMigration(vmId) : undefined, hostId, this.clock().getTime(), this.config))
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

  /** An operator's retry of a dead letter: marks it retrying, then tries the work at once. */
  async retryDeadLetter(id: string, meta: CommandMeta): Promise<{ state: DeadLetterState; error?: { code: string; message: string } }> {
    return this.deadLetters.retry(id, meta);
  }

  async discardDeadLetter(id: string, note: string | undefined, meta: CommandMeta): Promise<DeadLetterState> {
    return this.deadLetters.discard(id, note, meta);
  }

  private async tryDestroy(agent: HostAgent, name: string, vmId: string, hostId: string): Promise<boolean> {
    try {
      await agent.destroyVm(name, { force: true, timeoutMs: this.config.agentTimeoutMs });
      return true;
    } catch (err) {
      // The VM is terminal now: the next cycle sees the sandbox as an orphan and retries (and dead-letters) it.
      this.logger.warn(
        { vm_id: vmId, host_id: hostId, class: classifyHostAgentError(err), err: errInfo(err) },
        'sandbox destroy failed; retried as an orphan',
      );
      return false;
    }
  }

  /** Through the VM decider, so it shares the command handler's state cache with VmCommands. */
  private async loadVm(vmId: string): Promise<VmState> {
    return (await this.vmHandler.load(vmId)).state;
  }

  /** A migration of the VM in flight before its switch (its steps are on the VM stream, ignored by the VM decider). */
  private async loadMigration(vmId: string): Promise<MigrationInFlight | undefined> {
    const { state: m } = await this.migrationHandler.load(vmId);
    return m.status === 'in_progress' && !m.switched ? { target: m.target_host_id, lastStepAt: Date.parse(m.last_at) } : undefined;
  }

  private async runVm(vmId: string, command: VmCommand, meta: CommandMeta): Promise<ExistingVmState | undefined> {
    const r = await this.vmHandler.handle(vmId, command, meta);
    return r.state.status === 'initial' ? undefined : r.state;
  }

  private async runHost(hostId: string, command: HostCommand, meta: CommandMeta): Promise<void> {
    await this.hostHandler.handle(hostId, command, meta);
  }
}

function vmHintOf(h: LiveVmHint): VmHint {
  return {
    id: h.id,
    state: h.state,
    stateChangedAt: h.state_changed_at.getTime(),
    lastActivityAt: h.last_activity_at.getTime(),
    maxRuntimeS: h.max_runtime_s,
    idleTimeoutS: h.idle_timeout_s,
    timeoutAt: h.timeout_at?.getTime() ?? null,
  };
}
