import { z } from 'zod';
import { cidrContains, cidrOf, ipv4ToInt, parseEgressRule, type EgressRule } from '@fleet/agent-protocol';

/**
 * Outbound traffic of a sandbox, as nftables rules in the agent's own
 * tables (firewall.ts renders them; this file decides what they say).
 *
 * - `none`: the sandbox's packets never leave its bridge (what every sandbox
 *   had before egress existed).
 * - `direct`: forwarded and masqueraded through the host, per sandbox (its
 *   own chain, keyed on its source address, which the bridge table makes
 *   trustworthy). Never: the agent's whole subnet (other tenants, other
 *   bridges), 169.254.0.0/16 (dropped in prerouting), the host itself (the
 *   input chain drops what a sandbox opens towards any host address, so no
 *   rule here can open the agent, the control plane or Postgres). By
 *   default not: private, shared and special ranges (RFC 1918, CGNAT, ...),
 *   unless the operator allows some (`egressAllowPrivate`) or the sandbox's
 *   `allow_out` names them. `allow_out` wins over `deny_out`.
 * - `proxy`: the sandbox reaches one TCP endpoint and nothing else: the
 *   agent's own egress proxy on the gateway address (input chain), or an
 *   operator's proxy (forwarded, masqueraded). Domain rules are enforced
 *   by the agent's proxy (egress-proxy.ts), CIDR rules there too.
 */

export const sandboxEgressSchema = z.object({
  mode: z.enum(['direct', 'none', 'proxy']),
  provider: z.string().optional(),
  /** An operator proxy; absent in proxy mode: this agent's own. */
  endpoint: z.object({ host: z.string(), port: z.number().int() }).optional(),
  allow_out: z.array(z.string()).default([]),
  deny_out: z.array(z.string()).default([]),
});
export type SandboxEgress = z.output<typeof sandboxEgressSchema>;

/**
 * What a sandbox created without a policy gets at the agent: none, what every
 * sandbox had before egress existed (a control plane that predates the field
 * sends none). The control plane always sends one: `direct` is the API's
 * default, as in the seed.
 */
export const NO_EGRESS: SandboxEgress = { mode: 'none', allow_out: [], deny_out: [] };

/**
 * Never reachable from a sandbox whatever its rules: this network, loopback,
 * link-local (cloud metadata), multicast, reserved, broadcast.
 */
export const ALWAYS_BLOCKED = ['0.0.0.0/8', '127.0.0.0/8', '169.254.0.0/16', '224.0.0.0/4', '240.0.0.0/4'] as const;

/**
 * Blocked by default, opened by the operator or a sandbox's `allow_out`:
 * the networks a host usually sits in (RFC 1918, CGNAT 100.64/10), IETF
 * protocol assignments and the benchmarking range. IPv6 (ULA included) never
 * leaves a sandbox at all.
 */
export const PRIVATE_BY_DEFAULT = [
  '10.0.0.0/8',
  '100.64.0.0/10',
  '172.16.0.0/12',
  '192.0.0.0/24',
  '192.168.0.0/16',
  '198.18.0.0/15',
] as const;

export interface EgressHostConfig {
  /** The agent's sandbox subnet (every bridge's addresses). */
  readonly subnet: string;
  readonly gateway: string;
  /** Port of the agent's egress proxy on the gateway address. */
  readonly proxyPort: number;
  /** Private CIDRs the operator lets direct-mode sandboxes reach by default. */
  readonly allowPrivate: readonly string[];
}

export interface EgressPort {
  readonly ip: string;
  readonly veth: string;
  readonly bridge: string;
  readonly egress: SandboxEgress;
}

const cidrs = (rules: readonly string[]): string[] =>
  rules.flatMap((r) => {
    const p = parseEgressRule(r);
    return typeof p !== 'string' && p.kind === 'cidr' ? [cidrOf(p)] : [];
  });

/** Whether a sandbox's packets are forwarded off its bridge at all (direct, or an operator proxy). */
export const forwards = (e: SandboxEgress): boolean => e.mode === 'direct' || (e.mode === 'proxy' && e.endpoint !== undefined);
/** Whether it talks to the agent's own proxy on the gateway. */
export const usesAgentProxy = (e: SandboxEgress): boolean => e.mode === 'proxy' && e.endpoint === undefined;

const chainName = (veth: string): string => `eg_${veth}`;

/** In each bridge's forward chain, before its final drop: the sandboxes of that bridge that may leave it. */
export function bridgeEgressLines(bridge: string, ports: readonly EgressPort[]): string[] {
  const out = ports.filter((p) => p.bridge === bridge && forwards(p.egress)).sort((a, b) => a.veth.localeCompare(b.veth));
  if (out.length === 0) return [];
  return [
    // Across bridges never, whatever a policy allows.
    '        oifname @bridges drop',
    `        ip saddr vmap { ${out.map((p) => `${p.ip} : jump ${chainName(p.veth)}`).join(', ')} }`,
  ];
}

