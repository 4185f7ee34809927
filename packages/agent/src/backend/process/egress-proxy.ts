import { lookup as dnsLookup, Resolver } from 'node:dns/promises';
import { createServer, request as httpRequest, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { connect, isIPv4, Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import type { Logger } from 'pino';
import { domainMatches } from '@fleet/agent-protocol';
import { decide, type EgressHostConfig, type SandboxEgress, type Verdict } from './egress.js';

/**
 * The egress proxy each agent runs for its proxy-mode sandboxes (the
 * provider the project ships): HTTP forward proxy (absolute-form requests)
 * and CONNECT tunnels, listening on the gateway address, where only
 * proxy-mode sandboxes may open connections (firewall). A client is known by
 * its source address, which the bridge table makes trustworthy; an address
 * that is no proxy-mode sandbox is closed at once.
 *
 * What a domain rule covers: the name a request targets (the absolute URL's
 * host for HTTP, which the Host header must agree with; the CONNECT target
 * for tunnels, which a TLS ClientHello's SNI must agree with). The proxy
 * resolves the name itself and connects to that address, so a client cannot
 * pair an allowed name with an address of its choosing. A tunnel to an
 * address literal is judged by address rules only (and a denied SNI in it
 * still closes it). Everything is checked against the address the
 * connection actually goes to.
 *
 * Written on node:http rather than a library: the SNI check needs the
 * tunnel's first client bytes before the upstream connection exists, and
 * the connect must go to the address the policy was checked on.
 */

export interface EgressProxyOptions {
  readonly host: string;
  readonly port: number;
  readonly cfg: EgressHostConfig;
  /** The policy of the sandbox at this source address, if it is in proxy mode. */
  readonly policyOf: (ip: string) => SandboxEgress | undefined;
  /** Every address of this host (never a destination). */
  readonly hostAddresses: () => ReadonlySet<string>;
  /** DNS servers the proxy resolves with; empty: the host's resolver. */
  readonly dnsServers?: readonly string[];
  readonly logger?: Logger | undefined;
}

export interface EgressProxy {
  readonly port: number;
  close(): Promise<void>;
}

class Refused extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
  }
}

const HOP_BY_HOP = new Set([
  'connection',
  'keep-alive',
  'proxy-authorization',
  'proxy-authenticate',
  'proxy-connection',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
]);

export async function startEgressProxy(opts: EgressProxyOptions): Promise<EgressProxy> {
  const resolver = opts.dnsServers && opts.dnsServers.length > 0 ? new Resolver({ timeout: 3000, tries: 2 }) : undefined;
  if (resolver && opts.dnsServers) resolver.setServers([...opts.dnsServers]);

  async function resolveName(name: string): Promise<string> {
    if (isIPv4(name)) return name;
    try {
      if (resolver) {
        const ips = await resolver.resolve4(name);
        if (ips[0]) return ips[0];
      } else {
        return (await dnsLookup(name, { family: 4 })).address;
      }
    } catch {
      /* below */
    }
    throw new Refused(502, `could not resolve ${name}`);
  }

  /** Resolves and judges; the address returned is the one to connect to. */
  async function judge(client: string, host: string): Promise<{ ip: string; verdict: Verdict }> {
    const policy = opts.policyOf(client);
    if (!policy) throw new Refused(403, 'not a proxy-mode sandbox');
    const name = isIPv4(host) ? undefined : host.toLowerCase().replace(/\.$/, '');
    const ip = await resolveName(host);
    return { ip, verdict: decide(policy, opts.cfg, opts.hostAddresses(), { ip, name }, domainMatches) };
  }

  const log = opts.logger;
  const server: Server = createServer({ requireHostHeader: false });
  // A client that half-closes after its request (nc, some scripts) still gets the answer: node's own switch for it.
  Object.assign(server, { httpAllowHalfOpen: true });
  server.on('connection', (sock: Socket) => {
    const ip = (sock.remoteAddress ?? '').replace(/^::ffff:/, '');
    if (!opts.policyOf(ip)) sock.destroy();
  });

  server.on('request', (req: IncomingMessage, res: ServerResponse) => {
    const client = (req.socket.remoteAddress ?? '').replace(/^::ffff:/, '');
    void forward(client, req, res).catch((err: unknown) => {
      const status = err instanceof Refused ? err.status : 502;
      log?.info({ client, url: req.url, status, reason: (err as Error).message }, 'egress proxy refused a request');
      if (!res.headersSent) res.writeHead(status, { 'content-type': 'text/plain', connection: 'close' });
      res.end(`egress: ${(err as Error).message}\n`);
    });
  });

  async function forward(client: string, req: IncomingMessage, res: ServerResponse): Promise<void> {
    let url: URL;
    try {
      url = new URL(req.url ?? '');
    } catch {
      throw new Refused(400, 'a proxy request needs an absolute http:// URL');
    }
    if (url.protocol !== 'http:') throw new Refused(400, `scheme ${url.protocol} is not proxied as a request: use CONNECT`);
    const host = url.hostname;
    const hostHeader = req.headers.host;
    if (hostHeader !== undefined && hostHeader.replace(/:\d+$/, '').toLowerCase() !== host.toLowerCase())
      throw new Refused(400, `Host header ${hostHeader} does not match the request target ${host}`);
    const { ip, verdict } = await judge(client, host);
    if (!verdict.allow) throw new Refused(403, `${host} refused: ${verdict.reason}`);
    const headers: Record<string, string | string[]> = {};
    for (const [k, v] of Object.entries(req.headers)) if (v !== undefined && !HOP_BY_HOP.has(k)) headers[k] = v;
    headers.host = url.host;
    await new Promise<void>((resolve, reject) => {
      const up = httpRequest(
        { host: ip, port: Number(url.port || 80), method: req.method, path: `${url.pathname}${url.search}`, headers },
        (upRes) => {
          const out: Record<string, string | string[]> = {};
          for (const [k, v] of Object.entries(upRes.headers)) if (v !== undefined && !HOP_BY_HOP.has(k)) out[k] = v;
          res.writeHead(upRes.statusCode ?? 502, out);
          upRes.pipe(res);
          upRes.on('end', resolve);
          upRes.on('error', reject);
        },
      );
      up.on('error', (err) => reject(new Refused(502, `upstream ${host}: ${err.message}`)));
      req.pipe(up);
    });
  }

  server.on('connect', (req: IncomingMessage, sock: Duplex, head: Buffer) => {
    if (!(sock instanceof Socket)) {
      sock.destroy();
      return;
    }
    const client = (sock.remoteAddress ?? '').replace(/^::ffff:/, '');
    const open = { tunnel: false };
    void tunnel(client, req, sock, head, open).catch((err: unknown) => {
      const status = err instanceof Refused ? err.status : 502;
      log?.info({ client, target: req.url, status, reason: (err as Error).message }, 'egress proxy refused a tunnel');
      if (sock.writable && !open.tunnel)
        sock.end(`HTTP/1.1 ${status} Refused\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\negress: ${(err as Error).message}\n`);
      else sock.destroy();
    });
  });

  async function tunnel(client: string, req: IncomingMessage, sock: Socket, head: Buffer, open: { tunnel: boolean }): Promise<void> {
    sock.on('error', () => undefined);
    const m = /^(\[[^\]]+\]|[^:]+):(\d{1,5})$/.exec(req.url ?? '');
    if (!m) throw new Refused(400, 'CONNECT needs host:port');
    const [, host = '', portText = ''] = m;
    const port = Number(portText);
    const { ip, verdict } = await judge(client, host);
    if (!verdict.allow) throw new Refused(403, `${host} refused: ${verdict.reason}`);
    sock.write('HTTP/1.1 200 Connection established\r\n\r\n');
    open.tunnel = true;
    const first = head.length > 0 ? head : await firstBytes(sock);
    const sni = serverName(first);
    if (sni !== undefined) {
      const named = isIPv4(host) ? undefined : host.toLowerCase();
      if (named !== undefined && sni !== named) throw new Refused(403, `TLS server name ${sni} does not match the CONNECT target ${named}`);
      if (named === undefined) {
        // An address literal: address rules decided; a denied name still closes it.
        const policy = opts.policyOf(client);
        const byName = policy && decide(policy, opts.cfg, opts.hostAddresses(), { ip, name: sni }, domainMatches);
        if (!byName?.allow) throw new Refused(403, `TLS server name ${sni} refused: ${byName?.reason ?? 'no policy'}`);
      }
    }
    const up = connect({ host: ip, port });
    await new Promise<void>((resolve, reject) => {
      up.once('connect', resolve);
      up.once('error', (err) => reject(new Refused(502, `upstream ${host}: ${err.message}`)));
    });
    up.on('error', () => sock.destroy());
    sock.on('close', () => up.destroy());
    up.on('close', () => sock.destroy());
    if (first.length > 0) up.write(first);
    sock.pipe(up);
    up.pipe(sock);
  }

  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(opts.port, opts.host, () => {
      server.off('error', reject);
      resolve();
    });
  });
  const addr = server.address();
  const port = typeof addr === 'object' && addr ? addr.port : opts.port;
  return {
    port,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}

