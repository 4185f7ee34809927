import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { TENANT_STREAM_PREFIX } from '../snapshot/snapshot.events.js';
import {
  isTenantEventType,
  parseTenantEvent,
  tenantDecider,
  type TenantCommand,
  type TenantEvent,
  type TenantState,
} from './tenant.decider.js';

export const tenantStream = (tenantId: string): string => `${TENANT_STREAM_PREFIX}${tenantId}`;

export function decodeTenantEvent(r: RecordedEvent): TenantEvent | undefined {
  return isTenantEventType(r.type) ? parseTenantEvent(r.type, r.data) : undefined;
}

export const tenantAggregate: Aggregate<TenantCommand, TenantEvent, TenantState> = {
  streamName: tenantStream,
  decode: decodeTenantEvent,
  decider: tenantDecider,
};
