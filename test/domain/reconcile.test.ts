import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  decideVm,
  isAbandonedRequest,
  isOrphan,
  isStaleReservation,
  suspect,
  type HostContext,
  type ReconcilePolicy,
  type VmHint,
} from '../../src/domain/reconcile/reconcile.js';
import type { VmState } from '../../src/domain/vm/vm.decider.js';
import { T0 } from './gwt.js';

/** Given a VM (hint and stream state), When the reconciler looks at it on host h1, Then this verdict. */
const policy: ReconcilePolicy = {
  halfDoneGraceMs: 60_000,
  taskStuckTimeoutMs: 3_600_000,
  defaultIdleTimeoutMs: 600_000,
  activityCoalesceMs: 60_000,
};
const t0 = T0.getTime();
const iso = (ms: number): string => new Date(ms).toISOString();
const hint = (over: Partial<VmHint> = {}): VmHint => ({
  id: 'v1',
  state: 'running',
  stateChangedAt: t0,
  lastActivityAt: t0,
  maxRuntimeS: null,
  idleTimeoutS: null,
  ...over,
});
const vm = (status: string, over: Record<string, unknown> = {}): VmState =>
  ({
    status,
    vm_id: 'v1',
    tenant_id: 't1',
    host_id: 'h1',
    spec: {},
    transitioned_at: iso(t0),
    last_activity_at: iso(t0),
    ...over,
  }) as unknown as VmState;
const ctx = (over: Partial<HostContext> = {}): HostContext => ({
  hostId: 'h1',
  listed: true,
  listStarted: t0 + 1000,
  now: t0 + 1000,
  absentBefore: 0,
  ...over,
});

