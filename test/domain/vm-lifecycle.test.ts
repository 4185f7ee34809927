import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { fold } from '../../src/domain/decider.js';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import type { PlacementDecision } from '../../src/domain/placement/placement.js';
import { decideVm as reconcileVm, suspect, type ReconcilePolicy } from '../../src/domain/reconcile/reconcile.js';
import { validateVmSpec } from '../../src/domain/vm/spec.js';
import { vmDecider, type VmCommand, type VmState } from '../../src/domain/vm/vm.decider.js';
import { parseVmEvent, vmEventSchema, type VmEvent, type VmReservation } from '../../src/domain/vm/vm.events.js';
import { toEnvironmentEvent } from '../../src/domain/vm/vm.feed.js';
import { toAuditEntry } from '../../src/adapters/http/audit.routes.js';
import { DESTROY_REASONS, FAIL_REASONS, VM_END_REASONS, parseMetadataFilter } from '../../src/domain/vm/vm.lifecycle.js';
import { at, given, T0 } from './gwt.js';

const decision: PlacementDecision = {
  host_id: 'h1',
  policy: 'spread',
  candidates: 1,
  headroom_cpus: 1,
  headroom_ram: 1,
  artifact_local: false,
  artifact_holders: 0,
};
const reservation: VmReservation = { cpus: 1, ram_mb: 256, storage_gb: 1, gpus: 0, gpu_uuids: [], mig_instance_uuids: [] };
const spec = validateVmSpec({ cpus: 1, ram_mb: 256, max_runtime_s: 60, metadata: { team: 'ml', run: '7' } });

function history(...commands: VmCommand[]): VmEvent[] {
  const events: VmEvent[] = [];
  let state: VmState = vmDecider.initialState;
  commands.forEach((c, i) => {
    const out = vmDecider.decide(c, state, { now: at(i) });
    for (const e of out) state = vmDecider.evolve(state, e);
    events.push(...out);
  });
  return events;
}
const RUNNING = history(
  { type: 'RequestVm', data: { vm_id: 'v1', spec, tenant_id: 't1' } },
  { type: 'PlaceVm', data: { vm_id: 'v1', host_id: 'h1', decision, reservation } },
  { type: 'StartBoot', data: { vm_id: 'v1' } },
  { type: 'CompleteBoot', data: { vm_id: 'v1', url: 'http://10.0.0.2', endpoints: [], boot_ms: 10 } },
);
const ENDING_TYPES = new Set(['VmDestroyRequested', 'VmDestroyed', 'VmFailed']);

