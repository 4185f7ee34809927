import type { Aggregate } from '../aggregate.js';
import { assertNever, compact, type Decider } from '../decider.js';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import type { RecordedEvent } from '../event-store.port.js';
import { vmStream } from '../vm/vm.aggregate.js';
import { parseVmEvent, type VmMigrated } from '../vm/vm.events.js';
import { isMigrationEventType, MIGRATION_STEPS, parseMigrationEvent, type MigrationEvent, type MigrationStep } from './migration.events.js';

/**
 * A VM's migrations (cold, or live: the same steps, `snapshot` being the freeze), decided on the VM's own stream: one attempt at a
 * time, its steps in order (`destroy_source` may be skipped: a source the
 * flow could not destroy is the reconciler's to collect), the steps after
 * `switch` only once VmMigrated moved the VM. An attempt that stopped
 * reporting for `ABANDONED_AFTER_MS` (its process died) no longer blocks a
 * new one, except a switched lazy move: its target still faults pages in
 * from the source, whatever the time since its last step (a large guest on a
 * slow link pages in for longer than that), and the reconciler's adopted watch
 * ends it; a new move of the VM before then would leave the target without
 * its pages.
 */
export type MigrationCommand =
  | {
      readonly type: 'StartMigration';
      readonly data: {
        readonly vm_id: string;
        readonly from_host_id: string;
        readonly target_host_id?: string | undefined;
        readonly live: boolean;
        readonly lazy?: boolean | undefined;
      };
    }
  | {
      readonly type: 'CompleteMigrationStep';
      readonly data: {
        readonly vm_id: string;
        readonly step: MigrationStep;
        readonly detail: Record<string, string>;
        readonly downtime_ms?: number | undefined;
      };
    }
  | {
      readonly type: 'FailMigration';
      readonly data: {
        readonly vm_id: string;
        readonly step: MigrationStep;
        readonly error: string;
        readonly error_code?: string | undefined;
      };
    };

export type MigrationState =
  | { readonly status: 'none' }
  | {
      readonly status: 'in_progress';
      readonly from_host_id: string;
      /** Named by the caller or by the `place` step; until then a reservation of the attempt may be on any host. */
      readonly target_host_id: string | undefined;
      readonly last_step: MigrationStep | undefined;
      readonly switched: boolean;
      readonly last_at: string;
      /** Post-copy: after the switch its source still holds the VM's memory pages, until `destroy_source`. */
      readonly lazy: boolean;
      /** The capture the `snapshot` step took (a lazy move's pages are served from it until done), or a qemu move's stream id (`place`). */
      readonly checkpoint_id: string | undefined;
    }
  | { readonly status: 'ended' };

/** What the migration decider folds: its own events, and VmMigrated (the `switch` step). */
export type MigrationStreamEvent = MigrationEvent | VmMigrated;

export const ABANDONED_AFTER_MS = 10 * 60_000;

/** Whether a migration in `state` still holds the VM: one in progress that reported within `ABANDONED_AFTER_MS`, or a switched lazy move paging in. */
export function blocksNewMigration(state: MigrationState, now: Date): state is Extract<MigrationState, { status: 'in_progress' }> {
  if (state.status !== 'in_progress') return false;
  if (state.switched && state.lazy) return true;
  return now.getTime() - Date.parse(state.last_at) < ABANDONED_AFTER_MS;
}

const indexOf = (step: MigrationStep | undefined): number => (step === undefined ? -1 : MIGRATION_STEPS.indexOf(step));

