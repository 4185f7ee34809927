import type { Aggregate } from '../aggregate.js';
import { NotFoundError } from '@fleet/agent-protocol';
import type { RecordedEvent } from '../event-store.port.js';
import { isValidId } from '../ids.js';
import { deadLetterDecider, type DeadLetterCommand, type DeadLetterState } from './deadletter.decider.js';
import { DEADLETTER_STREAM_PREFIX, isDeadLetterEventType, parseDeadLetterEvent, type DeadLetterEvent } from './deadletter.events.js';

export function deadLetterStream(id: string): string {
  // Named apart from `id`: the type guard narrows a string that fails the pattern to never.
  const shown: string = id;
  if (!isValidId(id)) throw new NotFoundError('DEAD_LETTER_NOT_FOUND', `dead letter ${shown} does not exist`);
  return DEADLETTER_STREAM_PREFIX + id;
}

export function decodeDeadLetterEvent(r: RecordedEvent): DeadLetterEvent | undefined {
  return isDeadLetterEventType(r.type) ? parseDeadLetterEvent(r.type, r.data) : undefined;
}

export const deadLetterAggregate: Aggregate<DeadLetterCommand, DeadLetterEvent, DeadLetterState> = {
  streamName: deadLetterStream,
  decode: decodeDeadLetterEvent,
  decider: deadLetterDecider,
};