describe('vm end reasons: no end without one', () => {
  test('every event that ends a VM needs a reason from the closed set to parse', () => {
    for (const type of ENDING_TYPES) {
      const base = { vm_id: 'v1', at: T0.toISOString(), error: 'x', phase: 'running', error_code: 'E' };
      assert.equal(vmEventSchema.safeParse({ type, data: base }).success, false, `${type} without a reason`);
      assert.equal(vmEventSchema.safeParse({ type, data: { ...base, reason: 'because' } }).success, false, `${type} with a made-up reason`);
      for (const reason of VM_END_REASONS) assert.ok(vmEventSchema.safeParse({ type, data: { ...base, reason } }).success, reason);
    }
  });

  test('the decider refuses to end a VM without a reason, with one of the wrong kind, or an error without its code', () => {
    const g = given(vmDecider, RUNNING);
    for (const reason of [undefined, '', 'because', ...FAIL_REASONS])
      g.when({ type: 'RequestDestroy', data: { vm_id: 'v1', reason: reason as never } }).thenThrows('VALIDATION_FAILED', 400);
    for (const reason of [undefined, 'because', ...DESTROY_REASONS])
      g.when({ type: 'FailVm', data: { vm_id: 'v1', reason: reason as never, error: 'x', error_code: 'E' } }).thenThrows(
        'VALIDATION_FAILED',
      );
    g.when({ type: 'FailVm', data: { vm_id: 'v1', reason: 'error', error: 'boom' } }).thenThrows('VALIDATION_FAILED', 400, /error code/);
    g.when({ type: 'FailVm', data: { vm_id: 'v1', reason: 'timeout', error: 'x', exit_code: 1 } }).thenThrows('VALIDATION_FAILED');
    g.when({ type: 'FailVm', data: { vm_id: 'v1', reason: 'host_lost', error: 'x', exit_signal: 'SIGKILL' } }).thenThrows(
      'VALIDATION_FAILED',
    );
    g.when({ type: 'FailVm', data: { vm_id: 'v1', reason: 'exited', error: 'x', exit_code: 1, exit_signal: 'SIGKILL' } }).thenThrows(
      'VALIDATION_FAILED',
      400,
      /not both/,
    );
  });

  test('every command that can end a VM, from every state, yields ending events that carry a reason', () => {
    const commands: VmCommand[] = [
      ...DESTROY_REASONS.map((reason): VmCommand => ({ type: 'RequestDestroy', data: { vm_id: 'v1', reason } })),
      ...FAIL_REASONS.map((reason): VmCommand => ({
        type: 'FailVm',
        data: { vm_id: 'v1', reason, error: 'x', error_code: 'E', exit_code: reason === 'exited' || reason === 'oom' ? 3 : undefined },
      })),
      { type: 'ConfirmDestroyed', data: { vm_id: 'v1' } },
    ];
    let seen = 0;
    for (let n = 1; n <= RUNNING.length; n++) {
      const prefix = RUNNING.slice(0, n);
      for (const first of commands) {
        let state = fold(vmDecider, prefix);
        for (const c of [first, { type: 'ConfirmDestroyed', data: { vm_id: 'v1' } } as VmCommand]) {
          let out: VmEvent[] = [];
          try {
            out = vmDecider.decide(c, state, { now: at(100) });
          } catch {
            continue;
          }
          for (const e of out) {
            if (ENDING_TYPES.has(e.type)) {
              seen++;
              const reason = (e.data as { reason?: string }).reason;
              assert.ok(reason !== undefined && VM_END_REASONS.includes(reason as never), JSON.stringify(e));
              assert.ok(vmEventSchema.safeParse(e).success);
            }
            state = vmDecider.evolve(state, e);
          }
        }
      }
    }
    assert.ok(seen > 40, `walked ${seen} ending events`);
  });

  test('exited and oom keep the exit code; the state shows it', () => {
    const s = given(vmDecider, RUNNING)
      .when({ type: 'FailVm', data: { vm_id: 'v1', reason: 'exited', error: 'init ended', error_code: 'SANDBOX_EXITED', exit_code: 3 } })
      .thenState();
    assert.ok(s.status === 'failed' && s.reason === 'exited' && s.exit_code === 3 && s.phase === 'running');
  });

  test('an egress provision failure is an event of its own (parses back, counted by metrics); the VM is left as it was', () => {
    const g = given(vmDecider, RUNNING);
    const command: VmCommand = {
      type: 'RecordEgressFailure',
      data: { vm_id: 'v1', provider: 'corp', op: 'provision', error: 'port taken' },
    };
    const events = g.when(command).events();
    assert.deepEqual(
      events.map((e) => [e.type, (e.data as { provider?: string }).provider, (e.data as { op?: string }).op]),
      [['VmEgressFailed', 'corp', 'provision']],
    );
    assert.ok(vmEventSchema.safeParse(JSON.parse(JSON.stringify(events[0]))).success);
    assert.deepEqual(fold(vmDecider, [...RUNNING, ...events]), fold(vmDecider, RUNNING));
    given(vmDecider, []).when(command).thenThrows('VM_NOT_FOUND');
  });

  test('an init killed by a signal keeps the signal, told apart from an exit code; the event parses back', () => {
    const g = given(vmDecider, RUNNING);
    const events = g
      .when({
        type: 'FailVm',
        data: { vm_id: 'v1', reason: 'exited', error: 'init killed', error_code: 'SANDBOX_EXITED', exit_signal: 'SIGTERM' },
      })
      .events();
    assert.equal(events.length, 1);
    const e = events[0]!;
    assert.ok(e.type === 'VmFailed' && e.data.exit_signal === 'SIGTERM' && e.data.exit_code === undefined);
    assert.ok(vmEventSchema.safeParse(JSON.parse(JSON.stringify(e))).success);
    const s = fold(vmDecider, [...RUNNING, e]);
    assert.ok(s.status === 'failed' && s.exit_signal === 'SIGTERM' && s.exit_code === undefined);
  });
});

