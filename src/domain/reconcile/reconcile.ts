import { isTerminal, type VmState } from '../vm/vm.decider.js';
import { endOfStoppedSandbox, type StoppedSandboxReport } from '../vm/vm.lifecycle.js';

/**
 * What the reconciler decides about a VM on a host, as pure functions (after
 * nomad's reconcile step: a result that a thin loop applies). The read model
 * only raises a suspicion; every verdict is made again on the VM's own
 * stream state, so a stale hint never ends a VM.
 */

export interface ReconcilePolicy {
  /** How old a VM left in requested/placed/booting/destroying must be before it counts as abandoned. */
  readonly halfDoneGraceMs: number;
  /** Leak ceiling for a running VM with no state change; a spec's max_runtime_s overrides it. 0 disables. */
  readonly taskStuckTimeoutMs: number;
  /** Idle expiry for VMs whose spec sets none. 0 disables. */
  readonly defaultIdleTimeoutMs: number;
  /** How far recorded activity may trail the real one. */
  readonly activityCoalesceMs: number;
}

/** A live VM as the read model lists it (times in ms). */
export interface VmHint {
  readonly id: string;
  readonly state: string;
  readonly stateChangedAt: number;
  readonly lastActivityAt: number;
  readonly maxRuntimeS: number | null;
  readonly idleTimeoutS: number | null;
  /** The VM's deadline (boot + max_runtime_s, or a PATCHed timeout), when the read model has one. */
  readonly timeoutAt?: number | null | undefined;
}

/** A migration of the VM that has not switched yet (its steps are on the VM stream). */
export interface MigrationInFlight {
  readonly target: string | undefined;
  readonly lastStepAt: number;
  /** A lazy migration past its switch: its source's paused sandbox and reservation hold the pages the VM still pages in. */
  readonly pinnedSource?: string | undefined;
  /**
   * A lazy migration past its switch whose page-in a watch of this process follows: that watch, not the grace,
   * decides when its source goes (a page-in may take longer than the grace; a restarted control plane adopts it).
   */
  readonly watched?: boolean | undefined;
}

export type Suspicion = 'missing' | 'exited' | 'stuck' | 'idle' | 'half_done';

/**
 * From the hint alone: whether the VM's stream is worth reading. `listed`:
 * its host lists its sandbox; `stopped`: listed, but its init is no longer running.
 */
export function suspect(hint: VmHint, listed: boolean, now: number, p: ReconcilePolicy, stopped = false): Suspicion | undefined {
  const age = now - hint.stateChangedAt;
  if (hint.state === 'running') {
    if (!listed) return 'missing';
    if (stopped) return 'exited';
    const deadline = deadlineOf(hint.timeoutAt ?? undefined, hint.stateChangedAt, hint, p);
    if (deadline !== undefined && now > deadline) return 'stuck';
    const idleMs = idleOf(hint, p);
    if (idleMs > 0 && now - hint.lastActivityAt > idleMs + p.activityCoalesceMs) return 'idle';
    return undefined;
  }
  if (age < p.halfDoneGraceMs || (hint.state !== 'placed' && hint.state !== 'booting' && hint.state !== 'destroying')) return undefined;
  return 'half_done';
}

export type VmVerdict =
  | { readonly kind: 'none' }
  /** Not listed once: failed as missing only if still absent next cycle (an agent recovering after a restart costs a cycle, not a VM). */
  | { readonly kind: 'absent_once' }
  | { readonly kind: 'fail_missing' }
  /** Past its deadline: ended with reason `timeout`; the code says whose limit (MAX_RUNTIME_EXCEEDED: the VM's own, VM_STUCK: the fleet's ceiling). */
  | { readonly kind: 'fail_stuck'; readonly reason: 'timeout'; readonly code: 'MAX_RUNTIME_EXCEEDED' | 'VM_STUCK'; readonly error: string }
  | { readonly kind: 'destroy_idle'; readonly idleMs: number }
  /** Its init ended on its own: failed `exited` (or `oom`), its sandbox destroyed. */
  | {
      readonly kind: 'fail_exited';
      readonly reason: 'exited' | 'oom';
      readonly exit_code: number | undefined;
      readonly exit_signal?: string | undefined;
      readonly code: string;
      readonly error: string;
    }
  | { readonly kind: 'complete_destroy' }
  | { readonly kind: 'roll_back_boot'; readonly phase: 'placed' | 'booting'; readonly error: string };

