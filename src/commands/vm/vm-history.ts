import type { EventStore, RecordedEvent } from '../../domain/event-store.port.js';
import type { ExistingVmState, VmState } from '../../domain/vm/vm.decider.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';

/** `as_of`: a position as the API returns them, or a time. */
export type AsOf = { readonly position: string } | { readonly time: Date };

/** When an event happened (its own `at`), else when it was stored. */
export function eventTime(e: RecordedEvent): string {
  const at = (e.data as { at?: unknown } | null)?.at;
  return typeof at === 'string' ? at : e.created.toISOString();
}

export function upTo(events: readonly RecordedEvent[], asOf: AsOf): RecordedEvent[] {
  return 'position' in asOf
    ? events.filter((e) => e.position <= asOf.position)
    : events.filter((e) => Date.parse(eventTime(e)) <= asOf.time.getTime());
}

/**
 * The VM as it was at `asOf`, folded with the decider from its own events up
 * to that point; undefined when it did not exist yet (or never did).
 */
export async function vmAsOf(store: EventStore, vmId: string, asOf: AsOf): Promise<{ state: ExistingVmState; events: number } | undefined> {
  let stream: string;
  try {
    stream = vmAggregate.streamName(vmId);
  } catch {
    return undefined;
  }
  const events = upTo(await store.readStream(stream), asOf);
  let state: VmState = vmAggregate.decider.initialState;
  for (const r of events) {
    const e = vmAggregate.decode(r);
    if (e) state = vmAggregate.decider.evolve(state, e);
  }
  return state.status === 'initial' ? undefined : { state, events: events.length };
}