describe('vm end reasons: old events', () => {
  const recorded = (type: string, data: object, actor = 'tenant:t1'): RecordedEvent => ({
    id: 'e',
    streamId: 'vm-v1',
    type,
    revision: 5n,
    position: '0000000000000001-0000000000000001',
    data: { vm_id: 'v1', at: T0.toISOString(), ...data },
    metadata: { actor },
    created: T0,
  });
  const cases: Array<[string, object, string, string?]> = [
    ['VmDestroyRequested', { reason: 'client' }, 'client'],
    ['VmDestroyed', { reason: 'client' }, 'admin', 'admin'],
    ['VmDestroyed', { reason: 'idle' }, 'idle'],
    ['VmFailed', { reason: 'max_runtime', error: 'x', phase: 'running', error_code: 'VM_STUCK' }, 'timeout'],
    ['VmFailed', { reason: 'stuck', error: 'x', phase: 'running', error_code: 'VM_STUCK' }, 'timeout'],
    ['VmFailed', { reason: 'missing', error: 'x', phase: 'running', error_code: 'SANDBOX_MISSING' }, 'host_lost'],
    ['VmFailed', { reason: 'orphan', error: 'x', phase: 'running' }, 'orphaned'],
    ['VmFailed', { reason: 'boot_failure', error: 'x', phase: 'booting', error_code: 'AGENT_UNAVAILABLE' }, 'error'],
    ['VmFailed', { reason: 'boot_failure', error: 'x', phase: 'booting', error_code: 'INTERRUPTED' }, 'orphaned'],
    ['VmFailed', { reason: 'placement', error: 'x', phase: 'requested', error_code: 'INTERRUPTED' }, 'orphaned'],
    ['VmFailed', { reason: 'capacity', error: 'x', phase: 'requested' }, 'error'],
  ];
  for (const [type, data, expected, actor] of cases) {
    test(`${type} ${JSON.stringify(data)} by ${actor ?? 'a tenant'} reads as ${expected}`, () => {
      const r = recorded(type, data, actor);
      const e = parseVmEvent(r.type, r.data, r.metadata);
      assert.equal((e.data as { reason: string }).reason, expected);
      if (e.type === 'VmFailed' && expected === 'error') assert.ok(e.data.error_code, 'an old error gets a code');
      assert.equal(toEnvironmentEvent(r)?.reason, expected, 'the feed carries it too');
      const audit = toAuditEntry(r);
      assert.deepEqual(
        [audit.end_reason, (audit.data as { reason: string }).reason],
        [expected, (data as { reason: string }).reason],
        'audit shows both',
      );
    });
  }
});

