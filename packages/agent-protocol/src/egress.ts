import { z } from 'zod';

/**
 * Outbound policy of a sandbox, shared by the control plane (validated once
 * at the API edge) and the host agent (enforced by nftables, and by the
 * egress proxy for domain names).
 *
 * A rule is an IPv4 address, an IPv4 CIDR, or a domain name: `example.com`
 * matches that name only, `*.example.com` every name below it (not the apex).
 * `allow_out` wins over `deny_out`.
 */

export const EGRESS_MODES = ['direct', 'none', 'proxy'] as const;
export const egressModeSchema = z.enum(EGRESS_MODES);
export type EgressMode = z.infer<typeof egressModeSchema>;

export type EgressRule =
  { readonly kind: 'cidr'; readonly network: number; readonly prefixLen: number } | { readonly kind: 'domain'; readonly pattern: string };

const ipv4Re = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})$/;
const labelRe = /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/;

export function ipv4ToInt(ip: string): number | null {
  const m = ipv4Re.exec(ip);
  if (!m) return null;
  const texts = m.slice(1);
  if (texts.some((p) => Number(p) > 255 || (p.length > 1 && p.startsWith('0')))) return null;
  return texts.reduce((n, p) => ((n << 8) | Number(p)) >>> 0, 0);
}

export function intToIpv4(n: number): string {
  return [n >>> 24, (n >>> 16) & 255, (n >>> 8) & 255, n & 255].join('.');
}

const maskOf = (len: number): number => (len === 0 ? 0 : (0xffffffff << (32 - len)) >>> 0);

/** A rule, or a message saying why the text is not one. */
export function parseEgressRule(text: string): EgressRule | string {
  const t = text.trim().toLowerCase();
  if (t === '') return 'an empty rule';
  if (/^[\d./]+$/.test(t)) {
    const [addr, len, extra] = t.split('/');
    const ip = addr === undefined ? null : ipv4ToInt(addr);
    if (ip === null || extra !== undefined) return `"${text}" is not an IPv4 address or CIDR`;
    const prefixLen = len === undefined ? 32 : /^\d{1,2}$/.test(len) ? Number(len) : NaN;
    if (!(prefixLen >= 0 && prefixLen <= 32)) return `"${text}": a prefix length is 0-32`;
    const network = (ip & maskOf(prefixLen)) >>> 0;
    if (network !== ip) return `"${text}" has host bits set: write ${intToIpv4(network)}/${prefixLen}`;
    return { kind: 'cidr', network, prefixLen };
  }
  if (t.includes(':')) return `"${text}": IPv6 is not supported (sandboxes have no IPv6)`;
  const name = t.startsWith('*.') ? t.slice(2) : t;
  const labels = name.split('.');
  if (name.length > 253 || labels.length < 2 || !labels.every((l) => labelRe.test(l)))
    return `"${text}" is not an IPv4 address, a CIDR, or a domain name (e.g. example.com or *.example.com)`;
  return { kind: 'domain', pattern: t };
}

export const cidrOf = (r: { network: number; prefixLen: number }): string => `${intToIpv4(r.network)}/${r.prefixLen}`;

export function cidrContains(r: { network: number; prefixLen: number }, ip: number): boolean {
  return (ip & maskOf(r.prefixLen)) >>> 0 === r.network;
}

/** `example.com` matches itself; `*.example.com` matches names below it, not the apex. */
export function domainMatches(pattern: string, name: string): boolean {
  const n = name.toLowerCase().replace(/\.$/, '');
  if (pattern.startsWith('*.')) return n.endsWith(pattern.slice(1));
  return n === pattern;
}

const ruleSchema = z
  .string()
  .max(253)
  .superRefine((s, ctx) => {
    const r = parseEgressRule(s);
    if (typeof r === 'string') ctx.addIssue({ code: 'custom', message: r });
  });

