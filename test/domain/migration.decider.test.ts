import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import {
  ABANDONED_AFTER_MS,
  decodeMigrationStreamEvent,
  migrationDecider,
  type MigrationCommand,
  type MigrationStreamEvent,
} from '../../src/domain/migration/migration.decider.js';
import type { MigrationStep } from '../../src/domain/migration/migration.events.js';
import type { VmMigrated } from '../../src/domain/vm/vm.events.js';
import { at, given, T0 } from './gwt.js';

const start: MigrationCommand = { type: 'StartMigration', data: { vm_id: 'v1', from_host_id: 'h1', live: false } };
const step = (s: MigrationStep, detail: Record<string, string> = {}): MigrationCommand => ({
  type: 'CompleteMigrationStep',
  data: { vm_id: 'v1', step: s, detail },
});
const fail = (s: MigrationStep): MigrationCommand => ({
  type: 'FailMigration',
  data: { vm_id: 'v1', step: s, error: 'agent answered 503', error_code: 'AGENT_UNAVAILABLE' },
});
const started: MigrationStreamEvent = {
  type: 'VmMigrationStarted',
  data: { vm_id: 'v1', from_host_id: 'h1', live: false, at: T0.toISOString() },
};
const done = (s: MigrationStep, seconds: number, detail: Record<string, string> = {}): MigrationStreamEvent => ({
  type: 'VmMigrationStepCompleted',
  data: { vm_id: 'v1', step: s, detail, at: at(seconds).toISOString() },
});
const migrated: VmMigrated = {
  type: 'VmMigrated',
  data: {
    vm_id: 'v1',
    from_host_id: 'h1',
    host_id: 'h2',
    decision: {
      host_id: 'h2',
      policy: 'spread',
      candidates: 1,
      headroom_cpus: 1,
      headroom_ram: 1,
      artifact_local: true,
      artifact_holders: 1,
    },
    reservation: { cpus: 1, ram_mb: 256, storage_gb: 1, gpus: 0, gpu_uuids: [], mig_instance_uuids: [] },
    snapshot_id: 's1',
    url: '',
    endpoints: [],
    at: at(5).toISOString(),
  },
};
const beforeSwitch = [started, done('snapshot', 1), done('place', 2, { host_id: 'h2' }), done('move', 3), done('boot', 4)];

