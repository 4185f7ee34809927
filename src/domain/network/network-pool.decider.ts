import { ConflictError, ValidationError } from '@fleet/agent-protocol';
import { assertNever, type DecideContext, type Decider } from '../decider.js';
import { contains, intToIp, overlaps, parseCidr, type Cidr } from './ipv4.js';
import type { PoolEvent } from './network.events.js';

/**
 * The operator's pool of network subnets (NETWORK_POOL): one stream, so that
 * two networks never get overlapping subnets (members' addresses are unique
 * on a host, and a network may move hosts once it has no live member).
 */
export type PoolCommand =
  | {
      type: 'AllocateSubnet';
      data: { network_id: string; pool: string; prefix_len: number; subnet?: string | undefined };
    }
  | { type: 'ReleaseSubnet'; data: { network_id: string } };

export interface PoolState {
  readonly allocated: ReadonlyMap<string, string>;
}

function mustCidr(value: string, path: string): Cidr {
  const c = parseCidr(value);
  if (!c)
    throw new ValidationError(
      `${path} "${value}" is not an IPv4 subnet (a.b.c.d/n, host bits zero)`,
      [{ path, message: 'invalid' }],
      'INVALID_SUBNET',
    );
  return c;
}

export function decidePool(command: PoolCommand, state: PoolState, ctx: DecideContext): PoolEvent[] {
  const at = ctx.now.toISOString();
  switch (command.type) {
    case 'AllocateSubnet': {
      const d = command.data;
      const have = state.allocated.get(d.network_id);
      if (have !== undefined) return [];
      const pool = mustCidr(d.pool, 'NETWORK_POOL');
      const taken = [...state.allocated.values()].map((s) => mustCidr(s, 'subnet'));
      if (d.subnet !== undefined) {
        const want = mustCidr(d.subnet, 'subnet');
        if (!contains(pool, want) || want.prefixLen > 29)
          throw new ValidationError(
            `subnet ${want.cidr} must lie inside the network pool ${pool.cidr} and hold at least 6 addresses (/29 or larger)`,
            [{ path: 'subnet', message: `outside ${pool.cidr}` }],
            'SUBNET_OUTSIDE_POOL',
          );
        if (taken.some((t) => overlaps(t, want)))
          throw new ConflictError('SUBNET_IN_USE', `subnet ${want.cidr} overlaps another network's`, { subnet: want.cidr });
        return [{ type: 'SubnetAllocated', data: { network_id: d.network_id, subnet: want.cidr, at } }];
      }
      const size = 2 ** (32 - d.prefix_len);
      for (let n = pool.network; n + size <= pool.network + pool.size; n += size) {
        const c = parseCidr(`${intToIp(n)}/${d.prefix_len}`);
        if (c && !taken.some((t) => overlaps(t, c)))
          return [{ type: 'SubnetAllocated', data: { network_id: d.network_id, subnet: c.cidr, at } }];
      }
      throw new ConflictError('NETWORK_POOL_EXHAUSTED', `no free /${d.prefix_len} left in the network pool ${pool.cidr}`);
    }
    case 'ReleaseSubnet':
      return state.allocated.has(command.data.network_id)
        ? [{ type: 'SubnetReleased', data: { network_id: command.data.network_id, at } }]
        : [];
    default:
      return assertNever(command, 'pool command');
  }
}

export function evolvePool(state: PoolState, event: PoolEvent): PoolState {
  const allocated = new Map(state.allocated);
  switch (event.type) {
    case 'SubnetAllocated':
      allocated.set(event.data.network_id, event.data.subnet);
      return { allocated };
    case 'SubnetReleased':
      allocated.delete(event.data.network_id);
      return { allocated };
    default:
      return assertNever(event, 'pool event');
  }
}

export const poolDecider: Decider<PoolCommand, PoolEvent, PoolState> = {
  decide: decidePool,
  evolve: evolvePool,
  initialState: { allocated: new Map() },
};