function decide(command: MigrationCommand, state: MigrationState, ctx: { now: Date }): MigrationEvent[] {
  const at = ctx.now.toISOString();
  const { vm_id } = command.data;
  switch (command.type) {
    case 'StartMigration': {
      if (blocksNewMigration(state, ctx.now)) {
        throw new ConflictError(
          'MIGRATION_IN_PROGRESS',
          `vm ${vm_id} is already being migrated (last step: ${state.last_step ?? 'started'}); wait for it to finish`,
          { vm_id },
        );
      }
      return [{ type: 'VmMigrationStarted', data: compact({ ...command.data, at }) }];
    }
    case 'CompleteMigrationStep': {
      const { step } = command.data;
      const s = inProgress(state, vm_id, `complete its ${step} step`);
      if (step === 'switch') throw new AppError('INTERNAL', 500, `vm ${vm_id}: the switch step is VmMigrated, not a step event`);
      const afterSwitch = indexOf(step) > indexOf('switch');
      if (afterSwitch !== s.switched || indexOf(step) <= indexOf(s.last_step)) {
        throw new ConflictError(
          'MIGRATION_STEP_OUT_OF_ORDER',
          `vm ${vm_id}: migration step ${step} cannot follow ${s.last_step ?? 'the start'}${s.switched ? ' after the switch' : ''}`,
          { vm_id, step, last_step: s.last_step },
        );
      }
      const { downtime_ms } = command.data;
      return [{ type: 'VmMigrationStepCompleted', data: compact({ vm_id, step, detail: { ...command.data.detail }, downtime_ms, at }) }];
    }
    case 'FailMigration': {
      inProgress(state, vm_id, 'record its failure');
      return [{ type: 'VmMigrationFailed', data: compact({ ...command.data, at }) }];
    }
    default:
      return assertNever(command, 'migration command');
  }
}

function inProgress(state: MigrationState, vmId: string, what: string): Extract<MigrationState, { status: 'in_progress' }> {
  if (state.status !== 'in_progress')
    throw new ConflictError('MIGRATION_NOT_IN_PROGRESS', `vm ${vmId} has no migration in progress: cannot ${what}`, { vm_id: vmId });
  return state;
}

function evolve(state: MigrationState, event: MigrationStreamEvent): MigrationState {
  switch (event.type) {
    case 'VmMigrationStarted':
      return {
        status: 'in_progress',
        from_host_id: event.data.from_host_id,
        target_host_id: event.data.target_host_id,
        last_step: undefined,
        switched: false,
        last_at: event.data.at,
        lazy: event.data.lazy === true,
        checkpoint_id: undefined,
      };
    case 'VmMigrationStepCompleted':
      if (state.status !== 'in_progress') return state;
      if (event.data.step === 'cleanup') return { status: 'ended' };
      return {
        ...state,
        last_step: event.data.step,
        last_at: event.data.at,
        target_host_id: event.data.step === 'place' ? (event.data.detail.host_id ?? state.target_host_id) : state.target_host_id,
        checkpoint_id:
          event.data.step === 'snapshot' || event.data.step === 'place'
            ? (event.data.detail.checkpoint_id ?? event.data.detail.migration_id ?? state.checkpoint_id)
            : state.checkpoint_id,
      };
    case 'VmMigrated':
      return state.status === 'in_progress' ? { ...state, last_step: 'switch', switched: true, last_at: event.data.at } : state;
    case 'VmMigrationFailed':
      return { status: 'ended' };
    default:
      return assertNever(event, 'migration event');
  }
}

export const migrationDecider: Decider<MigrationCommand, MigrationStreamEvent, MigrationState> = {
  decide,
  evolve,
  initialState: { status: 'none' },
};

/** The VM stream as the migration decider reads it: its own events and VmMigrated. */
export function decodeMigrationStreamEvent(r: RecordedEvent): MigrationStreamEvent | undefined {
  if (isMigrationEventType(r.type)) return parseMigrationEvent(r.type, r.data);
  if (r.type === 'VmMigrated') return parseVmEvent(r.type, r.data) as VmMigrated;
  return undefined;
}

/** On the VM's own stream, so a migration reads as part of the VM's story. */
export const migrationAggregate: Aggregate<MigrationCommand, MigrationStreamEvent, MigrationState> = {
  streamName: vmStream,
  decode: decodeMigrationStreamEvent,
  decider: migrationDecider,
};
