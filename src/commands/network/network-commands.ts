import { randomBytes } from 'node:crypto';
import { AppError } from '@fleet/agent-protocol';
import { networkAggregate, networkPoolAggregate } from '../../domain/network/network.aggregate.js';
import { assertHintInSubnet, ownNetwork, pinnedHost, type ExistingNetwork } from '../../domain/network/network.decider.js';
import { isTerminal } from '../../domain/vm/vm.decider.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta, type Handled } from '../command-handler.js';
import { ConcurrencyError, type Position } from '../../domain/event-store.port.js';
import type { NetworkEvent } from '../../domain/network/network.events.js';
import type { NetworkCommand, NetworkState } from '../../domain/network/network.decider.js';

export interface NetworkSettings {
  /** NETWORK_POOL: where network subnets come from; inside every process agent's AGENT_SUBNET. */
  readonly pool: string;
  /** NETWORK_PREFIX_LEN: the size of a subnet the caller did not name. */
  readonly prefixLen: number;
}

/** Validated at the edge (networks.routes.ts). */
export interface CreateNetworkInput {
  readonly name: string;
  readonly subnet?: string | undefined;
}

export interface NetworkResult {
  readonly network: ExistingNetwork;
  readonly live: readonly string[];
  readonly position: Position | undefined;
}

/** Where a member must go and what it joins, resolved before its VM is requested. */
export interface NetworkJoinPlan {
  readonly networkId: string;
  readonly subnet: string;
  /** The host its live members run on; undefined: none live, any host that can join. */
  readonly host: string | undefined;
}

/** Tenant networks: create, read, delete, and a VM's membership (Reserve) at create. */
export class NetworkCommands {
  private readonly networks: BoundOf<typeof networkAggregate>;
  private readonly pool: BoundOf<typeof networkPoolAggregate>;
  private readonly vms: BoundOf<typeof vmAggregate>;

  constructor(
    handler: CommandHandler,
    private readonly settings: NetworkSettings,
  ) {
    this.networks = bindAggregate(handler, networkAggregate);
    this.pool = bindAggregate(handler, networkPoolAggregate);
    this.vms = bindAggregate(handler, vmAggregate);
  }

  async create(input: CreateNetworkInput, meta: CommandMeta & { readonly tenantId: string }): Promise<NetworkResult> {
    const networkId = `net-${randomBytes(10).toString('hex')}`;
    const allocated = await this.pool.handle(
      'default',
      {
        type: 'AllocateSubnet',
        data: { network_id: networkId, pool: this.settings.pool, prefix_len: this.settings.prefixLen, subnet: input.subnet },
      },
      meta,
      { onConflict: (_err, attempt) => attempt < 20 },
    );
    const subnet = allocated.state.allocated.get(networkId);
    if (subnet === undefined) throw new AppError('INTERNAL', 500, `subnet for network ${networkId} vanished`);
    try {
      const r = await this.networks.handle(
        networkId,
        { type: 'CreateNetwork', data: { network_id: networkId, tenant_id: meta.tenantId, name: input.name, subnet } },
        meta,
      );
      return { network: ownNetwork(r.state, networkId, meta.tenantId), live: [], position: r.position };
    } catch (err) {
      await this.pool.handle('default', { type: 'ReleaseSubnet', data: { network_id: networkId } }, meta).catch(() => undefined);
      throw err;
    }
  }

  async get(networkId: string, tenantId: string): Promise<NetworkResult> {
    const { state } = await this.networks.load(networkId);
    const network = ownNetwork(state, networkId, tenantId);
    if (network.status === 'deleted') throw new AppError('NETWORK_NOT_FOUND', 404, `network ${networkId} does not exist`);
    return { network, live: await this.liveMembers(network), position: undefined };
  }

  async delete(networkId: string, meta: CommandMeta & { readonly tenantId: string }): Promise<NetworkResult> {
    const tenantId = meta.tenantId;
    const r = await this.withLive(networkId, meta, (live) => ({
      type: 'DeleteNetwork',
      data: { network_id: networkId, tenant_id: tenantId, live },
    }));
    await this.pool.handle('default', { type: 'ReleaseSubnet', data: { network_id: networkId } }, meta, {
      onConflict: (_err, attempt) => attempt < 20,
    });
    return { network: ownNetwork(r.state, networkId, tenantId), live: [], position: r.position };
  }

  /** Checks a VM create's `network_id` and `ip_hint` before anything is written; 404 for another tenant's network. */
  async planJoin(networkId: string, tenantId: string, ipHint: string | undefined): Promise<NetworkJoinPlan> {
    const { network, live } = await this.get(networkId, tenantId);
    assertHintInSubnet(network.subnet, ipHint);
    return { networkId, subnet: network.subnet, host: pinnedHost(network, live) };
  }

  /** Reserve on the network's stream: the hint when free, else the lowest free address; idempotent per VM. */
  async join(
    plan: NetworkJoinPlan,
    vmId: string,
    hostId: string,
    ipHint: string | undefined,
    meta: CommandMeta & { readonly tenantId: string },
  ): Promise<string> {
    const tenantId = meta.tenantId;
    const r = await this.withLive(plan.networkId, meta, (live) => ({
      type: 'JoinNetwork',
      data: { network_id: plan.networkId, tenant_id: tenantId, vm_id: vmId, host_id: hostId, ip_hint: ipHint, live },
    }));
    const member = ownNetwork(r.state, plan.networkId, tenantId).members.get(vmId);
    if (!member) throw new AppError('INTERNAL', 500, `vm ${vmId} did not join network ${plan.networkId}`);
    return member.ip;
  }

  /**
   * Decides on the state the live set was read from: a member joining in
   * between is a conflict, and the whole read is redone.
   */
  private async withLive(
    networkId: string,
    meta: CommandMeta,
    command: (live: readonly string[]) => NetworkCommand,
  ): Promise<Handled<NetworkState, NetworkEvent>> {
    for (let attempt = 1; ; attempt++) {
      const loaded = await this.networks.load(networkId);
      const live = loaded.state.status === 'initial' ? [] : await this.liveMembers(loaded.state);
      try {
        return await this.networks.handle(networkId, command(live), meta, { expected: loaded.revision, onConflict: () => false });
      } catch (err) {
        if (!(err instanceof ConcurrencyError) || attempt >= 20) throw err;
      }
    }
  }

  private async liveMembers(network: ExistingNetwork): Promise<string[]> {
    const ids = [...network.members.keys()];
    const states = await Promise.all(ids.map(async (id) => (await this.vms.load(id)).state));
    return ids.filter((_id, i) => {
      const s = states[i];
      return s !== undefined && s.status !== 'initial' && !isTerminal(s.status);
    });
  }
}
