import { assertNever, compact, type DecideContext, type Decider } from '../decider.js';
import { ConflictError, NotFoundError } from '@fleet/agent-protocol';
import type { DeadLetterEvent, DeadLetterKind } from './deadletter.events.js';

export type DeadLetterCommand =
  | {
      readonly type: 'RecordDeadLetter';
      readonly data: {
        readonly id: string;
        readonly kind: DeadLetterKind;
        readonly entity_id: string;
        readonly host_id: string;
        readonly vm_id?: string | undefined;
        readonly reason: string;
        readonly error_code?: string | undefined;
        readonly retry_count: number;
        readonly first_failed_at: string;
      };
    }
  | { readonly type: 'RetryDeadLetter'; readonly data: { readonly id: string; readonly actor: string } }
  | {
      readonly type: 'DiscardDeadLetter';
      readonly data: { readonly id: string; readonly actor: string; readonly note?: string | undefined };
    }
  | { readonly type: 'ResolveDeadLetter'; readonly data: { readonly id: string; readonly outcome: 'succeeded' | 'gone' } };

/**
 * open: the reconciler skips it until an operator acts. retrying: an operator
 * asked again; the reconciler retries with a fresh count (and dead-letters it
 * again if it keeps failing). discarded: the operator took it over; the
 * reconciler never touches it again. resolved: done.
 */
export type DeadLetterStatus = 'open' | 'retrying' | 'discarded' | 'resolved';

export type DeadLetterState =
  | { readonly status: 'none' }
  | {
      readonly status: DeadLetterStatus;
      readonly id: string;
      readonly kind: DeadLetterKind;
      readonly entity_id: string;
      readonly host_id: string;
      readonly vm_id: string | undefined;
      readonly reason: string;
      readonly error_code: string | undefined;
      readonly retry_count: number;
      readonly first_failed_at: string;
      readonly updated_at: string;
    };

export const initialDeadLetterState: DeadLetterState = { status: 'none' };

export function decideDeadLetter(command: DeadLetterCommand, state: DeadLetterState, ctx: DecideContext): DeadLetterEvent[] {
  const at = ctx.now.toISOString();
  const id = command.data.id;
  switch (command.type) {
    case 'RecordDeadLetter': {
      if (state.status === 'open' || state.status === 'discarded') return [];
      const d = command.data;
      const retry_count = (state.status === 'retrying' ? state.retry_count : 0) + d.retry_count;
      return [
        {
          type: 'DeadLettered',
          data: compact({
            ...d,
            retry_count,
            first_failed_at: state.status === 'none' || state.status === 'resolved' ? d.first_failed_at : state.first_failed_at,
            at,
          }),
        },
      ];
    }
    case 'RetryDeadLetter': {
      if (state.status === 'none') throw new NotFoundError('DEAD_LETTER_NOT_FOUND', `dead letter ${id} does not exist`, { id });
      if (state.status === 'retrying') return [];
      if (state.status === 'resolved')
        throw new ConflictError('DEAD_LETTER_RESOLVED', `dead letter ${id} is already resolved: nothing to retry`, { id });
      return [{ type: 'DeadLetterRetryRequested', data: { id, actor: command.data.actor, at } }];
    }
    case 'DiscardDeadLetter': {
      if (state.status === 'none') throw new NotFoundError('DEAD_LETTER_NOT_FOUND', `dead letter ${id} does not exist`, { id });
      if (state.status === 'discarded') return [];
      if (state.status === 'resolved')
        throw new ConflictError('DEAD_LETTER_RESOLVED', `dead letter ${id} is already resolved: nothing to discard`, { id });
      return [{ type: 'DeadLetterDiscarded', data: compact({ id, actor: command.data.actor, note: command.data.note, at }) }];
    }
    case 'ResolveDeadLetter': {
      if (state.status === 'none' || state.status === 'resolved') return [];
      return [{ type: 'DeadLetterResolved', data: { id, outcome: command.data.outcome, at } }];
    }
    default:
      return assertNever(command, 'dead-letter command');
  }
}

export function evolveDeadLetter(state: DeadLetterState, event: DeadLetterEvent): DeadLetterState {
  switch (event.type) {
    case 'DeadLettered': {
      const d = event.data;
      return {
        status: 'open',
        id: d.id,
        kind: d.kind,
        entity_id: d.entity_id,
        host_id: d.host_id,
        vm_id: d.vm_id,
        reason: d.reason,
        error_code: d.error_code,
        retry_count: d.retry_count,
        first_failed_at: d.first_failed_at,
        updated_at: d.at,
      };
    }
    case 'DeadLetterRetryRequested':
      return state.status === 'none' ? state : { ...state, status: 'retrying', updated_at: event.data.at };
    case 'DeadLetterDiscarded':
      return state.status === 'none' ? state : { ...state, status: 'discarded', updated_at: event.data.at };
    case 'DeadLetterResolved':
      return state.status === 'none' ? state : { ...state, status: 'resolved', updated_at: event.data.at };
    default:
      return assertNever(event, 'dead-letter event');
  }
}

export const deadLetterDecider: Decider<DeadLetterCommand, DeadLetterEvent, DeadLetterState> = {
  decide: decideDeadLetter,
  evolve: evolveDeadLetter,
  initialState: initialDeadLetterState,
};
