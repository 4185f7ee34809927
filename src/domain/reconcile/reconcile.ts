import { isTerminal, type VmState } from '../vm/vm.decider.js';
import type { VmEndReason } from '../vm/vm.events.js';

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
  /** The VM's deadline (VmTimeoutSet), when it has one. */
  readonly expiresAt?: number | null | undefined;
}

/** A migration of the VM that has not switched yet (its steps are on the VM stream). */
export interface MigrationInFlight {
  readonly target: string | undefined;
  readonly lastStepAt: number;
}

export type Suspicion = 'missing' | 'expired' | 'stuck' | 'idle' | 'half_done';

/** From the hint alone: whether the VM's stream is worth reading. `listed`: its host lists its sandbox. */
export function suspect(hint: VmHint, listed: boolean, now: number, p: ReconcilePolicy): Suspicion | undefined {
  const age = now - hint.stateChangedAt;
  if (hint.state === 'running') {
    if (!listed) return 'missing';
    if (hint.expiresAt != null && now >= hint.expiresAt) return 'expired';
    const maxRuntimeMs = maxRuntimeOf(hint, p);
    if (maxRuntimeMs > 0 && age > maxRuntimeMs) return 'stuck';
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
  | { readonly kind: 'fail_stuck'; readonly reason: Extract<VmEndReason, 'max_runtime' | 'stuck'>; readonly error: string }
  | { readonly kind: 'destroy_idle'; readonly idleMs: number }
  /** Its deadline passed: destroyed with reason `timeout`. */
  | { readonly kind: 'destroy_expired'; readonly expiredAt: string }
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
    case 'stuck': {
      const maxRuntimeMs = maxRuntimeOf(hint, p);
      if (vm.status !== 'running' || now - Date.parse(vm.transitioned_at) <= maxRuntimeMs) return { kind: 'none' };
      const age = now - hint.stateChangedAt;
      return {
        kind: 'fail_stuck',
        reason: hint.maxRuntimeS ? 'max_runtime' : 'stuck',
        error: `no state change for ${Math.round(age / 1000)} s (limit ${Math.round(maxRuntimeMs / 1000)} s)`,
      };
    }
    case 'expired': {
      if (vm.status !== 'running' || vm.expires_at === undefined || now < Date.parse(vm.expires_at)) return { kind: 'none' };
      return { kind: 'destroy_expired', expiredAt: vm.expires_at };
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
    (migration.target === undefined || migration.target === hostId) &&
    vm.status === 'running' &&
    now - migration.lastStepAt < p.halfDoneGraceMs
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

function maxRuntimeOf(hint: VmHint, p: ReconcilePolicy): number {
  return hint.maxRuntimeS ? hint.maxRuntimeS * 1000 : p.taskStuckTimeoutMs;
}

function idleOf(hint: VmHint, p: ReconcilePolicy): number {
  return hint.idleTimeoutS ? hint.idleTimeoutS * 1000 : p.defaultIdleTimeoutMs;
}
