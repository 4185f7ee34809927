import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { fold } from '../../src/domain/decider.js';
import type { PlacementDecision } from '../../src/domain/placement/placement.js';
import { validateVmSpec } from '../../src/domain/vm/spec.js';
import { vmDecider, type VmCommand, type VmState } from '../../src/domain/vm/vm.decider.js';
import { parseVmEvent, type VmEvent, type VmReservation } from '../../src/domain/vm/vm.events.js';
import { at, given, T0 } from './gwt.js';

const spec = validateVmSpec({ cpus: 2, ram_mb: 2048, files: { '/srv/x': Buffer.from('payload').toString('base64') } });
const decision: PlacementDecision = {
  host_id: 'h1',
  policy: 'spread',
  candidates: 3,
  headroom_cpus: 6,
  headroom_ram: 14336,
  artifact_local: false,
  artifact_holders: 0,
};
const reservation: VmReservation = { cpus: 2, ram_mb: 2048, storage_gb: 1, gpus: 0, gpu_uuids: [], mig_instance_uuids: [] };

const request: VmCommand = { type: 'RequestVm', data: { vm_id: 'v1', spec, tenant_id: 't1', task_id: 'task-9', idempotency_key: 'key-1' } };
const placeCmd: VmCommand = { type: 'PlaceVm', data: { vm_id: 'v1', host_id: 'h1', decision, reservation } };
const startBoot: VmCommand = { type: 'StartBoot', data: { vm_id: 'v1' } };
const bootedData = {
  vm_id: 'v1',
  url: 'http://10.0.0.1:41000',
  endpoints: [{ as: 'http', url: 'http://10.0.0.1:41001', port: 8080, protocol: 'tcp' as const }],
  boot_ms: 850,
  auth_token_encrypted: 'v1.ct',
};
const booted: VmCommand = { type: 'CompleteBoot', data: bootedData };
const activity: VmCommand = { type: 'RecordActivity', data: { vm_id: 'v1' } };
const destroy = (reason: 'client' | 'idle' = 'client'): VmCommand => ({ type: 'RequestDestroy', data: { vm_id: 'v1', reason } });
const destroyed: VmCommand = { type: 'ConfirmDestroyed', data: { vm_id: 'v1' } };
const fail = (reason: 'error' | 'host_lost' = 'error'): VmCommand => ({
  type: 'FailVm',
  data: { vm_id: 'v1', reason, error: 'agent answered 503', error_code: 'AGENT_UNAVAILABLE' },
});

/** Each command at its own second, so timestamps tell the steps apart. */
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

const REQUESTED = history(request);
const PLACED = history(request, placeCmd);
const BOOTING = history(request, placeCmd, startBoot);
const RUNNING = history(request, placeCmd, startBoot, booted);
const DESTROYING = history(request, placeCmd, startBoot, booted, destroy());
const DESTROYED = history(request, placeCmd, startBoot, booted, destroy(), destroyed);
const FAILED = history(request, placeCmd, startBoot, fail());