describe('reconcile decisions', () => {
  test('missing: a running VM its host does not list is failed only when absent two cycles in a row, and only if it ran before the listing', () => {
    assert.equal(suspect(hint(), false, t0 + 1000, policy), 'missing');
    assert.deepEqual(decideVm('missing', hint(), vm('running'), ctx({ listed: false }), policy), { kind: 'absent_once' });
    assert.deepEqual(decideVm('missing', hint(), vm('running'), ctx({ listed: false, absentBefore: 1 }), policy), { kind: 'fail_missing' });
    assert.deepEqual(
      decideVm('missing', hint(), vm('running', { transitioned_at: iso(t0 + 2000) }), ctx({ listed: false, absentBefore: 1 }), policy),
      { kind: 'none' },
      'it started after the listing',
    );
    assert.deepEqual(
      decideVm('missing', hint(), vm('running', { host_id: 'h2' }), ctx({ listed: false, absentBefore: 1 }), policy),
      { kind: 'none' },
      'it moved',
    );
  });

  test('stuck: no state change past max_runtime_s (or the fleet ceiling) fails it, with the reason naming which', () => {
    const later = t0 + 3_600_001;
    assert.equal(suspect(hint(), true, later, policy), 'stuck');
    assert.equal(suspect(hint({ lastActivityAt: t0 + 3_000_000 }), true, t0 + 3_599_000, policy), undefined);
    const v = decideVm('stuck', hint(), vm('running'), ctx({ now: later }), policy);
    assert.equal(v.kind === 'fail_stuck' && `${v.reason}/${v.code}`, 'timeout/VM_STUCK');
    const m = decideVm(
      'stuck',
      hint({ maxRuntimeS: 10 }),
      vm('running', { spec: { max_runtime_s: 10 } }),
      ctx({ now: t0 + 11_000 }),
      policy,
    );
    assert.deepEqual(m, {
      kind: 'fail_stuck',
      reason: 'timeout',
      code: 'MAX_RUNTIME_EXCEEDED',
      error: 'no state change for 11 s (limit 10 s)',
    });
    assert.deepEqual(
      decideVm(
        'stuck',
        hint({ maxRuntimeS: 10 }),
        vm('running', { spec: { max_runtime_s: 10 }, transitioned_at: iso(t0 + 5000) }),
        ctx({ now: t0 + 11_000 }),
        policy,
      ),
      { kind: 'none' },
      'the stream says it changed since',
    );
    assert.equal(suspect(hint(), true, later, { ...policy, taskStuckTimeoutMs: 0, defaultIdleTimeoutMs: 0 }), undefined, '0 disables');
  });

  test('idle: no activity past its idle timeout plus the coalescing window destroys it; recorded activity on the stream wins over the hint', () => {
    const later = t0 + 600_000 + 60_001;
    assert.equal(suspect(hint(), true, later, policy), 'idle');
    assert.equal(suspect(hint(), true, later - 2, policy), undefined, 'within the coalescing window');
    assert.deepEqual(decideVm('idle', hint(), vm('running'), ctx({ now: later }), policy), { kind: 'destroy_idle', idleMs: 660_001 });
    assert.deepEqual(decideVm('idle', hint(), vm('running', { last_activity_at: iso(t0 + 100_000) }), ctx({ now: later }), policy), {
      kind: 'none',
    });
  });

  test('half-done: a create left placed or booting past the grace is rolled back; a destroy left destroying is completed', () => {
    const later = t0 + 60_000;
    assert.equal(suspect(hint({ state: 'booting' }), false, later, policy), 'half_done');
    assert.equal(suspect(hint({ state: 'booting' }), false, later - 1, policy), undefined, 'within the grace');
    assert.equal(
      suspect(hint({ state: 'requested' }), false, later, policy),
      undefined,
      'requests are rolled back fleet-wide, not per host',
    );
    const placed = decideVm('half_done', hint({ state: 'placed' }), vm('placed'), ctx({ now: later }), policy);
    assert.equal(placed.kind, 'roll_back_boot');
    assert.match(placed.kind === 'roll_back_boot' ? placed.error : '', /capacity was reserved but the boot had not started/);
    const booting = decideVm('half_done', hint({ state: 'booting' }), vm('booting'), ctx({ now: later, listed: false }), policy);
    assert.match(booting.kind === 'roll_back_boot' ? booting.error : '', /no sandbox was created/);
    assert.deepEqual(decideVm('half_done', hint({ state: 'destroying' }), vm('destroying'), ctx({ now: later }), policy), {
      kind: 'complete_destroy',
    });
    assert.deepEqual(
      decideVm('half_done', hint({ state: 'booting' }), vm('running'), ctx({ now: later }), policy),
      { kind: 'none' },
      'it finished after all',
    );
    assert.deepEqual(
      decideVm('half_done', hint({ state: 'booting' }), vm('booting', { host_id: 'h2' }), ctx({ now: later }), policy),
      { kind: 'none' },
      'another host owns it',
    );
  });

  test('abandoned requests: requested past the grace on the stream', () => {
    assert.equal(isAbandonedRequest(vm('requested'), t0 + 60_000, policy), true);
    assert.equal(isAbandonedRequest(vm('requested'), t0 + 59_999, policy), false);
    assert.equal(isAbandonedRequest(vm('placed'), t0 + 60_000, policy), false);
  });

  test('orphans: a listed sandbox is kept for a live VM of this host, a request, or a migration in flight to here; otherwise destroyed', () => {
    const now = t0 + 1000;
    assert.equal(isOrphan(vm('running'), undefined, 'h1', now, policy), false);
    assert.equal(isOrphan(vm('initial'), undefined, 'h1', now, policy), true);
    assert.equal(isOrphan(vm('destroyed'), undefined, 'h1', now, policy), true);
    assert.equal(isOrphan(vm('requested', { host_id: undefined }), undefined, 'h1', now, policy), false);
    assert.equal(isOrphan(vm('running', { host_id: 'h2' }), undefined, 'h1', now, policy), true);
    assert.equal(isOrphan(vm('running', { host_id: 'h2' }), { target: 'h1', lastStepAt: t0 }, 'h1', now, policy), false);
    assert.equal(
      isOrphan(vm('running', { host_id: 'h2' }), { target: undefined, lastStepAt: t0 }, 'h1', now, policy),
      false,
      'before place names a target',
    );
    assert.equal(isOrphan(vm('running', { host_id: 'h2' }), { target: 'h3', lastStepAt: t0 }, 'h1', now, policy), true);
    assert.equal(
      isOrphan(vm('running', { host_id: 'h2' }), { target: 'h1', lastStepAt: t0 }, 'h1', t0 + 60_000, policy),
      true,
      'abandoned past the grace',
    );
    const pinned = { target: 'h2', pinnedSource: 'h1', lastStepAt: t0 };
    assert.equal(isOrphan(vm('running', { host_id: 'h2' }), pinned, 'h1', now, policy), false, 'a lazy source still serving pages');
    assert.equal(isOrphan(vm('running', { host_id: 'h2' }), pinned, 'h3', now, policy), true);
  });

  test('stale reservations: released for a VM gone, ended, or live elsewhere and not migrating here', () => {
    const now = t0 + 1000;
    assert.equal(isStaleReservation(vm('initial'), undefined, 'h1', now, policy), true);
    assert.equal(isStaleReservation(vm('failed'), undefined, 'h1', now, policy), true);
    assert.equal(isStaleReservation(vm('booting'), undefined, 'h1', now, policy), false);
    assert.equal(isStaleReservation(vm('requested', { host_id: undefined }), undefined, 'h1', now, policy), false);
    assert.equal(isStaleReservation(vm('running', { host_id: 'h2' }), undefined, 'h1', now, policy), true);
    assert.equal(isStaleReservation(vm('running', { host_id: 'h2' }), { target: 'h1', lastStepAt: t0 }, 'h1', now, policy), false);
    const pinned = { target: 'h2', pinnedSource: 'h1', lastStepAt: t0 };
    assert.equal(
      isStaleReservation(vm('running', { host_id: 'h2' }), pinned, 'h1', now, policy),
      false,
      'a lazy source still serving pages',
    );
  });
});