/** The policy as the API takes it and events keep it. */
export const egressSpecSchema = z
  .object({
    mode: egressModeSchema.default('direct'),
    provider: z
      .string()
      .regex(/^[a-z0-9][a-z0-9_-]{0,62}$/, 'a provider name: lowercase letters, digits, _ and -')
      .optional(),
    allow_out: z.array(ruleSchema).max(256).optional(),
    deny_out: z.array(ruleSchema).max(256).optional(),
  })
  .strict();
export type EgressSpec = z.output<typeof egressSpecSchema>;

export const hasDomainRule = (rules: readonly string[] | undefined): boolean =>
  (rules ?? []).some((r) => {
    const p = parseEgressRule(r);
    return typeof p !== 'string' && p.kind === 'domain';
  });

/**
 * Cross-field problems of a policy, as (path, message, code): rules with
 * `none` (nothing to apply them to), domain rules in `direct` (nftables sees
 * addresses, not names: refused rather than silently dropped), a provider
 * outside `proxy`, `proxy` without one.
 */
export function egressSpecProblems(e: EgressSpec): Array<{ path: string; message: string; code: string }> {
  const out: Array<{ path: string; message: string; code: string }> = [];
  const rules = [...(e.allow_out ?? []), ...(e.deny_out ?? [])];
  if (e.mode === 'none' && rules.length > 0)
    out.push({
      path: 'egress.allow_out',
      message: 'mode "none" lets nothing out: allow_out and deny_out must be empty',
      code: 'VALIDATION_FAILED',
    });
  if (e.mode === 'direct') {
    for (const key of ['allow_out', 'deny_out'] as const) {
      if (hasDomainRule(e[key]))
        out.push({
          path: `egress.${key}`,
          message: 'domain rules are enforced only through an egress proxy (HTTP Host, TLS SNI): use mode "proxy", or CIDRs',
          code: 'EGRESS_DOMAIN_RULES_NEED_PROXY',
        });
    }
  }
  if (e.mode !== 'proxy' && e.provider !== undefined)
    out.push({ path: 'egress.provider', message: 'a provider applies to mode "proxy" only', code: 'VALIDATION_FAILED' });
  if (e.mode === 'proxy' && e.provider === undefined)
    out.push({
      path: 'egress.provider',
      message: 'mode "proxy" needs a provider from the operator\'s EGRESS_PROXIES',
      code: 'VALIDATION_FAILED',
    });
  return out;
}

// ---- agent wire ------------------------------------------------------------

const endpointSchema = z.object({ host: z.ipv4(), port: z.number().int().min(1).max(65535) });

/**
 * The policy as the control plane sends it to an agent. In `proxy` mode,
 * `endpoint` names an operator proxy the sandbox may reach (and nothing
 * else); without it the agent's own egress proxy serves the sandbox.
 */
export const agentEgressSchema = z.object({
  mode: egressModeSchema,
  provider: z.string().max(63).optional(),
  endpoint: endpointSchema.optional(),
  allow_out: z.array(ruleSchema).max(256).default([]),
  deny_out: z.array(ruleSchema).max(256).default([]),
});
export type AgentEgress = z.input<typeof agentEgressSchema>;
export type AgentEgressParsed = z.output<typeof agentEgressSchema>;

export const egressHealthSchema = z.enum(['healthy', 'unhealthy', 'unknown']);
export type EgressHealth = z.infer<typeof egressHealthSchema>;

/** The seed's GuestEgress plus health: what the agent resolved for a sandbox. */
export const egressStatusSchema = z.object({
  mode: egressModeSchema,
  provider: z.string().optional(),
  /** proxy mode: `http://<ip>:<port>` as the guest's HTTP(S)_PROXY names it. */
  endpoint: z.string().optional(),
  /** Bare IPs (many clients ignore CIDRs in NO_PROXY). */
  no_proxy: z.array(z.string()).optional(),
  health: egressHealthSchema.optional(),
});
export type EgressStatus = z.infer<typeof egressStatusSchema>;

/** An agent answers this code when a sandbox's egress provider (its own proxy) could not provide its endpoint. */
export const EGRESS_PROVISION_FAILED = 'EGRESS_PROVISION_FAILED';
