import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { standbyDecider, type StandbyCommand } from '../../src/domain/standby/standby.decider.js';
import { decodeStandbyEvent } from '../../src/domain/standby/standby.aggregate.js';
import type { StandbyEvent } from '../../src/domain/standby/standby.events.js';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import { at, given, T0 } from './gwt.js';

const SHA = 'a'.repeat(64);
const INTERVAL = 60_000;
const LEASE = 120_000;
const startCmd = (id: string): StandbyCommand => ({
  type: 'StartStandbyCheckpoint',
  data: { vm_id: 'v1', checkpoint_id: id, host_id: 'h1', standby_host_id: 'h2', interval_ms: INTERVAL, lease_ms: LEASE },
});
const complete = (id: string): StandbyCommand => ({
  type: 'CompleteStandbyCheckpoint',
  data: { vm_id: 'v1', checkpoint_id: id, digest: SHA, files: { 'core-1.img': SHA }, pause_ms: 12, moved_bytes: 100, reused_bytes: 5 },
});
const started = (id: string, seconds: number): StandbyEvent => ({
  type: 'StandbyCheckpointStarted',
  data: {
    vm_id: 'v1',
    checkpoint_id: id,
    host_id: 'h1',
    standby_host_id: 'h2',
    until: new Date(at(seconds).getTime() + LEASE).toISOString(),
    at: at(seconds).toISOString(),
  },
});
const taken = (id: string, seconds: number, supersedes?: string): StandbyEvent => ({
  type: 'StandbyCheckpointTaken',
  data: {
    vm_id: 'v1',
    checkpoint_id: id,
    host_id: 'h1',
    standby_host_id: 'h2',
    digest: SHA,
    files: { 'core-1.img': SHA },
    pause_ms: 12,
    moved_bytes: 100,
    reused_bytes: 5,
    ...(supersedes ? { supersedes: { checkpoint_id: supersedes, standby_host_id: 'h2' } } : {}),
    at: at(seconds).toISOString(),
  },
});

describe('standby checkpoint decider', () => {
  test('the first tick starts; a second replica deciding after it finds one under way and does nothing', () => {
    given(standbyDecider)
      .when(startCmd('standby-v1-00000001'))
      .then([started('standby-v1-00000001', 0)]);
    given(standbyDecider, [started('standby-v1-00000001', 0)])
      .when(startCmd('standby-v1-00000002'), at(1))
      .then([]);
  });

  test('not due before the interval has passed since the last start; due after it', () => {
    const history = [started('standby-v1-00000001', 0), taken('standby-v1-00000001', 2)];
    given(standbyDecider, history).when(startCmd('standby-v1-00000002'), at(59)).then([]);
    given(standbyDecider, history)
      .when(startCmd('standby-v1-00000002'), at(60))
      .then([started('standby-v1-00000002', 60)]);
  });

  test('a tick whose replica died is taken over once its lease is past; the dead one can no longer complete', () => {
    const history = [started('standby-v1-00000001', 0)];
    given(standbyDecider, history).when(startCmd('standby-v1-00000002'), at(119)).then([]);
    const after = [...history, started('standby-v1-00000002', 121)];
    given(standbyDecider, history).when(startCmd('standby-v1-00000002'), at(121)).then([after[1]!]);
    given(standbyDecider, after).when(complete('standby-v1-00000001'), at(122)).thenThrows('STANDBY_CHECKPOINT_SUPERSEDED', 409);
  });

  test('a completed copy supersedes the previous one; a retried completion is a no-op; drop forgets the current copy', () => {
    const first = [started('standby-v1-00000001', 0), taken('standby-v1-00000001', 2)];
    const second = [...first, started('standby-v1-00000002', 60)];
    given(standbyDecider, second)
      .when(complete('standby-v1-00000002'), at(62))
      .then([taken('standby-v1-00000002', 62, 'standby-v1-00000001')]);
    const done = [...second, taken('standby-v1-00000002', 62, 'standby-v1-00000001')];
    given(standbyDecider, done).when(complete('standby-v1-00000002'), at(63)).then([]);
    const s = given(standbyDecider, done)
      .when({ type: 'DropStandbyCheckpoint', data: { vm_id: 'v1', reason: 'vm_gone' } }, at(70))
      .thenState();
    assert.equal(s.current, undefined);
    given(standbyDecider, done)
      .when({ type: 'FailStandbyCheckpoint', data: { vm_id: 'v1', checkpoint_id: 'standby-v1-00000002', error: 'x' } })
      .then([]);
  });

  test('every event parses back from its stored form; a malformed one is STORED_EVENT_INVALID', () => {
    const events: StandbyEvent[] = [
      started('standby-v1-00000001', 0),
      taken('standby-v1-00000001', 2),
      {
        type: 'StandbyCheckpointFailed',
        data: { vm_id: 'v1', checkpoint_id: 'standby-v1-00000003', error: 'agent 503', at: T0.toISOString() },
      },
      {
        type: 'StandbyCheckpointDropped',
        data: { vm_id: 'v1', checkpoint_id: 'standby-v1-00000001', standby_host_id: 'h2', reason: 'vm_gone', at: T0.toISOString() },
      },
    ];
    for (const e of events) {
      const stored = JSON.parse(JSON.stringify(e.data)) as unknown;
      assert.deepEqual(decodeStandbyEvent({ type: e.type, data: stored } as unknown as RecordedEvent), e);
    }
    assert.equal(decodeStandbyEvent({ type: 'VmCreated', data: {} } as unknown as RecordedEvent), undefined);
    assert.throws(
      () => decodeStandbyEvent({ type: 'StandbyCheckpointTaken', data: { vm_id: 'v1' } } as unknown as RecordedEvent),
      /STORED_EVENT_INVALID|does not match/,
    );
  });
});
