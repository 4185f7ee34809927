import { AppError, type VmInfo } from '@fleet/agent-protocol';
import type { HealthcheckSpec } from '../../domain/health/health.decider.js';
import type { StoppedSandboxReport } from '../../domain/vm/vm.lifecycle.js';

/** What a host's listing says of a sandbox whose init is gone: an OOM kill, and its exit code or signal when the host recorded it. */
export function stoppedReportOf(v: VmInfo): StoppedSandboxReport {
  return { ...(v.oom?.init_oom_killed ? { oom_killed: true } : {}), ...(v.init_exit ?? {}) };
}

/** The fleet's reconcile settings (the seed's FleetConfig). */
export interface ReconcilerConfig {
  readonly intervalMs: number;
  /** Leak ceiling for a running VM with no state change; a spec's max_runtime_s overrides it. 0 disables. */
  readonly taskStuckTimeoutMs: number;
  /** Idle expiry for VMs whose spec sets no idle_timeout_s. 0 disables. */
  readonly defaultIdleTimeoutMs: number;
  readonly orphanDestroyMaxRetries: number;
  readonly hostUnreachableAfterCycles: number;
  /**
   * How old a VM left in requested/placed/booting/destroying must be before it
   * counts as abandoned by a crashed control plane. Longer than the slowest
   * live create (startup script included), or the reconciler races it.
   */
  readonly halfDoneGraceMs: number;
  /** Per call to an agent from the reconciler. */
  readonly agentTimeoutMs: number;
  /**
   * VmCommands records exec/attach activity at most this often, so the
   * recorded time may trail the real one by this much: idle expiry waits it
   * out, or a VM in use could be taken for idle.
   */
  readonly activityCoalesceMs: number;
}

/** A non-terminal VM as the `vms` read model lists it: only a hint; every action re-reads the stream. */
export interface LiveVmHint {
  readonly id: string;
  readonly state: string;
  readonly host_id: string | null;
  readonly state_changed_at: Date;
  readonly last_activity_at: Date;
  readonly max_runtime_s: number | null;
  readonly idle_timeout_s: number | null;
  /** The spec's on_idle: `pause` pauses an idle VM instead of destroying it. */
  readonly on_idle?: string | null | undefined;
  /** Its deadline (boot + max_runtime_s, or a PATCHed timeout); null or absent: none recorded. */
  readonly timeout_at?: Date | null | undefined;
  /** The spec's healthcheck, when it declared one. */
  readonly healthcheck?: VmHealthcheck | null | undefined;
  /** Provider of a proxy-mode VM, whose endpoint each cycle probes. */
  readonly egress_proxy?: string | null | undefined;
}

export interface VmHealthcheck extends HealthcheckSpec {
  readonly http?: { readonly port: number; readonly path?: string | undefined } | undefined;
  readonly exec?: readonly string[] | undefined;
}

/** What the reconciler reads from the read models (wired by the service; commands never touch a driver). */
export interface ReconcileReadModel {
  /** Every host not deregistered. */
  hostIds(): Promise<string[]>;
  /** Every VM not destroyed or failed. */
  liveVms(): Promise<LiveVmHint[]>;
}

/** One cycle's outcome (the seed's ReconcileSummary). */
export interface ReconcileSummary {
  cycle: number;
  started_at: string;
  duration_ms: number;
  hosts_checked: number;
  hosts_unanswered: number;
  hosts_marked_unreachable: number;
  hosts_recovered: number;
  tracked_vms: number;
  provider_vms: number;
  orphans_destroyed: number;
  orphans_failed: number;
  orphans_dead_lettered: number;
  orphans_skipped: number;
  stuck_tasks_suspected: number;
  stuck_tasks_failed: number;
  idle_vms_suspected: number;
  idle_vms_failed: number;
  vms_missing_provider: number;
  /** Running VMs whose init ended on its own: failed `exited` (or `oom`), sandbox destroyed. */
  vms_exited: number;
  /** Non-terminal VMs whose host was deregistered: failed `host_lost`. */
  vms_host_lost: number;
  /** VMs whose healthcheck gave a verdict this cycle, and how many of those failed. Neither causes a teardown. */
  health_checked: number;
  health_failing: number;
  half_done_rolled_back: number;
  half_done_completed: number;
  capacity_released: number;
  /** Things hosts had to put back in their sandbox network boundary (a missing or edited firewall table, a flipped sysctl). */
  network_repairs: number;
  /**
   * Proxy-mode VMs whose endpoint was probed this cycle, and how many did not
   * answer (the seed's EgressChecked/EgressUnhealthy). Reported only: the VM
   * keeps running with no egress, never with direct egress.
   */
  egress_checked: number;
  egress_unhealthy: number;
  errors: number;
}

export type SummaryCounter = Exclude<keyof ReconcileSummary, 'cycle' | 'started_at' | 'duration_ms'>;

export function emptySummary(cycle: number, startedAt: Date): ReconcileSummary {
  return {
    cycle,
    started_at: startedAt.toISOString(),
    duration_ms: 0,
    hosts_checked: 0,
    hosts_unanswered: 0,
    hosts_marked_unreachable: 0,
    hosts_recovered: 0,
    tracked_vms: 0,
    provider_vms: 0,
    orphans_destroyed: 0,
    orphans_failed: 0,
    orphans_dead_lettered: 0,
    orphans_skipped: 0,
    stuck_tasks_suspected: 0,
    stuck_tasks_failed: 0,
    idle_vms_suspected: 0,
    idle_vms_failed: 0,
    vms_missing_provider: 0,
    vms_exited: 0,
    vms_host_lost: 0,
    health_checked: 0,
    health_failing: 0,
    half_done_rolled_back: 0,
    half_done_completed: 0,
    capacity_released: 0,
    network_repairs: 0,
    egress_checked: 0,
    egress_unhealthy: 0,
    errors: 0,
  };
}

export function errInfo(err: unknown): { message: string; code?: string } {
  return err instanceof AppError ? { message: err.message, code: err.code } : { message: err instanceof Error ? err.message : String(err) };
}
