import { invalidSpec } from '../../backend.js';
import { intToIp, ipToInt, parseSubnet, reserve, type Subnet } from './network.js';
import type { Persisted } from './sandbox-state.js';

/**
 * Cluster networks (backend.go.txt `CreateNetwork`, `Reserve`): the members
 * of one network share a bridge of their own, apart from their tenant's
 * bridge and from every other network's, so the firewall's "a frame stays on
 * its bridge" is what lets members reach each other and nothing else. A
 * network's subnet is a range inside the agent's subnet (the control plane
 * hands it out from NETWORK_POOL), so addresses stay unique host-wide and the
 * gateway, NAT and egress rules hold unchanged for members. The qemu backend
 * keys its bridges and addresses the same way (vm-create.ts).
 */

export interface SandboxNetwork {
  readonly id: string;
  readonly subnet: string;
}

/** What the bridge allocator keys on: a tenant id never contains ':', so a network never shares a tenant's bridge. */
export function bridgeKeyOf(s: Pick<Persisted, 'tenant'> & { readonly network?: SandboxNetwork | undefined }): string {
  return s.network ? `net:${s.network.id}` : s.tenant;
}

function inside(outer: Subnet, inner: Subnet): boolean {
  return (
    inner.network >= outer.network && inner.network + 2 ** (32 - inner.prefixLen) - 1 <= outer.network + 2 ** (32 - outer.prefixLen) - 1
  );
}

/**
 * A member's address: `ipHint` when free in the network's subnet, else the
 * lowest free one (Reserve). A sandbox on no network never takes an address
 * inside a subnet one of this agent's networks uses.
 */
export function reserveAddress(
  host: Subnet,
  name: string,
  network: SandboxNetwork | undefined,
  ipHint: string | undefined,
  records: ReadonlyArray<Pick<Persisted, 'ip'> & { readonly network?: SandboxNetwork | undefined }>,
): { ip: string; mac: string } {
  const taken = new Set(records.map((r) => r.ip));
  if (!network) {
    const nets = records.flatMap((r) => (r.network ? [parseSubnet(r.network.subnet)] : []));
    for (const n of nets) for (let i = n.network; i < n.network + 2 ** (32 - n.prefixLen); i++) taken.add(intToIp(i));
    return reserve(host, name, ipHint, taken);
  }
  const sub = parseSubnet(network.subnet);
  if (!inside(host, sub) || sub.prefixLen <= host.prefixLen) {
    throw invalidSpec(`network subnet ${network.subnet} must lie inside this host's sandbox subnet ${host.cidr} (not be all of it)`, [
      { path: 'network.subnet', message: `outside ${host.cidr}` },
    ]);
  }
  if (ipHint !== undefined) {
    const n = ipToInt(ipHint);
    if (n === null || n < sub.first || n > sub.last)
      throw invalidSpec(`ip_hint ${ipHint} is not a member address of ${sub.cidr}`, [{ path: 'ip_hint', message: `outside ${sub.cidr}` }]);
  }
  taken.add(host.gateway);
  return reserve(sub, name, ipHint, taken);
}
