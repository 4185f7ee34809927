/** IPv4 CIDR arithmetic for network subnets (the agent has its own copy: the packages share no code but the protocol). */

export interface Cidr {
  readonly cidr: string;
  readonly network: number;
  readonly prefixLen: number;
  /** First and last address a member may hold: the network address and the one after it, and the broadcast, are not. */
  readonly first: number;
  readonly last: number;
  readonly size: number;
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

/** undefined when `cidr` is not `a.b.c.d/n` with its host bits zero (a subnet is named by its network address). */
export function parseCidr(cidr: string): Cidr | undefined {
  const m = /^([\d.]+)\/(\d{1,2})$/.exec(cidr);
  const base = m?.[1] === undefined ? null : ipToInt(m[1]);
  const prefixLen = Number(m?.[2]);
  if (base === null || !Number.isInteger(prefixLen) || prefixLen > 32) return undefined;
  const size = 2 ** (32 - prefixLen);
  if (base % size !== 0) return undefined;
  return { cidr: `${intToIp(base)}/${prefixLen}`, network: base, prefixLen, first: base + 2, last: base + size - 2, size };
}

export const contains = (outer: Cidr, inner: Cidr): boolean =>
  inner.network >= outer.network && inner.network + inner.size <= outer.network + outer.size;

export const overlaps = (a: Cidr, b: Cidr): boolean => a.network < b.network + b.size && b.network < a.network + a.size;

export function containsIp(c: Cidr, ip: string): boolean {
  const n = ipToInt(ip);
  return n !== null && n >= c.first && n <= c.last;
}
