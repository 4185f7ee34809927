import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { healthDecider, type HealthCommand, type VmHealthState } from './health.decider.js';
import { isHealthEventType, parseHealthEvent, VM_HEALTH_STREAM_PREFIX, type HealthEvent } from './health.events.js';

/** A VM's health verdicts, on a stream of their own so probes never contend with its lifecycle. */
export const vmHealthStream = (vmId: string): string => VM_HEALTH_STREAM_PREFIX + vmId;

export function decodeHealthEvent(r: RecordedEvent): HealthEvent | undefined {
  return isHealthEventType(r.type) ? parseHealthEvent(r.type, r.data) : undefined;
}

export const healthAggregate: Aggregate<HealthCommand, HealthEvent, VmHealthState> = {
  streamName: vmHealthStream,
  decode: decodeHealthEvent,
  decider: healthDecider,
};
