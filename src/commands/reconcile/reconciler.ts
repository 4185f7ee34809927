import { randomUUID } from 'node:crypto';
import type { Logger } from 'pino';
import type { VmInfo } from '@fleet/agent-protocol';
import type { DeadLetterState } from '../../domain/deadletter/deadletter.decider.js';
import { classifyHostAgentError } from '../../domain/host-agent.port.js';
import { isValidId } from '../../domain/ids.js';
import { isOrphan } from '../../domain/reconcile/reconcile.js';
import { vmDecider } from '../../domain/vm/vm.decider.js';
import type { CommandHandler, CommandMeta } from '../command-handler.js';
import { DeadLetters } from '../dead-letters/dead-letters.js';
import type { HostCommands } from '../host/host-commands.js';
import { SANDBOX_PREFIX, sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import { HealthProbes } from './health-probes.js';
import type { StoppedSandboxReport } from '../../domain/vm/vm.lifecycle.js';
import { HostChecks } from './host-checks.js';
import { OomRecorder } from './oom-recorder.js';
import { ReconcileStore, type LazyWatcher } from './reconcile-store.js';
import {
  emptySummary,
  errInfo,
  type LiveVmHint,
  type ReconcileReadModel,
  type ReconcilerConfig,
  type ReconcileSummary,
  stoppedReportOf,
} from './reconcile-types.js';
import { Sweeps } from './sweeps.js';
import { VmRepairs, type IdlePauser } from './vm-repairs.js';
export type {
  LiveVmHint,
  ReconcileReadModel,
  ReconcilerConfig,
  ReconcileSummary,
  SummaryCounter,
  VmHealthcheck,
} from './reconcile-types.js';
export { deadLetterId } from '../dead-letters/dead-letters.js';

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
  private readonly health: HealthProbes;
  private readonly deadLetters: DeadLetters;
  private readonly ooms: OomRecorder;
  private readonly store: ReconcileStore;
  private readonly sweeps: Sweeps;
  private readonly repairs: VmRepairs;
  private readonly checks: HostChecks;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    vms: VmCommands,
    private readonly readModel: ReconcileReadModel,
    private readonly config: ReconcilerConfig,
    private readonly logger: Logger,
    private readonly onCycle: (summary: ReconcileSummary) => void = () => undefined,
    private readonly clock: () => Date = () => new Date(),
  ) {
    this.store = new ReconcileStore(handler);
    this.health = new HealthProbes(handler, config, logger, clock);
    this.deadLetters = new DeadLetters(handler, hosts, (id) => this.store.loadVm(id), config, logger, clock);
    this.ooms = new OomRecorder(this.store.vmHandler, logger, clock);
    this.sweeps = new Sweeps(this.store, hosts, vms, config, logger, clock);
    this.repairs = new VmRepairs(this.store, vms, config, logger);
    this.checks = new HostChecks(config, logger);
  }

  /** Wired after construction (service.ts): idle VMs with on_idle: pause are paused through it. */
  set idlePauser(pauser: IdlePauser | undefined) {
    this.repairs.idlePauser = pauser;
  }

  /** Wired after construction (service.ts): a lazy migration's page-in left unwatched (a restart) is adopted through it. */
  set lazyWatcher(watcher: LazyWatcher | undefined) {
    this.store.lazyWatcher = watcher;
  }

  get isActive(): boolean {
    return this.active;
  }

  get lastSummary(): ReconcileSummary | undefined {
    return this.last;
  }

  /** Proxy endpoints probed by the last cycle, by provider and health (the seed's EgressEndpoints); empty when none was. */
  get lastEgressEndpoints(): ReadonlyArray<{ provider: string; state: string; count: number }> {
    return [...this.egressEndpoints].map(([k, count]) => {
      const [provider = '', state = ''] = k.split('\0');
      return { provider, state, count };
    });
  }
  private egressEndpoints = new Map<string, number>();
  private cycleEndpoints = new Map<string, number>();

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
    this.cycleEndpoints = new Map();
    const meta: CommandMeta = { correlationId: `reconcile-${randomUUID()}`, actor: 'reconciler', tenantId: 'system' };
    const actor: Actor = { ...SYSTEM, correlationId: meta.correlationId };

    // Read the hints BEFORE listing agents: a VM running before a listing must appear in it.
    const [hostIds, live] = await Promise.all([this.readModel.hostIds(), this.readModel.liveVms()]);
    s.tracked_vms = live.length;
    const liveIds = new Set(live.map((v) => v.id));
    this.health.keepOnly(liveIds);
    this.repairs.keepOnly(liveIds);
    const byHost = new Map<string, LiveVmHint[]>();
    for (const v of live) {
      if (!v.host_id) continue;
      const list = byHost.get(v.host_id) ?? [];
      list.push(v);
      byHost.set(v.host_id, list);
    }

    await this.sweeps.abandonedRequests(live, s, actor);
    await this.sweeps.vmsOfDeregisteredHosts(live, new Set(hostIds), s, actor);
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
    this.egressEndpoints = this.cycleEndpoints;
    this.logger[s.errors > 0 ? 'warn' : 'info']({ summary: s }, 'reconcile cycle');
    this.onCycle(s);
    return s;
  }

  private async reconcileHost(hostId: string, hints: readonly LiveVmHint[], s: ReconcileSummary, actor: Actor): Promise<void> {
    const { state: host } = await this.hosts.load(hostId);
    if (host.status === 'unregistered' || host.status === 'deregistered') return;
    s.hosts_checked++;
    const agent = this.hosts.agentForState(host);

    const listStarted = this.clock().getTime();
    let listed: Set<string>;
    /** Listed sandboxes whose init is no longer running, and whether an OOM kill ended it. */
    let stopped: Map<string, StoppedSandboxReport>;
    let infos: VmInfo[];
    try {
      const vms = (await agent.listVms(SANDBOX_PREFIX, { timeoutMs: this.config.agentTimeoutMs })).filter((v) =>
        v.name.startsWith(SANDBOX_PREFIX),
      );
      infos = vms;
      listed = new Set(vms.map((v) => v.name));
      stopped = new Map(vms.filter((v) => v.state === 'stopped').map((v) => [v.name, stoppedReportOf(v)]));
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
        await this.store.runHost(
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
      await this.store.runHost(hostId, { type: 'MarkHostReachable', data: { host_id: hostId } }, actor);
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
      const vm = isValidId(vmId) ? await this.store.loadVm(vmId) : vmDecider.initialState;
      const migration = isValidId(vmId) ? await this.store.loadMigration(vmId) : undefined;
      if (!isOrphan(vm, migration, hostId, now, this.config)) continue;
      if (await this.deadLetters.destroyOrphan(hostId, agent, name, vm.status === 'initial' ? undefined : vm.vm_id, s, actor))
        gone.add(name);
    }

    // OOM kills first: a sandbox whose init died of one ends `oom`, not `exited`.
    const oom = await this.ooms.record(hostId, infos, hints, gone, actor);
    s.errors += oom.errors;

    for (const hint of hints) {
      try {
        await this.repairs.reconcileVm(hostId, agent, hint, listed, stopped, listStarted, now, gone, s, actor);
      } catch (err) {
        s.errors++;
        this.logger.warn({ vm_id: hint.id, host_id: hostId, err: errInfo(err) }, 'reconcile of vm failed');
      }
    }

    await this.sweeps.releaseStaleReservations(hostId, listed, gone, s, actor);

    await this.checks.reassertNetwork(hostId, agent, s);

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

    const proxied = hints.filter(
      (h) => h.state === 'running' && h.egress_proxy && listed.has(sandboxName(h.id)) && !gone.has(sandboxName(h.id)),
    );
    const endpoints = this.cycleEndpoints;
    await Promise.all(proxied.map((h) => this.checks.probeEgress(hostId, agent, h, s, endpoints)));
  }

  /** An operator's retry of a dead letter: marks it retrying, then tries the work at once. */
  async retryDeadLetter(id: string, meta: CommandMeta): Promise<{ state: DeadLetterState; error?: { code: string; message: string } }> {
    return this.deadLetters.retry(id, meta);
  }

  async discardDeadLetter(id: string, note: string | undefined, meta: CommandMeta): Promise<DeadLetterState> {
    return this.deadLetters.discard(id, note, meta);
  }
}
