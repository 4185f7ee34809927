import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { assertId, HOST_STREAM_PREFIX } from '../ids.js';
import { hostDecider, type HostCommand, type HostState } from './host.decider.js';
import { isHostEventType, parseHostEvent, type HostEvent } from './host.events.js';

export function hostStream(hostId: string): string {
  assertId(hostId, 'host_id');
  return HOST_STREAM_PREFIX + hostId;
}

export function decodeHostEvent(r: RecordedEvent): HostEvent | undefined {
  return isHostEventType(r.type) ? parseHostEvent(r.type, r.data) : undefined;
}

export const hostAggregate: Aggregate<HostCommand, HostEvent, HostState> = {
  streamName: hostStream,
  decode: decodeHostEvent,
  decider: hostDecider,
};
