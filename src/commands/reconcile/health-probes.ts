import type { Logger } from 'pino';
import { healthAggregate } from '../../domain/health/health.aggregate.js';
import { HEALTH_DEFAULTS, nextHealth, type VmHealthState } from '../../domain/health/health.decider.js';
import type { HostAgent } from '../../domain/host-agent.port.js';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import { sandboxName } from '../vm/boot-sandbox.js';
import type { Actor } from '../vm/vm-commands.js';
import { errInfo, type LiveVmHint, type ReconcileSummary } from './reconcile-types.js';

/** Health probes of running VMs, each at its own interval; verdicts on the VM's health stream. */
export class HealthProbes {
  private readonly probes = new Map<string, { lastAt: number; failures: number; state: VmHealthState['status'] }>();
  private readonly healthHandler: BoundOf<typeof healthAggregate>;

  constructor(
    handler: CommandHandler,
    private readonly config: { readonly agentTimeoutMs: number },
    private readonly logger: Logger,
    private readonly clock: () => Date,
  ) {
    this.healthHandler = bindAggregate(handler, healthAggregate);
  }

  /** Forgets VMs no longer live. */
  keepOnly(liveIds: ReadonlySet<string>): void {
    for (const id of this.probes.keys()) if (!liveIds.has(id)) this.probes.delete(id);
  }

  /**
   * Runs a VM's declared healthcheck inside it (exec, or an HTTP GET by the
   * guest's own wget against its loopback) at most every interval_seconds —
   * no more often than the reconcile cycle — and records the verdict only
   * when it changes. A failing probe reports; it never destroys.
   */
  async probe(agent: HostAgent, hint: LiveVmHint, s: ReconcileSummary, actor: Actor): Promise<void> {
    const hc = hint.healthcheck;
    if (!hc) return;
    const now = this.clock().getTime();
    let p = this.probes.get(hint.id);
    if (!p) {
      const { state } = await this.healthHandler.load(hint.id);
      p = { lastAt: 0, failures: state.status === 'unknown' ? 0 : state.failures, state: state.status };
      this.probes.set(hint.id, p);
    }
    if (now - p.lastAt < (hc.interval_seconds ?? HEALTH_DEFAULTS.interval_seconds) * 1000) return;
    p.lastAt = now;
    const timeoutS = hc.timeout_seconds ?? HEALTH_DEFAULTS.timeout_seconds;
    const { exec, http } = hc;
    const argv = exec
      ? [...exec]
      : http
        ? ['wget', '-q', '-O', '/dev/null', '-T', String(timeoutS), `http://127.0.0.1:${http.port}${http.path ?? '/'}`]
        : undefined;
    // The spec sets exactly one of exec and http.
    if (!argv) return;
    let passed: boolean;
    let message = '';
    try {
      const r = await agent.exec(
        sandboxName(hint.id),
        { argv, timeout_ms: timeoutS * 1000 },
        { timeoutMs: timeoutS * 1000 + this.config.agentTimeoutMs },
      );
      passed = r.exit_code === 0 && !r.timed_out;
      if (!passed)
        message = r.timed_out
          ? `probe timed out after ${timeoutS} s`
          : `probe exited ${r.exit_code}: ${(r.stderr || r.stdout).slice(-500)}`;
    } catch (err) {
      // The agent, not the guest, failed: no verdict this cycle.
      this.logger.debug({ vm_id: hint.id, err: errInfo(err) }, 'health probe not run');
      p.lastAt = 0;
      return;
    }
    s.health_checked++;
    p.failures = passed ? 0 : p.failures + 1;
    if (!passed) s.health_failing++;
    const next = nextHealth(p.state, passed, p.failures, hc, now - hint.state_changed_at.getTime());
    if (next !== p.state) {
      await this.healthHandler.handle(
        hint.id,
        { type: 'RecordHealthVerdict', data: { vm_id: hint.id, state: next, failures: p.failures, message } },
        actor,
      );
      this.logger.info({ vm_id: hint.id, health: next, failures: p.failures, message }, 'vm health changed');
      p.state = next;
    }
  }
}
