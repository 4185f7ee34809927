import { createHash } from 'node:crypto';
import { readFile, writeFile } from 'node:fs/promises';
import { capacityExhausted, invalidSpec } from '../../backend.js';
import { mustRun, runTool } from './exec-util.js';

/**
 * Sandbox networking without a firewall tool (this host has neither iptables
 * nor nft): tenants are separated at layer 2.
 *
 * - One bridge per tenant (`<prefix>b<hash8(tenant)>`), or one shared bridge
 *   (`<prefix>bshared`) when the operator allows cross-tenant traffic.
 * - Addresses come from one host subnet and are unique host-wide; the
 *   gateway (first address) sits on every bridge as a /32, so no bridge owns
 *   a connected route for the subnet and the host reaches each sandbox
 *   through a /32 route on its tenant's bridge.
 * - A sandbox sees the whole subnet as on-link, so it ARPs for a peer: only
 *   peers on its own bridge answer, and the host does no proxy ARP. It
 *   cannot route around that through the gateway: sandboxes have no
 *   CAP_NET_ADMIN to change their routes, and the host does not forward
 *   even where the operator turned ip_forward on: forwarding is off on
 *   every sandbox bridge (a sandbox keeps CAP_NET_RAW and could otherwise
 *   hand the gateway a frame for another tenant).
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
  return ((parts[0]! << 24) | (parts[1]! << 16) | (parts[2]! << 8) | parts[3]!) >>> 0;
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
  return { cidr: `${intToIp(network)}/${prefixLen}`, network, prefixLen, gateway: intToIp(network + 1), first: network + 2, last: broadcast - 1 };
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
  const bytes = [0x02, h[0]!, h[1]!, h[2]!, h[3]!, h[4]!];
  return bytes.map((b) => b.toString(16).padStart(2, '0')).join(':');
}

export const hash8 = (s: string): string => createHash('sha256').update(s).digest('hex').slice(0, 8);

export function bridgeName(prefix: string, tenant: string, allowCrossTenant: boolean): string {
  return allowCrossTenant ? `${prefix}bshared` : `${prefix}b${hash8(tenant)}`;
}

export function vethName(prefix: string, sandbox: string): string {
  return `${prefix}v${hash8(sandbox)}`;
}

export async function ensureBridge(bridge: string, subnet: Subnet): Promise<void> {
  const exists = await runTool('ip', ['link', 'show', 'dev', bridge]);
  if (exists.code !== 0) {
    const add = await runTool('ip', ['link', 'add', 'name', bridge, 'type', 'bridge']);
    // Another create may have won the race; anything else is real.
    if (add.code !== 0 && !/File exists/.test(add.stderr)) await mustRun('ip', ['link', 'add', 'name', bridge, 'type', 'bridge']);
  }
  const addr = await runTool('ip', ['addr', 'add', `${subnet.gateway}/32`, 'dev', bridge]);
  if (addr.code !== 0 && !/File exists|already assigned/.test(addr.stderr)) throw new Error(`ip addr add on ${bridge} failed: ${addr.stderr.trim()}`);
  // Never route what a sandbox sends, even where the operator turned ip_forward on: a sandbox keeps
  // CAP_NET_RAW, so it could address a frame to the gateway's MAC with another tenant's IP in it.
  // (Writing the global ip_forward later resets this; every create checks it and calls ensureBridge again.)
  await writeFile(`/proc/sys/net/ipv4/conf/${bridge}/forwarding`, '0').catch(() => undefined);
  await mustRun('ip', ['link', 'set', bridge, 'up']);
}

export async function bridgeForwarding(bridge: string): Promise<string> {
  return (await readFile(`/proc/sys/net/ipv4/conf/${bridge}/forwarding`, 'utf8')).trim();
}

/**
 * Creates the veth pair with its guest end (eth0, with the sandbox's MAC)
 * inside the network namespace of `nsPid`, and the host route to it. The
 * guest configures its own address from inside (launch.ts).
 */
export async function attachSandbox(opts: { bridge: string; veth: string; nsPid: number; ip: string; mac: string; subnet: Subnet }): Promise<void> {
  const { bridge, veth, nsPid, ip, mac, subnet } = opts;
  await mustRun('ip', ['-batch', '-'], {
    input: [
      `link add ${veth} type veth peer name eth0 netns ${nsPid} address ${mac}`,
      `link set ${veth} master ${bridge} up`,
      `route replace ${ip}/32 dev ${bridge} src ${subnet.gateway}`,
    ].join('\n') + '\n',
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
    return (JSON.parse(res.stdout) as Array<{ ifname: string }>).map((l) => l.ifname.split('@')[0]!);
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