/** One chain per forwarding sandbox. */
export function egressChains(cfg: EgressHostConfig, ports: readonly EgressPort[]): string[] {
  const lines: string[] = [];
  for (const p of [...ports].sort((a, b) => a.veth.localeCompare(b.veth))) {
    if (!forwards(p.egress)) continue;
    lines.push(`    chain ${chainName(p.veth)} {`);
    if (p.egress.mode === 'proxy' && p.egress.endpoint) {
      lines.push(`        ip daddr ${p.egress.endpoint.host} tcp dport ${p.egress.endpoint.port} accept`, '        drop');
    } else {
      lines.push(`        ip daddr ${cfg.subnet} drop`);
      for (const c of ALWAYS_BLOCKED) lines.push(`        ip daddr ${c} drop`);
      for (const c of cidrs(p.egress.allow_out)) lines.push(`        ip daddr ${c} accept`);
      for (const c of cidrs(p.egress.deny_out)) lines.push(`        ip daddr ${c} drop`);
      for (const c of cidrs(cfg.allowPrivate)) lines.push(`        ip daddr ${c} accept`);
      for (const c of PRIVATE_BY_DEFAULT) lines.push(`        ip daddr ${c} drop`);
      lines.push('        accept');
    }
    lines.push('    }');
  }
  return lines;
}

/** In the input chain, before its drop: proxy-mode sandboxes may open connections to the agent's proxy, and only that. */
export function inputEgressLines(cfg: EgressHostConfig, ports: readonly EgressPort[]): string[] {
  const ips = ports.filter((p) => usesAgentProxy(p.egress)).map((p) => p.ip);
  if (ips.length === 0) return [];
  return [`        ip saddr { ${[...new Set(ips)].sort().join(', ')} } ip daddr ${cfg.gateway} tcp dport ${cfg.proxyPort} accept`];
}

/** In the forward chain, before `oifname @bridges drop`: replies to what a sandbox opened. */
export function forwardReplyLines(ports: readonly EgressPort[]): string[] {
  if (!ports.some((p) => forwards(p.egress))) return [];
  return ['        oifname @bridges ct state established,related ct direction reply accept'];
}

/** Masquerade what leaves a bridge for elsewhere (only forwarded traffic has an input interface). */
export function natChain(cfg: EgressHostConfig, ports: readonly EgressPort[]): string[] {
  if (!ports.some((p) => forwards(p.egress))) return [];
  return [
    '    chain postrouting {',
    '        type nat hook postrouting priority srcnat; policy accept;',
    `        iifname @bridges oifname != @bridges ip saddr ${cfg.subnet} masquerade`,
    '    }',
  ];
}

// ---- decisions the proxy makes (the same policy, by name and address) ------

export interface Verdict {
  readonly allow: boolean;
  readonly reason: string;
}

interface ParsedPolicy {
  readonly allowCidr: EgressRule[];
  readonly denyCidr: EgressRule[];
  readonly allowDomain: string[];
  readonly denyDomain: string[];
}

const parsedCache = new WeakMap<SandboxEgress, ParsedPolicy>();
function parsed(e: SandboxEgress): ParsedPolicy {
  let p = parsedCache.get(e);
  if (p) return p;
  const split = (rules: readonly string[]) => {
    const all = rules.map(parseEgressRule).filter((r): r is EgressRule => typeof r !== 'string');
    return { cidr: all.filter((r) => r.kind === 'cidr'), domain: all.flatMap((r) => (r.kind === 'domain' ? [r.pattern] : [])) };
  };
  const a = split(e.allow_out);
  const d = split(e.deny_out);
  p = { allowCidr: a.cidr, denyCidr: d.cidr, allowDomain: a.domain, denyDomain: d.domain };
  parsedCache.set(e, p);
  return p;
}

const inAny = (list: readonly string[], ip: number): boolean =>
  list.some((c) => {
    const r = parseEgressRule(c);
    return typeof r !== 'string' && r.kind === 'cidr' && cidrContains(r, ip);
  });

const matchesAny = (rules: readonly EgressRule[], ip: number): boolean => rules.some((r) => r.kind === 'cidr' && cidrContains(r, ip));

/**
 * The proxy's decision for a connection to `ip`, reached by `name` when the
 * client named one (HTTP Host, CONNECT target). A domain allow does not open
 * a private or host address (a name can be made to resolve anywhere); only
 * a CIDR allow does. `hostAddresses` are never reachable.
 */
export function decide(
  e: SandboxEgress,
  cfg: EgressHostConfig,
  hostAddresses: ReadonlySet<string>,
  target: { ip: string; name?: string | undefined },
  domainMatches: (pattern: string, name: string) => boolean,
): Verdict {
  const ip = ipv4ToInt(target.ip);
  if (ip === null) return { allow: false, reason: `${target.ip} is not an IPv4 address` };
  if (hostAddresses.has(target.ip) || inAny([cfg.subnet, ...ALWAYS_BLOCKED], ip))
    return { allow: false, reason: `${target.ip} is the host, a sandbox or a reserved address` };
  const p = parsed(e);
  if (matchesAny(p.allowCidr, ip)) return { allow: true, reason: 'allow_out (address)' };
  const privateIp = inAny(PRIVATE_BY_DEFAULT, ip) && !inAny(cfg.allowPrivate, ip);
  const name = target.name;
  if (name !== undefined && p.allowDomain.some((d) => domainMatches(d, name))) {
    if (privateIp) return { allow: false, reason: `${name} resolves to the private address ${target.ip}: allow it by CIDR` };
    return { allow: true, reason: 'allow_out (domain)' };
  }
  if (name !== undefined && p.denyDomain.some((d) => domainMatches(d, name))) return { allow: false, reason: `deny_out (domain ${name})` };
  if (matchesAny(p.denyCidr, ip)) return { allow: false, reason: `deny_out (address ${target.ip})` };
  if (privateIp) return { allow: false, reason: `${target.ip} is a private address` };
  return { allow: true, reason: 'default' };
}
