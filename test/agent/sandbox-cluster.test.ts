import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { allocateBridge, parseSubnet } from '../../packages/agent/src/backend/process/network.js';
import { bridgeKeyOf, reserveAddress } from '../../packages/agent/src/backend/process/sandbox-cluster.js';
import type { Persisted } from '../../packages/agent/src/backend/process/sandbox-state.js';

const host = parseSubnet('10.213.0.0/16');
const rec = (ip: string, tenant: string, network?: { id: string; subnet: string }): Persisted =>
  ({ ip, tenant, bridge: 'x', ...(network ? { network } : {}) }) as unknown as Persisted;

describe('cluster networks on the agent (pure parts)', () => {
  it('a network gets a bridge of its own, never its tenant’s nor another network’s', () => {
    const used = [
      { tenant: bridgeKeyOf(rec('10.213.0.2', 'acme')), bridge: 'fbb0' },
      { tenant: bridgeKeyOf(rec('10.213.192.2', 'acme', { id: 'net-a', subnet: '10.213.192.0/24' })), bridge: 'fbb1' },
    ];
    assert.equal(allocateBridge('fb', bridgeKeyOf({ tenant: 'acme', network: { id: 'net-a', subnet: '' } }), false, used), 'fbb1');
    assert.equal(allocateBridge('fb', bridgeKeyOf({ tenant: 'acme', network: { id: 'net-b', subnet: '' } }), false, used), 'fbb2');
    assert.equal(allocateBridge('fb', bridgeKeyOf({ tenant: 'acme' }), false, used), 'fbb0');
  });

  it('a member gets its hint or the lowest free address of its subnet; others stay out of network subnets', () => {
    const net = { id: 'net-a', subnet: '10.213.0.0/24' };
    assert.equal(reserveAddress(host, 'a', net, '10.213.0.9', []).ip, '10.213.0.9');
    assert.equal(
      reserveAddress(host, 'a', net, '10.213.0.9', [rec('10.213.0.9', 'acme', net)]).ip,
      '10.213.0.2',
      'a held hint: the lowest free address',
    );
    assert.equal(reserveAddress(host, 'b', undefined, undefined, [rec('10.213.0.2', 'acme', net)]).ip, '10.213.1.0');
    assert.throws(() => reserveAddress(host, 'a', { id: 'n', subnet: '10.9.0.0/24' }, undefined, []), /inside this host/);
    assert.throws(() => reserveAddress(host, 'a', net, '10.213.5.5', []), /not a member address/);
  });
});
