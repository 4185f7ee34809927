import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { snapshotDecider, type SnapshotAggregate, type SnapshotCommand } from './snapshot.decider.js';
import { isSnapshotEventType, parseSnapshotEvent, SNAPSHOT_STREAM_PREFIX, type SnapshotEvent } from './snapshot.events.js';

export const snapshotStream = (id: string): string => `${SNAPSHOT_STREAM_PREFIX}${id}`;

export function decodeSnapshotEvent(r: RecordedEvent): SnapshotEvent | undefined {
  return isSnapshotEventType(r.type) ? parseSnapshotEvent(r.type, r.data) : undefined;
}

export const snapshotAggregate: Aggregate<SnapshotCommand, SnapshotEvent, SnapshotAggregate> = {
  streamName: snapshotStream,
  decode: decodeSnapshotEvent,
  decider: snapshotDecider,
};