export interface HostContext {
  readonly hostId: string;
  /** Its sandbox is in the host's listing. */
  readonly listed: boolean;
  /** When the listing was asked for. */
  readonly listStarted: number;
  readonly now: number;
  /** Cycles in a row this running VM was already not listed. */
  readonly absentBefore: number;
  /** What the host says of a listed sandbox whose init is no longer running (exit code and OOM kill when it knows them). */
  readonly stopped?: StoppedSandboxReport | undefined;
}

/** The suspicion checked against the VM's stream state. */
export function decideVm(suspicion: Suspicion, hint: VmHint, vm: VmState, ctx: HostContext, p: ReconcilePolicy): VmVerdict {
  const { now } = ctx;
  switch (suspicion) {
    case 'missing':
      // Running before the listing started, yet not listed: the sandbox is gone. Twice in a row.
      if (vm.status !== 'running' || vm.host_id !== ctx.hostId || Date.parse(vm.transitioned_at) >= ctx.listStarted)
        return { kind: 'none' };
      return ctx.absentBefore + 1 < 2 ? { kind: 'absent_once' } : { kind: 'fail_missing' };
    case 'exited': {
      // Running before the listing started: a sandbox that has not finished booting is not taken for ended.
      if (!ctx.stopped || vm.status !== 'running' || vm.host_id !== ctx.hostId || Date.parse(vm.transitioned_at) >= ctx.listStarted)
        return { kind: 'none' };
      const end = endOfStoppedSandbox(ctx.stopped);
      const how = end.reason === 'oom' ? 'was killed for memory' : 'ended on its own';
      return {
        kind: 'fail_exited',
        reason: end.reason,
        exit_code: end.exit_code,
        ...(end.exit_signal !== undefined ? { exit_signal: end.exit_signal } : {}),
        code: end.error_code,
        error: `the sandbox's init ${how}${end.exit_code !== undefined ? ` (exit code ${end.exit_code})` : end.exit_signal !== undefined ? ` (killed by ${end.exit_signal})` : ''}`,
      };
    }
    case 'stuck': {
      if (vm.status !== 'running') return { kind: 'none' };
      // The stream's deadline decides, not the hint's: a PATCH that extended it since the hint was read keeps the VM.
      const own = vm.timeout_at !== undefined ? Date.parse(vm.timeout_at) : undefined;
      const deadline = deadlineOf(own, Date.parse(vm.transitioned_at), { maxRuntimeS: vm.spec.max_runtime_s ?? null }, p);
      if (deadline === undefined || now <= deadline) return { kind: 'none' };
      const ownLimit = own !== undefined || !!vm.spec.max_runtime_s;
      const age = now - Date.parse(vm.transitioned_at);
      return {
        kind: 'fail_stuck',
        reason: 'timeout',
        code: ownLimit ? 'MAX_RUNTIME_EXCEEDED' : 'VM_STUCK',
        error:
          own !== undefined
            ? `its timeout passed at ${vm.timeout_at} (running for ${Math.round(age / 1000)} s)`
            : `no state change for ${Math.round(age / 1000)} s (limit ${Math.round((deadline - Date.parse(vm.transitioned_at)) / 1000)} s)`,
      };
    }
    case 'idle': {
      const idleMs = idleOf(hint, p);
      if (vm.status !== 'running' || now - Date.parse(vm.last_activity_at) <= idleMs + p.activityCoalesceMs) return { kind: 'none' };
      return { kind: 'destroy_idle', idleMs: now - Date.parse(vm.last_activity_at) };
    }
    case 'half_done': {
      if (vm.status === 'initial' || vm.host_id !== ctx.hostId || now - Date.parse(vm.transitioned_at) < p.halfDoneGraceMs)
        return { kind: 'none' };
      if (vm.status === 'destroying') return { kind: 'complete_destroy' };
      if (vm.status !== 'placed' && vm.status !== 'booting') return { kind: 'none' };
      const got =
        vm.status === 'placed'
          ? 'capacity was reserved but the boot had not started'
          : ctx.listed
            ? 'the sandbox was created but the boot did not finish'
            : 'the boot had started but no sandbox was created';
      return {
        kind: 'roll_back_boot',
        phase: vm.status,
        error: `the control plane stopped while this VM was ${vm.status}: ${got}; the reconciler rolled it back`,
      };
    }
  }
}

