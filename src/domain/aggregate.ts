import type { Decider } from './decider.js';
import type { RecordedEvent } from './event-store.port.js';

/**
 * One aggregate as the command side handles it (after emmett's
 * `CommandHandler({ evolve, initialState })`): where its events live, how a
 * stored event reads back, and the decider. Each lives beside its events;
 * nothing else names its streams or parses its events.
 */
export interface Aggregate<C, E, S> {
  /** The stream of the instance with this id; throws a 4xx for an id that cannot name one. */
  readonly streamName: (id: string) => string;
  /** A stored event as this aggregate's event, undefined when it is not one of them; throws on one that fails its schema. */
  readonly decode: (recorded: RecordedEvent) => E | undefined;
  readonly decider: Decider<C, E, S>;
}
