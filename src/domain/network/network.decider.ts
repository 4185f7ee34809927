import { ConflictError, NotFoundError, ValidationError } from '@fleet/agent-protocol';
import { assertNever, type DecideContext, type Decider } from '../decider.js';
import { containsIp, intToIp, parseCidr } from './ipv4.js';
import type { NetworkEvent } from './network.events.js';

/**
 * A tenant network (backend.go.txt `CreateNetwork`, `Network.Reserve`). Its
 * members reach each other and nothing else. Which members are still live is
 * the VMs' own business: the handler reads their streams and passes the ids
 * in (`live`), so an ended VM frees its address and its pin without an event
 * of its own here.
 */
export type NetworkCommand =
  | { type: 'CreateNetwork'; data: { network_id: string; tenant_id: string; name: string; subnet: string } }
  | {
      type: 'JoinNetwork';
      data: {
        network_id: string;
        tenant_id: string;
        vm_id: string;
        host_id: string;
        ip_hint?: string | undefined;
        live: readonly string[];
      };
    }
  | { type: 'DeleteNetwork'; data: { network_id: string; tenant_id: string; live: readonly string[] } };

export interface NetworkMember {
  readonly ip: string;
  readonly host_id: string;
}

export type NetworkState =
  | { readonly status: 'initial' }
  | {
      readonly status: 'active' | 'deleted';
      readonly network_id: string;
      readonly tenant_id: string;
      readonly name: string;
      readonly subnet: string;
      readonly created_at: string;
      readonly members: ReadonlyMap<string, NetworkMember>;
    };
export type ExistingNetwork = Exclude<NetworkState, { status: 'initial' }>;

/** Another tenant's network reads as absent: its id says nothing about whether it exists. */
export function ownNetwork(state: NetworkState, networkId: string, tenantId: string): ExistingNetwork {
  if (state.status === 'initial' || state.tenant_id !== tenantId)
    throw new NotFoundError('NETWORK_NOT_FOUND', `network ${networkId} does not exist`, { network_id: networkId });
  return state;
}

/** The host live members run on: where the next member must run too (one host per network; docs/networking.md). */
export function pinnedHost(state: ExistingNetwork, live: readonly string[]): string | undefined {
  for (const id of live) {
    const m = state.members.get(id);
    if (m) return m.host_id;
  }
  return undefined;
}

/** `ip_hint` must name a member address of the subnet; checked before a VM is requested. */
export function assertHintInSubnet(subnet: string, ipHint: string | undefined): void {
  const c = parseCidr(subnet);
  if (ipHint === undefined || !c) return;
  if (!containsIp(c, ipHint))
    throw new ValidationError(
      `ip_hint ${ipHint} is not a member address of network subnet ${subnet} (${intToIp(c.first)}-${intToIp(c.last)})`,
      [{ path: 'ip_hint', message: `outside ${subnet}` }],
      'IP_HINT_OUTSIDE_SUBNET',
    );
}

/** Reserve: `ipHint` when it is free, else the lowest free address. */
export function reserveIp(subnet: string, ipHint: string | undefined, taken: ReadonlySet<string>): string | undefined {
  const c = parseCidr(subnet);
  if (!c) return undefined;
  if (ipHint !== undefined && containsIp(c, ipHint) && !taken.has(ipHint)) return ipHint;
  for (let n = c.first; n <= c.last; n++) if (!taken.has(intToIp(n))) return intToIp(n);
  return undefined;
}

export function decideNetwork(command: NetworkCommand, state: NetworkState, ctx: DecideContext): NetworkEvent[] {
  const at = ctx.now.toISOString();
  switch (command.type) {
    case 'CreateNetwork': {
      const d = command.data;
      if (state.status !== 'initial') {
        if (state.tenant_id === d.tenant_id && state.name === d.name && state.subnet === d.subnet) return [];
        throw new ConflictError('NETWORK_EXISTS', `network ${d.network_id} already exists`);
      }
      return [{ type: 'NetworkCreated', data: { network_id: d.network_id, tenant_id: d.tenant_id, name: d.name, subnet: d.subnet, at } }];
    }
    case 'JoinNetwork': {
      const d = command.data;
      const s = ownNetwork(state, d.network_id, d.tenant_id);
      if (s.members.has(d.vm_id)) return [];
      if (s.status === 'deleted') throw new ConflictError('NETWORK_DELETED', `network ${d.network_id} was deleted`);
      assertHintInSubnet(s.subnet, d.ip_hint);
      const pin = pinnedHost(s, d.live);
      if (pin !== undefined && pin !== d.host_id) {
        throw new ConflictError(
          'NETWORK_HOST_MISMATCH',
          `network ${d.network_id} lives on host ${pin}; a member cannot run on ${d.host_id} (networks span one host)`,
          { network_id: d.network_id, host_id: pin },
        );
      }
      const taken = new Set(d.live.flatMap((id) => s.members.get(id)?.ip ?? []));
      const ip = reserveIp(s.subnet, d.ip_hint, taken);
      if (ip === undefined) throw new ConflictError('NETWORK_FULL', `network ${d.network_id} has no free address in ${s.subnet}`);
      return [{ type: 'NetworkMemberJoined', data: { network_id: d.network_id, vm_id: d.vm_id, ip, host_id: d.host_id, at } }];
    }
    case 'DeleteNetwork': {
      const d = command.data;
      const s = ownNetwork(state, d.network_id, d.tenant_id);
      if (s.status === 'deleted') return [];
      const live = d.live.filter((id) => s.members.has(id));
      if (live.length > 0) {
        throw new ConflictError('NETWORK_HAS_MEMBERS', `network ${d.network_id} has ${live.length} live member(s): destroy them first`, {
          network_id: d.network_id,
          members: live,
        });
      }
      return [{ type: 'NetworkDeleted', data: { network_id: d.network_id, at } }];
    }
    default:
      return assertNever(command, 'network command');
  }
}

export function evolveNetwork(state: NetworkState, event: NetworkEvent): NetworkState {
  switch (event.type) {
    case 'NetworkCreated': {
      const d = event.data;
      return {
        status: 'active',
        network_id: d.network_id,
        tenant_id: d.tenant_id,
        name: d.name,
        subnet: d.subnet,
        created_at: d.at,
        members: new Map(),
      };
    }
    case 'NetworkMemberJoined': {
      if (state.status === 'initial') return state;
      const members = new Map(state.members);
      members.set(event.data.vm_id, { ip: event.data.ip, host_id: event.data.host_id });
      return { ...state, members };
    }
    case 'NetworkDeleted':
      return state.status === 'initial' ? state : { ...state, status: 'deleted' };
    default:
      return assertNever(event, 'network event');
  }
}

export const networkDecider: Decider<NetworkCommand, NetworkEvent, NetworkState> = {
  decide: decideNetwork,
  evolve: evolveNetwork,
  initialState: { status: 'initial' },
};
