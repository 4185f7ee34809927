import type { NetworkReassertReport, SandboxInfo } from '../../backend.js';
import { usesAgentProxy } from './egress-host.js';
import { sandboxEgressSchema, type SandboxEgress } from './egress.js';
import { hardenLink } from './network.js';
import type { SandboxHost } from './sandbox-host.js';

/**
 * Puts the network boundary back where anything changed it: our nftables
 * tables (missing or edited), and each bridge's and veth's sysctls (a
 * write of net.ipv4.ip_forward turns every bridge's forwarding back on).
 */
export async function reassertNetwork(host: SandboxHost): Promise<NetworkReassertReport> {
  const repairs = await host.firewall.reassert(() => host.firewallState());
  const states = [...host.records.values()].map((r) => r.state);
  for (const bridge of new Set(states.map((s) => s.bridge)))
    repairs.push(...(await hardenLink(bridge, 'bridge', host.forwardingOf(bridge))));
  for (const s of states) repairs.push(...(await hardenLink(s.veth, 'veth')));
  return { repaired: repairs.length, repairs };
}

/** Replaces a running sandbox's outbound policy: firewall, bridge forwarding, the guest's proxy variables (later execs). */
export async function setEgress(host: SandboxHost, name: string, egress: SandboxEgress): Promise<SandboxInfo> {
  const parsed = sandboxEgressSchema.parse(egress);
  return host.locks.run(`sb:${name}`, async () => {
    const record = host.must(name);
    const s = record.state;
    // The proxy first: if it cannot start, the sandbox keeps the policy it had (rules, env, record), never half of the new one.
    if (usesAgentProxy(parsed)) await host.egress.ensureProxy();
    const old = host.egress.guestEnv(s.egress, s.ip);
    s.env = { ...Object.fromEntries(Object.entries(s.env).filter(([k]) => !(k in old))), ...host.egress.guestEnv(parsed, s.ip) };
    s.egress = parsed;
    await host.persist(s);
    await host.firewall.apply(() => host.firewallState());
    await host.syncBridgeForwarding(s.bridge);
    return host.info(record);
  });
}

/** The resolved policy with a probe of its proxy endpoint. */
export async function egressStatus(host: SandboxHost, name: string): Promise<NonNullable<SandboxInfo['egress']>> {
  const s = host.must(name).state;
  return host.egress.status(s.egress, s.ip, await host.egress.health(s.egress));
}
