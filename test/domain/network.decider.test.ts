import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { poolDecider } from '../../src/domain/network/network-pool.decider.js';
import { networkDecider } from '../../src/domain/network/network.decider.js';
import { networkEventSchema, parseNetworkEvent, parsePoolEvent, type NetworkEvent } from '../../src/domain/network/network.events.js';
import { given, T0 } from './gwt.js';

const at = T0.toISOString();
const created: NetworkEvent = {
  type: 'NetworkCreated',
  data: { network_id: 'net-1', tenant_id: 'acme', name: 'c', subnet: '10.213.192.0/29', at },
};
const joined = (vm: string, ip: string, host = 'h1'): NetworkEvent => ({
  type: 'NetworkMemberJoined',
  data: { network_id: 'net-1', vm_id: vm, ip, host_id: host, at },
});
const join = (vm: string, live: string[], ip_hint?: string, host = 'h1', tenant = 'acme') => ({
  type: 'JoinNetwork' as const,
  data: { network_id: 'net-1', tenant_id: tenant, vm_id: vm, host_id: host, ip_hint, live },
});

describe('network decider (Reserve, pin, delete)', () => {
  it('honours a free hint, else takes the lowest free address; an ended member frees its address', () => {
    given(networkDecider, [created])
      .when(join('a', [], '10.213.192.5'))
      .then([joined('a', '10.213.192.5')]);
    given(networkDecider, [created, joined('a', '10.213.192.2')])
      .when(join('b', ['a'], '10.213.192.2'))
      .then([joined('b', '10.213.192.3')]);
    given(networkDecider, [created, joined('a', '10.213.192.2')])
      .when(join('b', [], '10.213.192.2'))
      .then([joined('b', '10.213.192.2')]);
    given(networkDecider, [created, joined('a', '10.213.192.2')])
      .when(join('a', ['a']))
      .then([]);
  });

  it('refuses a hint outside the subnet, a full network, another tenant and another host than the live members’', () => {
    given(networkDecider, [created])
      .when(join('a', [], '10.213.192.7'))
      .thenThrows('IP_HINT_OUTSIDE_SUBNET', 400);
    const full = ['2', '3', '4', '5', '6'].map((n, i) => joined(`m${i}`, `10.213.192.${n}`));
    given(networkDecider, [created, ...full])
      .when(join('x', ['m0', 'm1', 'm2', 'm3', 'm4']))
      .thenThrows('NETWORK_FULL', 409);
    given(networkDecider, [created])
      .when(join('a', [], undefined, 'h1', 'globex'))
      .thenThrows('NETWORK_NOT_FOUND', 404);
    given(networkDecider, [created, joined('a', '10.213.192.2', 'h1')])
      .when(join('b', ['a'], undefined, 'h2'))
      .thenThrows('NETWORK_HOST_MISMATCH', 409);
    // No live member: the network may start over on another host.
    given(networkDecider, [created, joined('a', '10.213.192.2', 'h1')])
      .when(join('b', [], undefined, 'h2'))
      .then([joined('b', '10.213.192.2', 'h2')]);
  });

  it('delete is refused while a member is live, idempotent after', () => {
    const del = (live: string[], tenant = 'acme') => ({
      type: 'DeleteNetwork' as const,
      data: { network_id: 'net-1', tenant_id: tenant, live },
    });
    given(networkDecider, [created, joined('a', '10.213.192.2')])
      .when(del(['a']))
      .thenThrows('NETWORK_HAS_MEMBERS', 409);
    given(networkDecider, [created]).when(del([], 'globex')).thenThrows('NETWORK_NOT_FOUND', 404);
    const deleted: NetworkEvent = { type: 'NetworkDeleted', data: { network_id: 'net-1', at } };
    given(networkDecider, [created, joined('a', '10.213.192.2')])
      .when(del([]))
      .then([deleted]);
    given(networkDecider, [created, deleted]).when(del([])).then([]);
    given(networkDecider, [created, deleted]).when(join('b', [])).thenThrows('NETWORK_DELETED', 409);
  });

  it('events parse back', () => {
    for (const e of [
      created,
      joined('a', '10.213.192.2'),
      { type: 'NetworkDeleted', data: { network_id: 'net-1', at } },
    ] as NetworkEvent[]) {
      assert.deepEqual(parseNetworkEvent(e.type, JSON.parse(JSON.stringify(e.data))), e);
      assert.ok(networkEventSchema.safeParse(e).success);
    }
    const alloc = { type: 'SubnetAllocated' as const, data: { network_id: 'net-1', subnet: '10.213.192.0/24', at } };
    assert.deepEqual(parsePoolEvent(alloc.type, JSON.parse(JSON.stringify(alloc.data))), alloc);
  });
});

describe('network pool decider', () => {
  const pool = '10.213.192.0/22';
  const alloc = (id: string, subnet?: string) => ({
    type: 'AllocateSubnet' as const,
    data: { network_id: id, pool, prefix_len: 24, subnet },
  });
  const allocated = (id: string, subnet: string) => ({ type: 'SubnetAllocated' as const, data: { network_id: id, subnet, at } });

  it('hands out the lowest free block, never overlapping, idempotent per network', () => {
    given(poolDecider)
      .when(alloc('n1'))
      .then([allocated('n1', '10.213.192.0/24')]);
    given(poolDecider, [allocated('n1', '10.213.192.0/24')])
      .when(alloc('n2'))
      .then([allocated('n2', '10.213.193.0/24')]);
    given(poolDecider, [allocated('n1', '10.213.192.0/24')])
      .when(alloc('n1'))
      .then([]);
    given(poolDecider, [allocated('n1', '10.213.193.0/25')])
      .when(alloc('n2'))
      .then([allocated('n2', '10.213.192.0/24')]);
  });

  it('refuses a subnet outside the pool, overlapping, malformed, and an exhausted pool', () => {
    given(poolDecider).when(alloc('n1', '10.0.0.0/24')).thenThrows('SUBNET_OUTSIDE_POOL', 400);
    given(poolDecider, [allocated('n1', '10.213.192.0/24')])
      .when(alloc('n2', '10.213.192.128/25'))
      .thenThrows('SUBNET_IN_USE', 409);
    given(poolDecider).when(alloc('n1', '10.213.192.1/24')).thenThrows('INVALID_SUBNET', 400);
    const full = ['192', '193', '194', '195'].map((o, i) => allocated(`m${i}`, `10.213.${o}.0/24`));
    given(poolDecider, full).when(alloc('x')).thenThrows('NETWORK_POOL_EXHAUSTED', 409);
  });
});