describe('vm: lifecycle', () => {
  test('requested: records the spec without file contents, tenant, task and idempotency key', () => {
    given(vmDecider)
      .when(request)
      .then([
        {
          type: 'VmRequested',
          data: {
            vm_id: 'v1',
            spec: { ...validateVmSpec({ cpus: 2, ram_mb: 2048 }), file_paths: ['/srv/x'] },
            tenant_id: 't1',
            task_id: 'task-9',
            idempotency_key: 'key-1',
            at: T0.toISOString(),
          },
        },
      ]);
  });

  test('requested → placed → booting → running → destroying → destroyed', () => {
    given(vmDecider, REQUESTED)
      .when(placeCmd, at(1))
      .then([{ type: 'VmPlaced', data: { vm_id: 'v1', host_id: 'h1', decision, reservation, at: at(1).toISOString() } }]);
    given(vmDecider, PLACED)
      .when(startBoot, at(2))
      .then([{ type: 'VmBootStarted', data: { vm_id: 'v1', host_id: 'h1', at: at(2).toISOString() } }]);
    given(vmDecider, BOOTING)
      .when(booted, at(3))
      .then([{ type: 'VmBooted', data: { ...bootedData, at: at(3).toISOString() } }]);
    given(vmDecider, RUNNING)
      .when(destroy('idle'), at(4))
      .then([{ type: 'VmDestroyRequested', data: { vm_id: 'v1', reason: 'idle', at: at(4).toISOString() } }]);
    given(vmDecider, DESTROYING)
      .when(destroyed, at(5))
      .then([{ type: 'VmDestroyed', data: { vm_id: 'v1', reason: 'client', at: at(5).toISOString() } }]);
  });

  test('the state carries what the command layer needs', () => {
    const running = fold(vmDecider, RUNNING);
    assert.equal(running.status, 'running');
    assert.ok(running.status === 'running');
    assert.equal(running.host_id, 'h1');
    assert.deepEqual(running.reservation, reservation);
    assert.deepEqual(running.decision, decision);
    assert.equal(running.tenant_id, 't1');
    assert.equal(running.task_id, 'task-9');
    assert.equal(running.url, 'http://10.0.0.1:41000');
    assert.equal(running.boot_ms, 850);
    assert.equal(running.auth_token_encrypted, 'v1.ct');
    assert.equal(running.endpoints.length, 1);
    assert.equal(running.requested_at, at(0).toISOString());
    assert.equal(running.transitioned_at, at(3).toISOString());
    assert.equal(running.last_activity_at, at(3).toISOString());
    assert.equal(running.spec.cpus, 2);
    // After the end the host and reservation stay, so the capacity can be released.
    const gone = fold(vmDecider, DESTROYED);
    assert.ok(gone.status === 'destroyed');
    assert.equal(gone.host_id, 'h1');
    assert.deepEqual(gone.reservation, reservation);
    assert.equal(gone.reason, 'client');
  });

  test('every event round-trips through its zod schema', () => {
    for (const e of [...DESTROYED, ...FAILED, ...history(request, placeCmd, startBoot, booted, activity)]) {
      assert.deepEqual(parseVmEvent(e.type, JSON.parse(JSON.stringify(e.data))), e);
    }
  });
});

describe('vm: idempotency', () => {
  test('a retried create with the same idempotency key yields nothing; another key or none is VM_ALREADY_EXISTS', () => {
    given(vmDecider, RUNNING).when(request).then([]);
    given(vmDecider, REQUESTED)
      .when({ type: 'RequestVm', data: { ...(request.data as object), idempotency_key: 'other' } as never })
      .thenThrows('VM_ALREADY_EXISTS', 409);
    given(vmDecider, REQUESTED)
      .when({ type: 'RequestVm', data: { vm_id: 'v1', spec, tenant_id: 't1' } })
      .thenThrows('VM_ALREADY_EXISTS', 409);
  });

  test('repeating a step already taken yields nothing', () => {
    given(vmDecider, PLACED).when(placeCmd).then([]);
    given(vmDecider, BOOTING).when(startBoot).then([]);
    given(vmDecider, RUNNING).when(booted).then([]);
    given(vmDecider, DESTROYING).when(destroy()).then([]);
    given(vmDecider, DESTROYED).when(destroyed).then([]);
  });

  test('destroying an already destroyed or failed VM yields no event', () => {
    given(vmDecider, DESTROYED).when(destroy()).then([]);
    given(vmDecider, FAILED).when(destroy()).then([]);
    given(vmDecider, FAILED).when(destroyed).then([]);
  });

  test('activity is recorded only forward in time (the command layer coalesces)', () => {
    given(vmDecider, RUNNING)
      .when(activity, at(60))
      .then([{ type: 'VmActivityRecorded', data: { vm_id: 'v1', at: at(60).toISOString() } }]);
    given(vmDecider, RUNNING).when(activity, at(3)).then([]);
    const state = given(vmDecider, RUNNING).when(activity, at(60)).thenState();
    assert.ok(state.status === 'running');
    assert.equal(state.last_activity_at, at(60).toISOString());
    assert.equal(state.transitioned_at, at(3).toISOString());
  });
});

