import { lookup as dnsLookup, type LookupAddress } from 'node:dns';
import { BlockList, isIP } from 'node:net';
import { AppError } from '@fleet/agent-protocol';

/**
 * Where a tenant's webhook may point. A webhook makes the control plane
 * send requests from inside the operator's network, so a target in
 * loopback, private, link-local (cloud metadata at 169.254.169.254),
 * carrier-grade NAT, multicast or reserved space is refused unless the
 * operator allows it (WEBHOOK_ALLOW_PRIVATE=true). A name is judged by every
 * address it resolves to, at creation and again at each delivery — on the
 * very address the request then connects to, so a name re-pointed after the
 * check (DNS rebinding) gains nothing.
 */

const blocked = new BlockList();
for (const [net, bits] of [
  ['0.0.0.0', 8],
  ['10.0.0.0', 8],
  ['100.64.0.0', 10],
  ['127.0.0.0', 8],
  ['169.254.0.0', 16],
  ['172.16.0.0', 12],
  ['192.0.0.0', 24],
  ['192.168.0.0', 16],
  ['198.18.0.0', 15],
  ['224.0.0.0', 4],
  ['240.0.0.0', 4],
] as const)
  blocked.addSubnet(net, bits, 'ipv4');
for (const [net, bits] of [
  ['::', 128],
  ['::1', 128],
  ['fc00::', 7],
  ['fe80::', 10],
  ['ff00::', 8],
] as const)
  blocked.addSubnet(net, bits, 'ipv6');

export function isForbiddenAddress(address: string): boolean {
  const family = isIP(address);
  if (family === 4) return blocked.check(address, 'ipv4');
  if (family === 6) {
    const mapped = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(address)?.[1];
    if (mapped) return blocked.check(mapped, 'ipv4');
    return blocked.check(address, 'ipv6');
  }
  return true;
}

export function targetForbidden(url: string, why: string): AppError {
  return new AppError('WEBHOOK_TARGET_FORBIDDEN', 422, `webhook target ${url} is not allowed: ${why}`, { url });
}

/** The URL's own checks: http(s), no credentials in it. */
export function parseTarget(raw: string): URL {
  let url: URL;
  try {
    url = new URL(raw);
  } catch {
    throw new AppError('VALIDATION_FAILED', 400, 'url must be an absolute http or https URL', { url: raw });
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') throw targetForbidden(raw, 'only http and https');
  if (url.username || url.password) throw targetForbidden(raw, 'credentials in the URL (the signature authenticates us)');
  return url;
}

function resolveAll(host: string): Promise<LookupAddress[]> {
  return new Promise((resolve, reject) =>
    dnsLookup(host, { all: true, verbatim: true }, (err, addrs) => (err ? reject(err) : resolve(addrs))),
  );
}

/** Creation-time check: every address the host resolves to must be allowed. */
export async function assertAllowedTarget(raw: string, allowPrivate: boolean): Promise<URL> {
  const url = parseTarget(raw);
  if (allowPrivate) return url;
  const host = url.hostname.replace(/^\[|\]$/g, '');
  let addrs: LookupAddress[];
  try {
    addrs = isIP(host) ? [{ address: host, family: isIP(host) }] : await resolveAll(host);
  } catch (err) {
    throw targetForbidden(raw, `its host does not resolve (${(err as NodeJS.ErrnoException).code ?? 'error'})`);
  }
  const bad = addrs.find((a) => isForbiddenAddress(a.address));
  if (bad) throw targetForbidden(raw, `it resolves to ${bad.address}, in a loopback, private, link-local or reserved range`);
  return url;
}

type LookupCallback = (err: NodeJS.ErrnoException | null, address: string | LookupAddress[], family?: number) => void;

/**
 * A `lookup` for http.request: resolves as usual, and fails the connection
 * when the address it would connect to is forbidden. Node connects to what
 * this returns, so the check and the connection agree.
 */
export function guardedLookup(allowPrivate: boolean) {
  return (hostname: string, options: { all?: boolean }, callback: LookupCallback): void => {
    dnsLookup(hostname, { all: true, verbatim: true }, (err, addrs) => {
      if (err) {
        callback(err, []);
        return;
      }
      const ok = allowPrivate ? addrs : addrs.filter((a) => !isForbiddenAddress(a.address));
      if (ok.length === 0) {
        const e: NodeJS.ErrnoException = new Error(
          `webhook target ${hostname} resolves only to forbidden addresses (${addrs.map((a) => a.address).join(', ')})`,
        );
        e.code = 'WEBHOOK_TARGET_FORBIDDEN';
        callback(e, []);
        return;
      }
      const first = ok[0];
      if (options.all) callback(null, ok);
      else if (first) callback(null, first.address, first.family);
    });
  };
}
