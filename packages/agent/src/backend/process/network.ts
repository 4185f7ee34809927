import { createHash } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readFile, writeFile } from 'node:fs/promises';
import { capacityExhausted, invalidSpec } from '../../backend.js';
import { mustRun, runTool } from './exec-util.js';

/**
 * Sandbox networking: a bridge per tenant, a veth per sandbox, addresses
 * from one host subnet. The boundary itself is the agent's nftables ruleset
 * (firewall.ts); what is here keeps layer 2 and the host's own IP stack out
 * of the way:
 *
 * - Bridge and veth names are allocated (`<prefix>b<n>`, `<prefix>v<n>`,
 *   the lowest index no known sandbox uses) and recorded in each sandbox's
 *   state.json, so two tenants can never share a bridge and no name can be
 *   ground out of a hash. Names recorded by older agents
 *   (`<prefix>b<hash8>`) keep working: a tenant keeps the bridge its live
 *   sandboxes are on unless another tenant shares it.
 * - Addresses are unique host-wide; the gateway (first address) sits on
 *   every bridge as a /32, so no bridge owns a connected route for the
 *   subnet and the host reaches each sandbox through a /32 route on its
 *   tenant's bridge. A sandbox ARPs for every subnet address and only its
 *   own bridge's peers answer.
 * - IPv6 is disabled (and router advertisements refused) on every bridge
 *   and host-side veth before it comes up, and IPv4 forwarding is off on
 *   each bridge. Any write of net.ipv4.ip_forward resets the latter, so it
 *   is a second wall, not the boundary; the reassert route puts all of
 *   these back and counts what it had to fix.
 */

export interface Subnet {
  readonly cidr: string;
  readonly network: number;
  readonly prefixLen: number;
  readonly gateway: string;
  readonly first: number;
  readonly last: number;
}

export function ipToInt(ip: string): number | null {
  const m = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})$/.exec(ip);
  if (!m) return null;
  const parts = m.slice(1).map(Number);
  if (parts.some((p) => p > 255)) return null;
  return parts.reduce((acc, p) => acc * 256 + p, 0);
}

export function intToIp(n: number): string {
  return [n >>> 24, (n >>> 16) & 255, (n >>> 8) & 255, n & 255].join('.');
}

export function parseSubnet(cidr: string): Subnet {
  const [addr, len] = cidr.split('/');
  const base = addr === undefined ? null : ipToInt(addr);
  const prefixLen = Number(len);
  if (base === null || !Number.isInteger(prefixLen) || prefixLen < 8 || prefixLen > 29) {
    throw invalidSpec(`subnet "${cidr}" is invalid: use an IPv4 CIDR with a prefix between /8 and /29, e.g. 10.213.0.0/16`);
  }
  const mask = prefixLen === 0 ? 0 : (0xffffffff << (32 - prefixLen)) >>> 0;
  const network = (base & mask) >>> 0;
  const broadcast = (network | (~mask >>> 0)) >>> 0;
  return {
    cidr: `${intToIp(network)}/${prefixLen}`,
    network,
    prefixLen,
    gateway: intToIp(network + 1),
    first: network + 2,
    last: broadcast - 1,
  };
}

/**
 * backend.go.txt `Reserve`: honours ipHint if that address is free in the
 * subnet, else picks the lowest free one; the MAC is deterministic in the name.
 */
export function reserve(subnet: Subnet, name: string, ipHint: string | undefined, taken: ReadonlySet<string>): { ip: string; mac: string } {
  const mac = generateMac(name);
  if (ipHint) {
    const hint = ipToInt(ipHint);
    if (hint !== null && hint >= subnet.first && hint <= subnet.last && !taken.has(ipHint)) return { ip: ipHint, mac };
  }
  for (let n = subnet.first; n <= subnet.last; n++) {
    const ip = intToIp(n);
    if (!taken.has(ip)) return { ip, mac };
  }
  throw capacityExhausted(`no free address left in ${subnet.cidr}`, { subnet: subnet.cidr });
}

/** Locally administered, unicast, derived from the name only: the same name always gets the same MAC. */
export function generateMac(name: string): string {
  const h = createHash('sha256').update(name).digest();
  const bytes = [0x02, ...h.subarray(0, 5)];
  return bytes.map((b) => b.toString(16).padStart(2, '0')).join(':');
}

export const hash8 = (s: string): string => createHash('sha256').update(s).digest('hex').slice(0, 8);

/**
 * The bridge for a new sandbox of `tenant`: the shared one when the operator
 * allows cross-tenant traffic; else the bridge the tenant's sandboxes are
 * already on, unless another tenant is on it too (two old hash names that
 * collided); else the lowest `<prefix>b<n>` no sandbox uses.
 */
export function allocateBridge(
  prefix: string,
  tenant: string,
  allowCrossTenant: boolean,
  used: ReadonlyArray<{ readonly tenant: string; readonly bridge: string }>,
): string {
  if (allowCrossTenant) return `${prefix}bshared`;
  const shared = (bridge: string): boolean => used.some((u) => u.bridge === bridge && u.tenant !== tenant);
  const mine = used.find((u) => u.tenant === tenant && u.bridge !== `${prefix}bshared` && !shared(u.bridge));
  if (mine) return mine.bridge;
  return lowestFree(`${prefix}b`, new Set(used.map((u) => u.bridge)));
}

/** The lowest `<prefix>v<n>` no sandbox uses. */
export function allocateVeth(prefix: string, used: Iterable<string>): string {
  return lowestFree(`${prefix}v`, new Set(used));
}

