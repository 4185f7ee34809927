import type { Logger } from 'pino';
import { AppError } from '@fleet/agent-protocol';
import { assertNever } from '../../domain/decider.js';
import { classifyHostAgentError, type HostAgent } from '../../domain/host-agent.port.js';
import { decideVm, suspect, type VmHint } from '../../domain/reconcile/reconcile.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import type { ReconcileStore } from './reconcile-store.js';
import type { StoppedSandboxReport } from '../../domain/vm/vm.lifecycle.js';
import { errInfo, type LiveVmHint, type ReconcilerConfig, type ReconcileSummary } from './reconcile-types.js';

/** Refusals of an idle pause that no later cycle will lift: the VM is destroyed instead (on_idle's fallback). */
const IDLE_PAUSE_IMPOSSIBLE: ReadonlySet<string> = new Set(['MEMORY_CHECKPOINT_UNSUPPORTED', 'GPU_MEMORY_STATE_UNSUPPORTED']);

/** What pauses an idle VM whose spec says on_idle: pause (the memory commands). */
export interface IdlePauser {
  pause(vmId: string, actor: Actor): Promise<unknown>;
}

/**
 * One VM against its host's listing: the pure decision (domain/reconcile)
 * says what is wrong, this applies it — fail missing, stuck or exited VMs,
 * end idle ones, complete or roll back work a crashed control plane left.
 */
export class VmRepairs {
  /** VMs seen absent from their host's listing: failed `missing` only on the second listing in a row. */
  private readonly absent = new Map<string, number>();
  /** Pauses an idle VM whose spec says on_idle: pause (the memory commands; wired after construction). */
  idlePauser: IdlePauser | undefined;

  constructor(
    private readonly store: ReconcileStore,
    private readonly vms: VmCommands,
    private readonly config: ReconcilerConfig,
    private readonly logger: Logger,
  ) {}

  /** Forgets VMs no longer live. */
  keepOnly(liveIds: ReadonlySet<string>): void {
    for (const id of this.absent.keys()) if (!liveIds.has(id)) this.absent.delete(id);
  }

  async reconcileVm(
    hostId: string,
    agent: HostAgent,
    hint: LiveVmHint,
    listed: ReadonlySet<string>,
    stopped: ReadonlyMap<string, StoppedSandboxReport>,
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
    const vm = await this.store.loadVm(hint.id);
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
        // `exited` (or `oom` when an OOM kill ended its init), with the init's exit code or signal when its host recorded it.
        stopped: stopped.get(name),
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
        await this.store.runVm(
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
        await this.store.runVm(
          hint.id,
          { type: 'FailVm', data: { vm_id: hint.id, reason: verdict.reason, error: verdict.error, error_code: verdict.code } },
          actor,
        );
        s.stuck_tasks_failed++;
        this.logger.warn({ vm_id: hint.id, host_id: hostId, reason: verdict.reason }, 'stuck vm failed; destroying its sandbox');
        if (await this.tryDestroy(agent, name, hint.id, hostId)) gone.add(name);
        return;
      case 'fail_exited':
        await this.store.runVm(
          hint.id,
          {
            type: 'FailVm',
            data: {
              vm_id: hint.id,
              reason: verdict.reason,
              error: verdict.error,
              error_code: verdict.code,
              exit_code: verdict.exit_code,
              exit_signal: verdict.exit_signal,
            },
          },
          actor,
        );
        s.vms_exited++;
        this.logger.info({ vm_id: hint.id, host_id: hostId, reason: verdict.reason }, 'vm init ended; destroying its sandbox');
        if (await this.tryDestroy(agent, name, hint.id, hostId)) gone.add(name);
        return;
      case 'destroy_idle':
        if (hint.on_idle === 'pause' && this.idlePauser) {
          try {
            await this.idlePauser.pause(hint.id, actor);
            this.logger.info({ vm_id: hint.id, host_id: hostId, idle_ms: verdict.idleMs }, 'idle vm: paused (on_idle: pause)');
            return;
          } catch (err) {
            // A host that cannot checkpoint (the VM was cold-migrated onto one), or a VM holding GPUs (their state cannot be
            // saved), ends as before: idle, it would otherwise hold its devices forever; anything else is retried.
            if (!(err instanceof AppError && IDLE_PAUSE_IMPOSSIBLE.has(err.code))) {
              s.errors++;
              this.logger.warn({ vm_id: hint.id, err: errInfo(err) }, 'idle pause did not finish; retried next cycle');
              return;
            }
          }
        }
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
        await this.store.runVm(hint.id, { type: 'ConfirmDestroyed', data: { vm_id: hint.id } }, actor);
        s.half_done_completed++;
        this.logger.info({ vm_id: hint.id, host_id: hostId }, 'half-done destroy completed');
        return;
      case 'roll_back_boot':
        await this.store.runVm(
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

  async tryDestroy(agent: HostAgent, name: string, vmId: string, hostId: string): Promise<boolean> {
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