describe('vm timeout and metadata (PATCH)', () => {
  test('metadata from create is on the VM, not in the stored spec; replaced whole; the same map twice is no event', () => {
    const s = fold(vmDecider, RUNNING);
    assert.ok(s.status === 'running');
    assert.deepEqual(s.metadata, { team: 'ml', run: '7' });
    assert.equal((s.spec as Record<string, unknown>).metadata, undefined);
    const g = given(vmDecider, RUNNING);
    g.when({ type: 'UpdateVm', data: { vm_id: 'v1', metadata: { run: '7', team: 'ml' } } }).then([]);
    const after = g.when({ type: 'UpdateVm', data: { vm_id: 'v1', metadata: { team: 'ml' } } }, at(50)).thenState();
    assert.ok(after.status === 'running');
    assert.deepEqual(after.metadata, { team: 'ml' });
  });

  test('a timeout counts from now, only on a running VM; max_runtime_s sets the first deadline at boot', () => {
    const s = fold(vmDecider, RUNNING);
    assert.ok(s.status === 'running');
    assert.equal(s.timeout_at, new Date(at(3).getTime() + 60_000).toISOString());
    const g = given(vmDecider, RUNNING).when({ type: 'UpdateVm', data: { vm_id: 'v1', timeout_s: 600, metadata: { a: 'b' } } }, at(30));
    assert.deepEqual(
      g.events().map((e) => e.type),
      ['VmTimeoutSet', 'VmMetadataSet'],
    );
    const later = g.thenState();
    assert.ok(later.status === 'running' && later.timeout_at === new Date(at(30).getTime() + 600_000).toISOString());
    given(vmDecider, RUNNING.slice(0, 3))
      .when({ type: 'UpdateVm', data: { vm_id: 'v1', timeout_s: 5, metadata: { a: 'b' } } })
      .thenThrows('VM_INVALID_STATE', 409);
  });

  test('the reconciler ends a VM at its deadline (reason timeout), and not before an extended one', () => {
    const policy: ReconcilePolicy = {
      halfDoneGraceMs: 60_000,
      taskStuckTimeoutMs: 3_600_000,
      defaultIdleTimeoutMs: 0,
      activityCoalesceMs: 0,
    };
    const vm = fold(vmDecider, RUNNING);
    const booted = at(3).getTime();
    const hint = { id: 'v1', state: 'running', stateChangedAt: booted, lastActivityAt: booted, maxRuntimeS: 60, idleTimeoutS: null };
    const ctx = { hostId: 'h1', listed: true, listStarted: booted + 61_000, now: booted + 61_000, absentBefore: 0 };
    assert.equal(suspect({ ...hint, timeoutAt: booted + 60_000 }, true, ctx.now, policy), 'stuck');
    assert.deepEqual(
      (({ kind, reason, code }) => ({ kind, reason, code }))(
        reconcileVm('stuck', hint, vm, ctx, policy) as { kind: string; reason: string; code: string },
      ),
      { kind: 'fail_stuck', reason: 'timeout', code: 'MAX_RUNTIME_EXCEEDED' },
    );
    const extended = fold(vmDecider, [
      ...RUNNING,
      ...vmDecider.decide({ type: 'UpdateVm', data: { vm_id: 'v1', timeout_s: 600 } }, vm, { now: at(30) }),
    ]);
    assert.deepEqual(reconcileVm('stuck', hint, extended, ctx, policy), { kind: 'none' }, 'the stream has a later deadline than the hint');
    assert.equal(suspect({ ...hint, timeoutAt: at(630).getTime() }, true, ctx.now, policy), undefined);
  });

  test('a listed sandbox whose init stopped ends its running VM `exited`; one still booting is left alone', () => {
    const policy: ReconcilePolicy = { halfDoneGraceMs: 60_000, taskStuckTimeoutMs: 0, defaultIdleTimeoutMs: 0, activityCoalesceMs: 0 };
    const vm = fold(vmDecider, RUNNING);
    const booted = at(3).getTime();
    const hint = { id: 'v1', state: 'running', stateChangedAt: booted, lastActivityAt: booted, maxRuntimeS: null, idleTimeoutS: null };
    assert.equal(suspect(hint, true, booted + 5000, policy, true), 'exited');
    assert.equal(suspect(hint, true, booted + 5000, policy, false), undefined);
    const ctx = { hostId: 'h1', listed: true, listStarted: booted + 5000, now: booted + 5000, absentBefore: 0, stopped: { exit_code: 3 } };
    assert.deepEqual(reconcileVm('exited', hint, vm, ctx, policy), {
      kind: 'fail_exited',
      reason: 'exited',
      exit_code: 3,
      code: 'SANDBOX_EXITED',
      error: "the sandbox's init ended on its own (exit code 3)",
    });
    const oom = reconcileVm('exited', hint, vm, { ...ctx, stopped: { oom_killed: true, exit_code: 137 } }, policy);
    assert.ok(oom.kind === 'fail_exited' && oom.reason === 'oom' && oom.code === 'OOM_KILLED');
    const killed = reconcileVm('exited', hint, vm, { ...ctx, stopped: { exit_signal: 'SIGKILL' } }, policy);
    assert.deepEqual(killed, {
      kind: 'fail_exited',
      reason: 'exited',
      exit_code: undefined,
      exit_signal: 'SIGKILL',
      code: 'SANDBOX_EXITED',
      error: "the sandbox's init ended on its own (killed by SIGKILL)",
    });
    const oomKilled = reconcileVm('exited', hint, vm, { ...ctx, stopped: { oom_killed: true, exit_signal: 'SIGKILL' } }, policy);
    assert.ok(oomKilled.kind === 'fail_exited' && oomKilled.reason === 'oom' && oomKilled.exit_signal === 'SIGKILL');
    assert.deepEqual(reconcileVm('exited', hint, vm, { ...ctx, listStarted: booted - 1 }, policy), { kind: 'none' });
  });

  test('metadata filters parse key=value (the value may hold =) and refuse anything else', () => {
    assert.deepEqual(parseMetadataFilter('team=ml'), ['team', 'ml']);
    assert.deepEqual(parseMetadataFilter('q=a=b'), ['q', 'a=b']);
    assert.deepEqual(parseMetadataFilter('empty='), ['empty', '']);
    for (const bad of ['noequals', '=v', ' k=v', 'k k=v']) assert.equal(parseMetadataFilter(bad), undefined, bad);
  });

  test('metadata is bounded: key shape, value length, key count', () => {
    assert.throws(() => validateVmSpec({ metadata: { 'bad key': 'v' } }), /metadata/);
    assert.throws(() => validateVmSpec({ metadata: { k: 'x'.repeat(513) } }), /512/);
    assert.throws(() => validateVmSpec({ metadata: Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`k${i}`, 'v'])) }), /64/);
    assert.throws(() => validateVmSpec({ metadata: { k: 1 } }));
  });
});