function lowestFree(stem: string, taken: ReadonlySet<string>): string {
  for (let i = 0; ; i++) if (!taken.has(`${stem}${i}`)) return `${stem}${i}`;
}

/** The sysctls each link must hold; `bridge` adds IPv4 forwarding off. */
function linkSysctls(link: string, kind: 'bridge' | 'veth', forwarding: '0' | '1'): Array<[string, string]> {
  const out: Array<[string, string]> = [
    [`/proc/sys/net/ipv6/conf/${link}/disable_ipv6`, '1'],
    [`/proc/sys/net/ipv6/conf/${link}/accept_ra`, '0'],
  ];
  if (kind === 'bridge') out.push([`/proc/sys/net/ipv4/conf/${link}/forwarding`, forwarding]);
  return out;
}

/**
 * Sets the link's sysctls where they differ and returns one line per change
 * (empty for a link that does not exist, or a kernel without IPv6).
 */
export async function hardenLink(link: string, kind: 'bridge' | 'veth', forwarding: '0' | '1' = '0'): Promise<string[]> {
  const changed: string[] = [];
  for (const [file, want] of linkSysctls(link, kind, forwarding)) {
    const have = await readFile(file, 'utf8').then(
      (v) => v.trim(),
      () => null,
    );
    if (have === null || have === want) continue;
    // The link may go between the read and the write (a destroy racing a reassert).
    const gone = await writeFile(file, want).then(
      () => false,
      (err: unknown) => {
        if ((err as NodeJS.ErrnoException).code === 'ENOENT') return true;
        throw err;
      },
    );
    if (gone) continue;
    changed.push(`sysctl ${file.slice('/proc/sys/'.length).replaceAll('/', '.')} was ${have}, set to ${want}`);
  }
  return changed;
}

/**
 * Creates (or re-creates) the bridge with its gateway address. `fresh`: no
 * live sandbox is on it, so a link of that name is a leftover (a lost
 * state.json) and is replaced rather than joined with whatever ports it has.
 */
export async function ensureBridge(bridge: string, subnet: Subnet, opts: { fresh?: boolean } = {}): Promise<void> {
  // Two ip(8) runs for a new bridge rather than four: each costs a few ms of a busy host's two cores.
  let exists = existsSync(`/sys/class/net/${bridge}`);
  if (exists && opts.fresh) {
    await mustRun('ip', ['link', 'del', bridge]);
    exists = false;
  }
  if (!exists) {
    const add = await runTool('ip', ['link', 'add', 'name', bridge, 'type', 'bridge']);
    // Another create may have won the race; anything else is real.
    if (add.code !== 0 && !/File exists/.test(add.stderr)) await mustRun('ip', ['link', 'add', 'name', bridge, 'type', 'bridge']);
  }
  // Before the link is up: it never takes an IPv6 address or a router advertisement.
  await hardenLink(bridge, 'bridge');
  // replace: idempotent when the address is there already.
  await mustRun('ip', ['-batch', '-'], { input: `addr replace ${subnet.gateway}/32 dev ${bridge}\nlink set ${bridge} up\n` });
}

export async function bridgeForwarding(bridge: string): Promise<string> {
  return (await readFile(`/proc/sys/net/ipv4/conf/${bridge}/forwarding`, 'utf8')).trim();
}

/**
 * Creates the veth pair with its guest end (eth0, with the sandbox's MAC)
 * inside the network namespace of `nsPid`, and the host route to it. The
 * guest configures its own address from inside (launch.ts).
 */
export async function attachSandbox(opts: {
  bridge: string;
  veth: string;
  nsPid: number;
  ip: string;
  mac: string;
  subnet: Subnet;
}): Promise<void> {
  const { bridge, veth, nsPid, ip, mac, subnet } = opts;
  await mustRun('ip', ['link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', String(nsPid), 'address', mac]);
  await hardenLink(veth, 'veth');
  await mustRun('ip', ['-batch', '-'], {
    input: [`link set ${veth} master ${bridge} up`, `route replace ${ip}/32 dev ${bridge} src ${subnet.gateway}`].join('\n') + '\n',
  });
}

export async function detachSandbox(opts: { bridge: string; veth: string; ip: string }): Promise<void> {
  await runTool('ip', ['route', 'del', `${opts.ip}/32`, 'dev', opts.bridge]);
  await runTool('ip', ['link', 'del', opts.veth]);
}

export async function deleteLink(name: string): Promise<boolean> {
  const res = await runTool('ip', ['link', 'del', name]);
  return res.code === 0;
}

export async function listLinks(kind: 'bridge' | 'veth'): Promise<string[]> {
  const res = await runTool('ip', ['-j', 'link', 'show', 'type', kind]);
  if (res.code !== 0) return [];
  try {
    return (JSON.parse(res.stdout) as Array<{ ifname: string }>).map((l) => l.ifname.replace(/@.*/s, ''));
  } catch {
    return [];
  }
}

/** Host /32 routes on one bridge: dst ip list. */
export async function listRoutes(bridge: string): Promise<string[]> {
  const res = await runTool('ip', ['-j', 'route', 'show', 'dev', bridge]);
  if (res.code !== 0) return [];
  try {
    return (JSON.parse(res.stdout) as Array<{ dst: string }>).map((r) => r.dst.replace(/\/32$/, ''));
  } catch {
    return [];
  }
}