describe('vm: failure', () => {
  for (const [name, events] of [
    ['requested', REQUESTED],
    ['placed', PLACED],
    ['booting', BOOTING],
    ['running', RUNNING],
    ['destroying', DESTROYING],
  ] as const) {
    test(`fails from ${name}, recording the phase where it stopped`, () => {
      const g = given(vmDecider, events).when(fail('host_lost'), at(30));
      g.then([
        {
          type: 'VmFailed',
          data: {
            vm_id: 'v1',
            reason: 'host_lost',
            error: 'agent answered 503',
            error_code: 'AGENT_UNAVAILABLE',
            phase: name,
            at: at(30).toISOString(),
          },
        },
      ]);
      const s = g.thenState();
      assert.ok(s.status === 'failed');
      assert.equal(s.phase, name);
      assert.equal(s.error, 'agent answered 503');
    });
  }

  test('a late failure for a VM that already ended yields nothing', () => {
    given(vmDecider, FAILED).when(fail()).then([]);
    given(vmDecider, DESTROYED).when(fail()).then([]);
  });

  test('a failed VM keeps its host and reservation, so the capacity can be released', () => {
    const s = fold(vmDecider, FAILED);
    assert.ok(s.status === 'failed');
    assert.equal(s.host_id, 'h1');
    assert.deepEqual(s.reservation, reservation);
    assert.equal(s.reason, 'error');
    assert.equal(s.error_code, 'AGENT_UNAVAILABLE');
  });
});

describe('vm: illegal transitions', () => {
  test('a command on a VM that does not exist is VM_NOT_FOUND', () => {
    for (const c of [placeCmd, startBoot, booted, activity, destroy(), destroyed, fail()])
      given(vmDecider).when(c).thenThrows('VM_NOT_FOUND', 404);
  });

  test('steps out of order are VM_INVALID_STATE (409)', () => {
    given(vmDecider, RUNNING)
      .when(placeCmd)
      .thenThrows('VM_INVALID_STATE', 409, /vm v1 is running: cannot place it/);
    given(vmDecider, PLACED)
      .when({ ...placeCmd, data: { ...(placeCmd.data as object), host_id: 'h2' } as never })
      .thenThrows('VM_INVALID_STATE');
    given(vmDecider, REQUESTED)
      .when(startBoot)
      .thenThrows('VM_INVALID_STATE', 409, /requested: cannot start booting/);
    given(vmDecider, PLACED)
      .when(booted)
      .thenThrows('VM_INVALID_STATE', 409, /placed: cannot mark it booted/);
    given(vmDecider, BOOTING)
      .when(activity)
      .thenThrows('VM_INVALID_STATE', 409, /booting: cannot record activity/);
    given(vmDecider, RUNNING)
      .when(destroyed)
      .thenThrows('VM_INVALID_STATE', 409, /request its destruction first/);
    given(vmDecider, DESTROYED).when(startBoot).thenThrows('VM_INVALID_STATE');
    given(vmDecider, FAILED).when(booted).thenThrows('VM_INVALID_STATE');
    given(vmDecider, DESTROYING)
      .when(placeCmd)
      .thenThrows('VM_INVALID_STATE', 409, /release the reservation/);
  });

  test('destroying a VM that was never placed ends it at once: nothing exists on a host', () => {
    const g = given(vmDecider, REQUESTED).when(destroy(), at(9));
    g.then([
      { type: 'VmDestroyRequested', data: { vm_id: 'v1', reason: 'client', at: at(9).toISOString() } },
      { type: 'VmDestroyed', data: { vm_id: 'v1', reason: 'client', at: at(9).toISOString() } },
    ]);
    assert.equal(g.thenState().status, 'destroyed');
  });
});
