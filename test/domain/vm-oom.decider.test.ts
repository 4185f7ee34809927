import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { validateVmSpec } from '../../src/domain/vm/spec.js';
import { vmDecider, type VmCommand, type VmState } from '../../src/domain/vm/vm.decider.js';
import { parseVmEvent, type VmEvent } from '../../src/domain/vm/vm.events.js';
import { at, given } from './gwt.js';

/** OOM kills on the VM stream: one event per kill, the host's cumulative count making a repeated report a no-op. */

const spec = validateVmSpec({ cpus: 1, ram_mb: 128 });
const request: VmCommand = { type: 'RequestVm', data: { vm_id: 'v1', spec, tenant_id: 't1' } };
const kill = (count: number, process = 'dd', pid?: number): VmCommand => ({
  type: 'RecordOomKill',
  data: { vm_id: 'v1', process, pid, limit_mb: 128, count, at: at(30).toISOString() },
});

function history(...commands: VmCommand[]): VmEvent[] {
  const events: VmEvent[] = [];
  let state: VmState = vmDecider.initialState;
  commands.forEach((c, i) => {
    for (const e of vmDecider.decide(c, state, { now: at(i) })) {
      state = vmDecider.evolve(state, e);
      events.push(e);
    }
  });
  return events;
}

describe('vm decider: OOM kills', () => {
  test('a kill is recorded with the time the host saw it, and parses back', () => {
    const [e] = given(vmDecider, history(request))
      .when(kill(1, 'dd', 7))
      .events();
    assert.deepEqual(e, {
      type: 'VmOomKilled',
      data: { vm_id: 'v1', process: 'dd', pid: 7, limit_mb: 128, count: 1, at: at(30).toISOString() },
    });
    assert.deepEqual(parseVmEvent(e.type, JSON.parse(JSON.stringify(e.data))), e);
  });

  test('a count already recorded is not recorded again; a higher one is', () => {
    const after = history(request, kill(1), kill(2, 'sh'));
    given(vmDecider, after).when(kill(2)).then([]);
    given(vmDecider, after).when(kill(1)).then([]);
    assert.equal(given(vmDecider, after).when(kill(3)).events().length, 1);
  });

  test('an unknown VM is VM_NOT_FOUND', () => {
    given(vmDecider, []).when(kill(1)).thenThrows('VM_NOT_FOUND');
  });
});
