import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { assertId, VM_STREAM_PREFIX } from '../ids.js';
import { vmDecider, type VmCommand, type VmState } from './vm.decider.js';
import { isVmEventType, parseVmEvent, type VmEvent } from './vm.events.js';

export function vmStream(vmId: string): string {
  assertId(vmId, 'vm_id');
  return VM_STREAM_PREFIX + vmId;
}

export function decodeVmEvent(r: RecordedEvent): VmEvent | undefined {
  return isVmEventType(r.type) ? parseVmEvent(r.type, r.data, r.metadata) : undefined;
}

export const vmAggregate: Aggregate<VmCommand, VmEvent, VmState> = { streamName: vmStream, decode: decodeVmEvent, decider: vmDecider };
