import { AppError } from '@fleet/agent-protocol';
import type { Aggregate } from '../aggregate.js';
import type { RecordedEvent } from '../event-store.port.js';
import { assertId } from '../ids.js';
import { poolDecider, type PoolCommand, type PoolState } from './network-pool.decider.js';
import { networkDecider, type NetworkCommand, type NetworkState } from './network.decider.js';
import {
  isNetworkEventType,
  isPoolEventType,
  NETWORK_POOL_STREAM,
  NETWORK_STREAM_PREFIX,
  parseNetworkEvent,
  parsePoolEvent,
  type NetworkEvent,
  type PoolEvent,
} from './network.events.js';

export const networkStream = (id: string): string => {
  assertId(id, 'network_id');
  return `${NETWORK_STREAM_PREFIX}${id}`;
};

export const networkAggregate: Aggregate<NetworkCommand, NetworkEvent, NetworkState> = {
  streamName: networkStream,
  decode: (r: RecordedEvent) => (isNetworkEventType(r.type) ? parseNetworkEvent(r.type, r.data) : undefined),
  decider: networkDecider,
};

export const networkPoolAggregate: Aggregate<PoolCommand, PoolEvent, PoolState> = {
  streamName: (id: string) => {
    if (id !== 'default') throw new AppError('INTERNAL', 500, `unknown network pool ${id}`);
    return NETWORK_POOL_STREAM;
  },
  decode: (r: RecordedEvent) => (isPoolEventType(r.type) ? parsePoolEvent(r.type, r.data) : undefined),
  decider: poolDecider,
};