describe('migration decider', () => {
  test('Given no migration, When it starts, Then VmMigrationStarted', () => {
    given(migrationDecider).when(start).then([started]);
  });

  test('Given a migration in flight, When another starts, Then MIGRATION_IN_PROGRESS (409); once abandoned it may start again', () => {
    given(migrationDecider, [started, done('snapshot', 1)])
      .when(start, at(60))
      .thenThrows('MIGRATION_IN_PROGRESS', 409);
    const later = new Date(at(1).getTime() + ABANDONED_AFTER_MS);
    given(migrationDecider, [started, done('snapshot', 1)])
      .when(start, later)
      .then([{ ...started, data: { ...started.data, at: later.toISOString() } }]);
  });

  test('Given a switched lazy move still paging in, When another starts long after its last step, Then MIGRATION_IN_PROGRESS', () => {
    const lazyStarted: MigrationStreamEvent = { ...started, data: { ...started.data, live: true, lazy: true } };
    const paging = [lazyStarted, ...beforeSwitch.slice(1), migrated];
    const muchLater = new Date(at(5).getTime() + 3 * ABANDONED_AFTER_MS);
    given(migrationDecider, paging).when(start, muchLater).thenThrows('MIGRATION_IN_PROGRESS', 409);
    // Not lazy, or lazy but not yet switched: abandoned after ABANDONED_AFTER_MS as before.
    given(migrationDecider, [...beforeSwitch, migrated])
      .when(start, muchLater)
      .events();
    given(migrationDecider, [lazyStarted, ...beforeSwitch.slice(1)])
      .when(start, muchLater)
      .events();
    // Its end (destroy_source and cleanup, or a failure) frees the VM.
    given(migrationDecider, [...paging, done('destroy_source', 6), done('cleanup', 7)])
      .when(start, muchLater)
      .events();
  });

  test('Given a failed or finished migration, When another starts, Then it starts', () => {
    given(migrationDecider, [
      started,
      { type: 'VmMigrationFailed', data: { vm_id: 'v1', step: 'place', error: 'x', at: at(1).toISOString() } },
    ])
      .when(start, at(2))
      .events();
    given(migrationDecider, [...beforeSwitch, migrated, done('destroy_source', 6), done('cleanup', 7)])
      .when(start, at(8))
      .events();
  });

  test('steps come in order, before the switch; the place step names the target', () => {
    given(migrationDecider, [started])
      .when(step('snapshot', { snapshot_id: 's1' }), at(1))
      .then([done('snapshot', 1, { snapshot_id: 's1' })]);
    given(migrationDecider, [started, done('snapshot', 1), done('place', 2)])
      .when(step('snapshot'), at(3))
      .thenThrows('MIGRATION_STEP_OUT_OF_ORDER', 409);
    given(migrationDecider, [started, done('snapshot', 1)])
      .when(step('snapshot'), at(3))
      .thenThrows('MIGRATION_STEP_OUT_OF_ORDER');
    given(migrationDecider, beforeSwitch)
      .when(step('destroy_source'), at(5))
      .thenThrows('MIGRATION_STEP_OUT_OF_ORDER', 409, /after the switch|cannot follow boot/);
    const s = given(migrationDecider, beforeSwitch).state;
    assert.equal(s.status === 'in_progress' && s.target_host_id, 'h2');
  });

  test('Given VmMigrated (the switch), Then only destroy_source and cleanup follow; destroy_source may be skipped; cleanup ends it', () => {
    given(migrationDecider, [...beforeSwitch, migrated])
      .when(step('boot'), at(6))
      .thenThrows('MIGRATION_STEP_OUT_OF_ORDER');
    given(migrationDecider, [...beforeSwitch, migrated])
      .when(step('cleanup', { snapshot_id: 's1' }), at(6))
      .then([done('cleanup', 6, { snapshot_id: 's1' })]);
    assert.deepEqual(
      given(migrationDecider, [...beforeSwitch, migrated])
        .when(step('cleanup'), at(6))
        .thenState(),
      { status: 'ended' },
    );
    given(migrationDecider, [...beforeSwitch, migrated])
      .when(step('switch'), at(6))
      .thenThrows('INTERNAL', 500);
  });

  test('Given no migration in flight, When a step or a failure is recorded, Then MIGRATION_NOT_IN_PROGRESS', () => {
    given(migrationDecider).when(step('snapshot')).thenThrows('MIGRATION_NOT_IN_PROGRESS', 409);
    given(migrationDecider).when(fail('place')).thenThrows('MIGRATION_NOT_IN_PROGRESS', 409);
  });

  test('Given a migration in flight, When it fails, Then VmMigrationFailed and it is over', () => {
    const g = given(migrationDecider, [started, done('snapshot', 1)]).when(fail('place'), at(2));
    g.then([
      {
        type: 'VmMigrationFailed',
        data: { vm_id: 'v1', step: 'place', error: 'agent answered 503', error_code: 'AGENT_UNAVAILABLE', at: at(2).toISOString() },
      },
    ]);
    assert.deepEqual(g.thenState(), { status: 'ended' });
  });

  test('every event it decides parses back through the stream decoder; other VM events are not its own', () => {
    const rec = (e: { type: string; data: unknown }): RecordedEvent => ({
      id: '',
      streamId: 'vm-v1',
      type: e.type,
      revision: 0n,
      position: '',
      data: JSON.parse(JSON.stringify(e.data)) as never,
      metadata: {},
      created: T0,
    });
    for (const e of [...beforeSwitch, migrated, done('cleanup', 7)]) assert.deepEqual(decodeMigrationStreamEvent(rec(e)), e);
    assert.equal(decodeMigrationStreamEvent(rec({ type: 'VmActivityRecorded', data: { vm_id: 'v1', at: T0.toISOString() } })), undefined);
    assert.throws(
      () =>
        decodeMigrationStreamEvent(
          rec({ type: 'VmMigrationStepCompleted', data: { vm_id: 'v1', step: 'teleport', detail: {}, at: T0.toISOString() } }),
        ),
      /STORED_EVENT_INVALID|does not match/,
    );
  });

  test('A live migration records its downtime on the boot step, and the event parses back', () => {
    const events = given(migrationDecider, [started, done('snapshot', 1), done('place', 2, { host_id: 'h2' }), done('move', 3)])
      .when({ type: 'CompleteMigrationStep', data: { vm_id: 'v1', step: 'boot', detail: {}, downtime_ms: 420 } })
      .events();
    assert.equal(events.length, 1);
    const e = events[0]!;
    const back = decodeMigrationStreamEvent({
      id: '',
      streamId: 'vm-v1',
      type: e.type,
      revision: 0n,
      position: '',
      data: JSON.parse(JSON.stringify(e.data)) as never,
      metadata: {},
      created: T0,
    });
    assert.equal(back?.type === 'VmMigrationStepCompleted' ? back.data.downtime_ms : undefined, 420);
  });

  test('A lazy migration says so on its start, which parses back; its state keeps it', () => {
    const events = given(migrationDecider)
      .when({ type: 'StartMigration', data: { vm_id: 'v1', from_host_id: 'h1', target_host_id: 'h2', live: true, lazy: true } })
      .events();
    const e = events[0]!;
    const back = decodeMigrationStreamEvent({
      id: '',
      streamId: 'vm-v1',
      type: e.type,
      revision: 0n,
      position: '',
      data: JSON.parse(JSON.stringify(e.data)) as never,
      metadata: {},
      created: T0,
    });
    assert.equal(back?.type === 'VmMigrationStarted' ? back.data.lazy : undefined, true);
    const state = given(migrationDecider, [back!, done('snapshot', 1), done('place', 2, { host_id: 'h2' })]).state;
    assert.equal(state.status === 'in_progress' ? state.lazy : undefined, true);
    const plain = given(migrationDecider, [started]).state;
    assert.equal(plain.status === 'in_progress' ? plain.lazy : undefined, false, 'a start from before the field reads as not lazy');
  });
});