describe('feed shape', () => {
  test('vm.migrated carries the new host, URL and endpoints; vm.failed its reason, phase, code and exit code', () => {
    const r = (type: string, data: object): RecordedEvent => ({
      id: 'e',
      streamId: 'vm-v1',
      type,
      revision: 1n,
      position: '0000000000000002-0000000000000001',
      data: { vm_id: 'v1', at: T0.toISOString(), ...data },
      metadata: {},
      created: T0,
    });
    const migrated = toEnvironmentEvent(
      r('VmMigrated', {
        from_host_id: 'h1',
        host_id: 'h2',
        decision,
        reservation,
        snapshot_id: 's1',
        url: 'http://10.0.0.9',
        endpoints: [{ as: 'web', url: 'http://127.0.0.1:4000', port: 80 }],
      }),
    );
    assert.deepEqual(
      { event: migrated?.event, state: migrated?.state, host: migrated?.host_id, url: migrated?.url, n: migrated?.endpoints?.length },
      { event: 'vm.migrated', state: 'running', host: 'h2', url: 'http://10.0.0.9', n: 1 },
    );
    const failed = toEnvironmentEvent(
      r('VmFailed', { reason: 'oom', error: 'killed', error_code: 'OOM_KILLED', phase: 'running', exit_code: 137 }),
    );
    assert.deepEqual(
      { reason: failed?.reason, phase: failed?.phase, code: failed?.error_code, exit: failed?.exit_code },
      { reason: 'oom', phase: 'running', code: 'OOM_KILLED', exit: 137 },
    );
    const signalled = toEnvironmentEvent(
      r('VmFailed', { reason: 'oom', error: 'killed', error_code: 'OOM_KILLED', phase: 'running', exit_signal: 'SIGKILL' }),
    );
    assert.deepEqual([signalled?.exit_signal, signalled?.exit_code], ['SIGKILL', undefined]);
  });
});