/** The client's first bytes in the tunnel (a TLS ClientHello fits in a few KiB); empty after 5 s of silence or at end. */
function firstBytes(sock: Socket): Promise<Buffer> {
  return new Promise((resolve) => {
    const done = (b: Buffer): void => {
      clearTimeout(timer);
      sock.off('data', onData);
      sock.off('end', onEnd);
      sock.pause();
      resolve(b);
    };
    let buf = Buffer.alloc(0);
    const onData = (d: Buffer): void => {
      buf = Buffer.concat([buf, d]);
      // A TLS record announces its length: wait for the whole ClientHello record (bounded).
      if (buf[0] === 0x16 && buf.length >= 5 && buf.length < 5 + buf.readUInt16BE(3) && buf.length < 16_384) return;
      done(buf);
    };
    const onEnd = (): void => done(buf);
    const timer = setTimeout(() => done(buf), 5000);
    sock.on('data', onData);
    sock.once('end', onEnd);
  });
}

/** The SNI host name of a TLS ClientHello, lowercased; undefined when `b` is not one or names none. */
export function serverName(b: Buffer): string | undefined {
  try {
    if (b.length < 5 || b[0] !== 0x16) return undefined;
    let i = 5;
    if (b.readUInt8(i) !== 0x01) return undefined; // ClientHello
    i += 4 + 2 + 32; // handshake header, version, random
    i += 1 + b.readUInt8(i); // session id
    i += 2 + b.readUInt16BE(i); // cipher suites
    i += 1 + b.readUInt8(i); // compression methods
    const end = i + 2 + b.readUInt16BE(i);
    i += 2;
    while (i + 4 <= end && i + 4 <= b.length) {
      const type = b.readUInt16BE(i);
      const len = b.readUInt16BE(i + 2);
      i += 4;
      if (type === 0) {
        // server_name list: length, then (type 0, length, name)
        let j = i + 2;
        while (j + 3 <= i + len) {
          const nameType = b.readUInt8(j);
          const nameLen = b.readUInt16BE(j + 1);
          if (nameType === 0)
            return b
              .subarray(j + 3, j + 3 + nameLen)
              .toString('ascii')
              .toLowerCase();
          j += 3 + nameLen;
        }
        return undefined;
      }
      i += len;
    }
  } catch {
    return undefined;
  }
  return undefined;
}