/** A VM still `requested` past the grace: its control plane died before (or while) reserving. */
export function isAbandonedRequest(vm: VmState, now: number, p: Pick<ReconcilePolicy, 'halfDoneGraceMs'>): boolean {
  return vm.status === 'requested' && now - Date.parse(vm.transitioned_at) >= p.halfDoneGraceMs;
}

/** A VM migrating to `hostId` whose last step is younger than the grace: its reservation and sandbox there are the migration's. */
export function isMigratingTo(
  vm: VmState,
  migration: MigrationInFlight | undefined,
  hostId: string,
  now: number,
  p: Pick<ReconcilePolicy, 'halfDoneGraceMs'>,
): boolean {
  // Before its `place` step names the target, a migration may already hold a reservation anywhere.
  return (
    !!migration &&
    (migration.target === undefined || migration.target === hostId || migration.pinnedSource === hostId) &&
    vm.status === 'running' &&
    (migration.watched === true || now - migration.lastStepAt < p.halfDoneGraceMs)
  );
}

/** A sandbox listed on `hostId` that no live VM there accounts for. */
export function isOrphan(
  vm: VmState,
  migration: MigrationInFlight | undefined,
  hostId: string,
  now: number,
  p: Pick<ReconcilePolicy, 'halfDoneGraceMs'>,
): boolean {
  if (vm.status !== 'initial' && !isTerminal(vm.status) && vm.host_id === hostId) return false; // ours, the hint lagged
  if (vm.status === 'requested') return false;
  return !isMigratingTo(vm, migration, hostId, now, p);
}

/** A reservation on `hostId` with no sandbox listed: stale unless its VM is live there, still being placed, or migrating here. */
export function isStaleReservation(
  vm: VmState,
  migration: MigrationInFlight | undefined,
  hostId: string,
  now: number,
  p: Pick<ReconcilePolicy, 'halfDoneGraceMs'>,
): boolean {
  if (vm.status === 'initial' || isTerminal(vm.status)) return true;
  const elsewhere = vm.status !== 'requested' && vm.host_id !== hostId;
  return elsewhere && !isMigratingTo(vm, migration, hostId, now, p);
}

/**
 * When a running VM times out: its own deadline (boot + max_runtime_s, or a
 * PATCHed timeout) when it has one, else the spec's max runtime from its last
 * state change (read models from before deadlines were kept), else the
 * fleet's ceiling; undefined when none applies.
 */
function deadlineOf(
  own: number | undefined,
  since: number,
  limits: { readonly maxRuntimeS: number | null },
  p: ReconcilePolicy,
): number | undefined {
  if (own !== undefined) return own;
  const ms = limits.maxRuntimeS ? limits.maxRuntimeS * 1000 : p.taskStuckTimeoutMs;
  return ms > 0 ? since + ms : undefined;
}

function idleOf(hint: VmHint, p: ReconcilePolicy): number {
  return hint.idleTimeoutS ? hint.idleTimeoutS * 1000 : p.defaultIdleTimeoutMs;
}
