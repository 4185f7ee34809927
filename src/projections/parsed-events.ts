import type { RecordedEvent } from '../domain/event-store.port.js';
import { parseVmEvent, type VmEvent } from '../domain/vm/vm.events.js';

const vmEvents = new WeakMap<RecordedEvent, VmEvent>();

/**
 * `parseVmEvent` once per recorded event, whichever read models read it: the
 * runner hands the same page objects to every read model, and four of them
 * parse each VM event with its zod schema. Callers must not mutate the result.
 */
export function parsedVmEvent(r: RecordedEvent): VmEvent {
  let e = vmEvents.get(r);
  if (!e) {
    e = parseVmEvent(r.type, r.data, r.metadata);
    vmEvents.set(r, e);
  }
  return e;
}
