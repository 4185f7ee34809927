import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { standbyDecider, type StandbyCommand, type StandbyState } from './standby.decider.js';
import { isStandbyEventType, parseStandbyEvent, VM_STANDBY_STREAM_PREFIX, type StandbyEvent } from './standby.events.js';

export const vmStandbyStream = (vmId: string): string => VM_STANDBY_STREAM_PREFIX + vmId;

export function decodeStandbyEvent(r: RecordedEvent): StandbyEvent | undefined {
  return isStandbyEventType(r.type) ? parseStandbyEvent(r.type, r.data) : undefined;
}

export const standbyAggregate: Aggregate<StandbyCommand, StandbyEvent, StandbyState> = {
  streamName: vmStandbyStream,
  decode: decodeStandbyEvent,
  decider: standbyDecider,
};
