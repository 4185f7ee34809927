import { ConflictError } from '@fleet/agent-protocol';
import { assertNever, compact, type DecideContext, type Decider } from '../decider.js';
import type { StandbyEvent } from './standby.events.js';

export interface StandbyCopy {
  readonly checkpoint_id: string;
  readonly host_id: string;
  readonly standby_host_id: string;
  readonly digest: string;
  readonly files: Readonly<Record<string, string>>;
  readonly at: string;
}

export interface StandbyState {
  /** The VM's standby copy: on standby_host_id only (its host's copy is removed once pulled). */
  readonly current: StandbyCopy | undefined;
  /** A tick under way, by whichever replica started it. */
  readonly inflight:
    { readonly checkpoint_id: string; readonly host_id: string; readonly standby_host_id: string; readonly until: string } | undefined;
  readonly last_started_at: string | undefined;
}

export const initialStandbyState: StandbyState = { current: undefined, inflight: undefined, last_started_at: undefined };

export type StandbyCommand =
  | {
      readonly type: 'StartStandbyCheckpoint';
      readonly data: {
        readonly vm_id: string;
        readonly checkpoint_id: string;
        readonly host_id: string;
        readonly standby_host_id: string;
        readonly interval_ms: number;
        readonly lease_ms: number;
      };
    }
  | {
      readonly type: 'CompleteStandbyCheckpoint';
      readonly data: {
        readonly vm_id: string;
        readonly checkpoint_id: string;
        readonly digest: string;
        readonly files: Readonly<Record<string, string>>;
        readonly pause_ms: number;
        readonly moved_bytes: number;
        readonly reused_bytes: number;
      };
    }
  | {
      readonly type: 'FailStandbyCheckpoint';
      readonly data: {
        readonly vm_id: string;
        readonly checkpoint_id: string;
        readonly error: string;
        readonly error_code?: string | undefined;
      };
    }
  | { readonly type: 'DropStandbyCheckpoint'; readonly data: { readonly vm_id: string; readonly reason: 'vm_gone' | 'standby_unfit' } };

/**
 * A tick is started only when none is under way (or the one under way has
 * outlived its lease) and the last one started at least an interval ago: a
 * second replica deciding on the same revision loses the append, re-reads,
 * and finds nothing to do. Only the tick that started can complete.
 */
export function decideStandby(command: StandbyCommand, state: StandbyState, ctx: DecideContext): StandbyEvent[] {
  const now = ctx.now;
  const at = now.toISOString();
  switch (command.type) {
    case 'StartStandbyCheckpoint': {
      const d = command.data;
      if (state.inflight && Date.parse(state.inflight.until) > now.getTime()) return [];
      if (state.last_started_at && now.getTime() - Date.parse(state.last_started_at) < d.interval_ms) return [];
      return [
        {
          type: 'StandbyCheckpointStarted',
          data: {
            vm_id: d.vm_id,
            checkpoint_id: d.checkpoint_id,
            host_id: d.host_id,
            standby_host_id: d.standby_host_id,
            until: new Date(now.getTime() + d.lease_ms).toISOString(),
            at,
          },
        },
      ];
    }
    case 'CompleteStandbyCheckpoint': {
      const d = command.data;
      if (state.current?.checkpoint_id === d.checkpoint_id) return [];
      const inflight = state.inflight;
      if (inflight?.checkpoint_id !== d.checkpoint_id)
        throw new ConflictError(
          'STANDBY_CHECKPOINT_SUPERSEDED',
          `standby checkpoint ${d.checkpoint_id} of vm ${d.vm_id} outlived its lease: another tick replaced it`,
          { vm_id: d.vm_id, checkpoint_id: d.checkpoint_id },
        );
      const prev = state.current;
      return [
        {
          type: 'StandbyCheckpointTaken',
          data: compact({
            vm_id: d.vm_id,
            checkpoint_id: d.checkpoint_id,
            host_id: inflight.host_id,
            standby_host_id: inflight.standby_host_id,
            digest: d.digest,
            files: { ...d.files },
            pause_ms: d.pause_ms,
            moved_bytes: d.moved_bytes,
            reused_bytes: d.reused_bytes,
            supersedes: prev ? { checkpoint_id: prev.checkpoint_id, standby_host_id: prev.standby_host_id } : undefined,
            at,
          }),
        },
      ];
    }
    case 'FailStandbyCheckpoint': {
      const d = command.data;
      if (state.inflight?.checkpoint_id !== d.checkpoint_id) return [];
      return [
        {
          type: 'StandbyCheckpointFailed',
          data: compact({ vm_id: d.vm_id, checkpoint_id: d.checkpoint_id, error: d.error.slice(0, 2000), error_code: d.error_code, at }),
        },
      ];
    }
    case 'DropStandbyCheckpoint': {
      const cur = state.current;
      if (!cur) return [];
      return [
        {
          type: 'StandbyCheckpointDropped',
          data: {
            vm_id: command.data.vm_id,
            checkpoint_id: cur.checkpoint_id,
            standby_host_id: cur.standby_host_id,
            reason: command.data.reason,
            at,
          },
        },
      ];
    }
    default:
      return assertNever(command, 'standby command');
  }
}

export function evolveStandby(state: StandbyState, event: StandbyEvent): StandbyState {
  switch (event.type) {
    case 'StandbyCheckpointStarted': {
      const d = event.data;
      return {
        ...state,
        inflight: { checkpoint_id: d.checkpoint_id, host_id: d.host_id, standby_host_id: d.standby_host_id, until: d.until },
        last_started_at: d.at,
      };
    }
    case 'StandbyCheckpointTaken': {
      const d = event.data;
      return {
        ...state,
        inflight: undefined,
        current: {
          checkpoint_id: d.checkpoint_id,
          host_id: d.host_id,
          standby_host_id: d.standby_host_id,
          digest: d.digest,
          files: d.files,
          at: d.at,
        },
      };
    }
    case 'StandbyCheckpointFailed':
      return state.inflight?.checkpoint_id === event.data.checkpoint_id ? { ...state, inflight: undefined } : state;
    case 'StandbyCheckpointDropped':
      return state.current?.checkpoint_id === event.data.checkpoint_id ? { ...state, current: undefined } : state;
    default:
      return assertNever(event, 'standby event');
  }
}

export const standbyDecider: Decider<StandbyCommand, StandbyEvent, StandbyState> = {
  decide: decideStandby,
  evolve: evolveStandby,
  initialState: initialStandbyState,
};
