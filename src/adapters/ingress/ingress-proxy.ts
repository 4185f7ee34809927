import { createHash, timingSafeEqual } from 'node:crypto';
import {
  Agent,
  createServer,
  request as httpRequest,
  STATUS_CODES,
  type IncomingHttpHeaders,
  type IncomingMessage,
  type Server,
  type ServerResponse,
} from 'node:http';
import type { Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import type { Logger } from 'pino';
import { AppError } from '@fleet/agent-protocol';
import { problem } from '../http/problem.js';
import type { ActivityTracker } from './activity.js';
import type { RouteSource } from './route-source.js';
import type { Waker } from './wake.js';

/**
 * The ingress proxy (the seed's IngressProxy, serving side): one listener in
 * front of every published guest port. A request names its sandbox by Host
 * (`{port}-{vm_id}.{domain}`) or, on any other Host, by the E2B SDK's
 * `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers; the route table (a read
 * model) says which host agent's per-sandbox port serves it now, so the URL
 * survives a migration. Private ports need the VM's traffic token.
 *
 * HTTP/1.1 and upgrades (websockets) pass through with node:http: the
 * proxying needed is one upstream per request, decided before a byte is
 * forwarded, and a port may be served by a handler instead (envd), which a
 * general-purpose proxy library would only wrap.
 */

/** Who a request is for, as a port handler is given it. */
export interface IngressTarget {
  readonly vmId: string;
  readonly tenant: string;
  readonly hostId: string;
  /** The host agent's API address, from the hosts read model. */
  readonly hostUrl: string | undefined;
  readonly port: number;
}

/**
 * Serves one guest port itself instead of proxying it to a published
 * endpoint: e.g. E2B's envd port 49983, which no sandbox publishes. The
 * ingress has already found the VM (by its published routes; with
 * `auth: 'handler'` also any running VM that publishes none) and, unless
 * `auth: 'handler'`, checked its traffic token. Headers naming the
 * sandbox and the traffic token are removed before the handler sees the request.
 */
export interface PortHandler {
  request?(target: IngressTarget, req: IncomingMessage, res: ServerResponse): void | Promise<void>;
  upgrade?(target: IngressTarget, req: IncomingMessage, socket: Duplex, head: Buffer): void | Promise<void>;
  /**
   * With `auth: 'handler'`: answers a request for a VM the ingress cannot find (no such VM, or
   * not running) in the handler's own protocol, e.g. envd's 502 that the E2B SDK reads as "not
   * running". Absent: the ingress's 404 INGRESS_VM_NOT_FOUND. A handler with both `gone` and
   * `request` resolves VMs itself: a plain request for a VM the read model does not show (yet)
   * goes to `request` with only `vmId` and `port` set, and `gone` answers upgrades.
   */
  gone?(vmId: string, req: IncomingMessage, res: ServerResponse): void | Promise<void>;
}

export interface PortHandlerOptions {
  /** `traffic-token` (default): the ingress checks the VM's token first. `handler`: the handler authenticates. */
  readonly auth?: 'traffic-token' | 'handler';
}

/** The per-port handler registry (used by the E2B-compatible layer for envd). */
export class IngressPortHandlers {
  private readonly handlers = new Map<number, { handler: PortHandler; auth: 'traffic-token' | 'handler' }>();

  setPortHandler(port: number, handler: PortHandler, opts: PortHandlerOptions = {}): void {
    if (!Number.isInteger(port) || port < 1 || port > 65535) throw new RangeError(`port ${port} is not 1–65535`);
    this.handlers.set(port, { handler, auth: opts.auth ?? 'traffic-token' });
  }

  deletePortHandler(port: number): void {
    this.handlers.delete(port);
  }

  get(port: number): { handler: PortHandler; auth: 'traffic-token' | 'handler' } | undefined {
    return this.handlers.get(port);
  }
}

export const TRAFFIC_TOKEN_HEADERS = ['x-traffic-token', 'e2b-traffic-access-token'] as const;
const SANDBOX_ID_HEADER = 'e2b-sandbox-id';
const SANDBOX_PORT_HEADER = 'e2b-sandbox-port';
const HOP_BY_HOP = new Set([
  'connection',
  'keep-alive',
  'proxy-authenticate',
  'proxy-authorization',
  'proxy-connection',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
]);
const LABEL = /^([0-9]{1,5})-([a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?)$/;

export interface IngressProxyOptions {
  /** Host suffix of published URLs (`localhost:8081`, `sbx.example.com`); compared case-insensitively. */
  readonly domain: string;
  readonly routes: RouteSource;
  readonly activity?: ActivityTracker | undefined;
  readonly handlers?: IngressPortHandlers | undefined;
  readonly logger: Logger;
  /** Upstream connect + response-head bound. */
  readonly upstreamTimeoutMs?: number | undefined;
  /** Resumes a paused VM a request is for (wake.ts); absent: a paused VM's ports answer as unreachable. */
  readonly waker?: Waker | undefined;
}

/** No VM for a port whose handler answers that itself (PortHandler.gone). */
class HandlerGone extends Error {
  constructor(
    readonly vmId: string,
    readonly port: number,
    readonly answer: NonNullable<PortHandler['gone']>,
    /** The handler's own request path: it resolves the VM itself (the read model may not show a VM created a moment ago). */
    readonly request: PortHandler['request'],
  ) {
    super(`sandbox ${vmId} is not running`);
  }
}

class IngressError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

type Resolved =
  | { readonly target: IngressTarget; readonly upstream: string; readonly handler?: undefined }
  | { readonly target: IngressTarget; readonly handler: PortHandler };

export class IngressProxy {
  readonly server: Server;
  readonly handlers: IngressPortHandlers;
  private readonly agent = new Agent({ keepAlive: true, maxSockets: 256, maxFreeSockets: 64, timeout: 60_000 });
  private readonly domain: string;
  private readonly sockets = new Set<Socket | Duplex>();

  constructor(private readonly opts: IngressProxyOptions) {
    this.domain = opts.domain.toLowerCase();
    this.handlers = opts.handlers ?? new IngressPortHandlers();
    this.server = createServer({ keepAliveTimeout: 65_000 }, (req, res) => void this.onRequest(req, res));
    this.server.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => void this.onUpgrade(req, socket, head));
    this.server.on('connection', (s: Socket) => {
      this.sockets.add(s);
      s.on('close', () => this.sockets.delete(s));
    });
    this.server.on('clientError', (_err, socket) => {
      if (socket.writable) socket.end('HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n');
      else socket.destroy();
    });
  }

  async listen(port: number, host: string): Promise<string> {
    await new Promise<void>((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        resolve();
      });
    });
    const a = this.server.address();
    const bound = typeof a === 'object' && a ? a.port : port;
    return `http://${host.includes(':') ? `[${host}]` : host}:${bound}`;
  }

  async close(): Promise<void> {
    const closed = new Promise<void>((resolve) => this.server.close(() => resolve()));
    for (const s of this.sockets) s.destroy();
    this.agent.destroy();
    await closed;
  }

  /** Host routing first (a wildcard name is unambiguous), then the E2B headers on any other Host. */
  private parse(req: IncomingMessage): { vmId: string; port: number; byHost: boolean } {
    let host = (req.headers.host ?? '').toLowerCase();
    // Some clients name the scheme's default port; a domain without a port matches either way.
    if (!this.domain.includes(':')) host = host.replace(/:[0-9]+$/, '');
    const suffix = `.${this.domain}`;
    if (host.endsWith(suffix)) {
      const [, port, vmId] = LABEL.exec(host.slice(0, -suffix.length)) ?? [];
      if (port === undefined || vmId === undefined)
        throw new IngressError(404, 'INGRESS_NO_ROUTE', `host ${host} is not {port}-{vm_id}.${this.domain}`);
      return { vmId, port: validPort(port), byHost: true };
    }
    const id = single(req.headers[SANDBOX_ID_HEADER]);
    const port = single(req.headers[SANDBOX_PORT_HEADER]);
    if (id === undefined && port === undefined)
      throw new IngressError(
        404,
        'INGRESS_NO_ROUTE',
        `name a sandbox by host ({port}-{vm_id}.${this.domain}) or by the E2b-Sandbox-Id and E2b-Sandbox-Port headers`,
      );
    if (id === undefined || port === undefined || !/^[0-9]{1,5}$/.test(port))
      throw new IngressError(400, 'INGRESS_BAD_ROUTE_HEADERS', 'E2b-Sandbox-Id and E2b-Sandbox-Port (1–65535) go together');
    if (!/^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$/.test(id)) throw new IngressError(404, 'INGRESS_VM_NOT_FOUND', 'no such sandbox');
    return { vmId: id, port: validPort(port), byHost: false };
  }

  private async resolve(req: IncomingMessage, fresh = false): Promise<Resolved> {
    const { vmId, port } = this.parse(req);
    const row = await this.opts.routes.lookup(vmId, fresh);
    const registered = this.handlers.get(port);
    if (!row && registered?.auth === 'handler') {
      // A handler that authenticates itself (envd) serves every running sandbox, not only those publishing ports.
      const vm = await this.opts.routes.lookupRunning(vmId);
      if (vm)
        return {
          target: { vmId, tenant: vm.tenant_id, hostId: vm.host_id, hostUrl: vm.host_url ?? undefined, port },
          handler: registered.handler,
        };
      if (registered.handler.gone)
        throw new HandlerGone(
          vmId,
          port,
          registered.handler.gone.bind(registered.handler),
          registered.handler.request?.bind(registered.handler),
        );
    }
    if (!row) throw new IngressError(404, 'INGRESS_VM_NOT_FOUND', `sandbox ${vmId} does not exist or publishes no ports`);
    // Only a caller who may reach the port wakes the VM: the token is checked before the resume, as after it.
    if (row.vm_state === 'paused' && this.opts.waker) {
      const route = row.routes.find((r) => r.port === port);
      if (registered?.auth !== 'handler' && !(route?.public ?? false)) checkToken(req, row.token_sha256);
      await this.opts.waker.untilRunning(vmId, row.tenant_id);
    }
    const target: IngressTarget = { vmId, tenant: row.tenant_id, hostId: row.host_id, hostUrl: row.host_url ?? undefined, port };
    if (registered) {
      if (registered.auth === 'traffic-token') checkToken(req, row.token_sha256);
      return { target, handler: registered.handler };
    }
    const route = row.routes.find((r) => r.port === port);
    if (!route) throw new IngressError(404, 'INGRESS_PORT_NOT_PUBLISHED', `sandbox ${vmId} does not publish port ${port}`);
    if (!route.public) checkToken(req, row.token_sha256);
    return { target, upstream: route.target };
  }

  private async onRequest(req: IncomingMessage, res: ServerResponse): Promise<void> {
    let resolved: Resolved;
    try {
      resolved = await this.resolve(req);
    } catch (err) {
      if (err instanceof HandlerGone) {
        stripIngressHeaders(req.headers);
        try {
          // Not in the read model yet is not gone: a create answers before the projection has it, and a client calls at
          // once. A handler that resolves the VM itself serves the request (and answers for a VM not running as gone does).
          if (err.request) await err.request({ vmId: err.vmId, tenant: '', hostId: '', hostUrl: undefined, port: err.port }, req, res);
          else await err.answer(err.vmId, req, res);
        } catch (e) {
          this.refuse(res, e);
        }
        return;
      }
      this.refuse(res, err);
      return;
    }
    const { target } = resolved;
    const done = this.opts.activity?.open(target.vmId);
    res.once('close', () => done?.());
    stripIngressHeaders(req.headers);
    if (resolved.handler) {
      try {
        if (!resolved.handler.request) throw new IngressError(404, 'INGRESS_PORT_NOT_PUBLISHED', `port ${target.port} takes upgrades only`);
        await resolved.handler.request(target, req, res);
      } catch (err) {
        this.refuse(res, err);
      }
      return;
    }
    this.forward(req, res, resolved.upstream, target, true);
  }

  private forward(req: IncomingMessage, res: ServerResponse, upstreamUrl: string, target: IngressTarget, mayRetry: boolean): void {
    const upstream = new URL(upstreamUrl);
    const headers = forwardHeaders(req);
    const up = httpRequest({
      host: upstream.hostname,
      port: upstream.port,
      method: req.method,
      path: req.url,
      headers,
      agent: this.agent,
      timeout: this.opts.upstreamTimeoutMs ?? 30_000,
    });
    up.on('response', (ures) => {
      up.setTimeout(0);
      const out: Record<string, string | string[]> = {};
      for (const [k, v] of Object.entries(ures.headers)) if (v !== undefined && !HOP_BY_HOP.has(k)) out[k] = v;
      res.writeHead(ures.statusCode ?? 502, ures.statusMessage, out);
      ures.pipe(res);
      ures.on('error', () => res.destroy());
    });
    up.on('timeout', () => up.destroy(new IngressError(504, 'INGRESS_UPSTREAM_TIMEOUT', 'the sandbox did not answer in time')));
    up.on('error', (err: NodeJS.ErrnoException) => {
      // A route cached from before a migration names the old host: re-read the table once for a request without a body.
      if (mayRetry && err.code === 'ECONNREFUSED' && !res.headersSent && bodiless(req)) {
        this.opts.routes
          .lookup(target.vmId, true)
          .then(async (row) => {
            const route = row?.routes.find((r) => r.port === target.port);
            // Paused since the route was cached: resume it, then send the request on once.
            if (row && route && row.vm_state === 'paused' && this.opts.waker) {
              await this.opts.waker.untilRunning(target.vmId, row.tenant_id);
              this.forward(req, res, route.target, target, false);
            } else if (!row)
              this.refuse(
                res,
                new IngressError(404, 'INGRESS_VM_NOT_FOUND', `sandbox ${target.vmId} does not exist or publishes no ports`),
              );
            else if (!route)
              this.refuse(
                res,
                new IngressError(404, 'INGRESS_PORT_NOT_PUBLISHED', `sandbox ${target.vmId} does not publish port ${target.port}`),
              );
            else if (route.target !== upstreamUrl) this.forward(req, res, route.target, target, false);
            else this.refuse(res, upstreamError(err));
          })
          .catch((e: unknown) => this.refuse(res, e));
        return;
      }
      if (!res.headersSent) this.refuse(res, err instanceof IngressError ? err : upstreamError(err));
      else res.destroy();
    });
    req.pipe(up);
    req.on('aborted', () => up.destroy());
  }

  private async onUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): Promise<void> {
    socket.on('error', () => socket.destroy());
    let resolved: Resolved;
    try {
      resolved = await this.resolve(req);
    } catch (err) {
      this.refuseRaw(socket, err);
      return;
    }
    const { target } = resolved;
    const done = this.opts.activity?.open(target.vmId);
    socket.once('close', () => done?.());
    this.sockets.add(socket);
    socket.once('close', () => this.sockets.delete(socket));
    stripIngressHeaders(req.headers);
    if (resolved.handler) {
      try {
        if (!resolved.handler.upgrade) throw new IngressError(404, 'INGRESS_PORT_NOT_PUBLISHED', `port ${target.port} takes no upgrades`);
        await resolved.handler.upgrade(target, req, socket, head);
      } catch (err) {
        this.refuseRaw(socket, err);
      }
      return;
    }
    const upstream = new URL(resolved.upstream);
    const headers = forwardHeaders(req);
    headers.connection = 'Upgrade';
    if (req.headers.upgrade !== undefined) headers.upgrade = req.headers.upgrade;
    const up = httpRequest({
      host: upstream.hostname,
      port: upstream.port,
      method: req.method,
      path: req.url,
      headers,
      agent: false,
      timeout: this.opts.upstreamTimeoutMs ?? 30_000,
    });
    up.on('upgrade', (ures, usock, uhead) => {
      up.setTimeout(0);
      usock.setTimeout(0);
      let headText = `HTTP/1.1 ${ures.statusCode ?? 101} ${ures.statusMessage ?? 'Switching Protocols'}\r\n`;
      for (let i = 0; i < ures.rawHeaders.length; i += 2) headText += `${ures.rawHeaders[i] ?? ''}: ${ures.rawHeaders[i + 1] ?? ''}\r\n`;
      socket.write(`${headText}\r\n`);
      if (uhead.length > 0) socket.write(uhead);
      if (head.length > 0) usock.write(head);
      usock.pipe(socket);
      socket.pipe(usock);
      const close = (): void => {
        usock.destroy();
        socket.destroy();
      };
      usock.on('error', close).on('close', close);
      socket.on('close', close);
    });
    up.on('response', (ures) => {
      // The sandbox declined the upgrade: pass its answer on, then close.
      let headText = `HTTP/1.1 ${ures.statusCode ?? 502} ${ures.statusMessage ?? ''}\r\n`;
      for (let i = 0; i < ures.rawHeaders.length; i += 2) {
        const k = ures.rawHeaders[i] ?? '';
        if (!HOP_BY_HOP.has(k.toLowerCase())) headText += `${k}: ${ures.rawHeaders[i + 1] ?? ''}\r\n`;
      }
      socket.write(`${headText}connection: close\r\n\r\n`);
      ures.pipe(socket);
    });
    up.on('timeout', () => up.destroy(new IngressError(504, 'INGRESS_UPSTREAM_TIMEOUT', 'the sandbox did not answer in time')));
    up.on('error', (err) => this.refuseRaw(socket, err instanceof IngressError ? err : upstreamError(err)));
    // A client gone before the sandbox answered leaves no upstream connection behind.
    socket.once('close', () => up.destroy());
    up.end();
  }

  private refuse(res: ServerResponse, err: unknown): void {
    const { status, body } = this.problemOf(err);
    if (res.headersSent) {
      res.destroy();
      return;
    }
    res.writeHead(status, { 'content-type': 'application/problem+json', 'content-length': Buffer.byteLength(body) });
    res.end(body);
  }

  private refuseRaw(socket: Duplex, err: unknown): void {
    const { status, body } = this.problemOf(err);
    if (socket.writable)
      socket.end(
        `HTTP/1.1 ${status} ${STATUS_CODES[status] ?? ''}\r\ncontent-type: application/problem+json\r\ncontent-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`,
      );
    else socket.destroy();
  }

  private problemOf(err: unknown): { status: number; body: string } {
    if (err instanceof IngressError) return { status: err.status, body: JSON.stringify(problem(err.status, err.code, err.message)) };
    if (err instanceof AppError && err.code.startsWith('INGRESS_'))
      return { status: err.status, body: JSON.stringify(problem(err.status, err.code, err.message)) };
    this.opts.logger.error({ err }, 'ingress request failed');
    return { status: 500, body: JSON.stringify(problem(500, 'INTERNAL', 'the ingress could not serve this request')) };
  }
}

function validPort(text: string): number {
  const n = Number(text);
  if (!Number.isInteger(n) || n < 1 || n > 65535) throw new IngressError(400, 'INGRESS_BAD_PORT', `port ${text} is not 1–65535`);
  return n;
}

function single(v: string | string[] | undefined): string | undefined {
  return Array.isArray(v) ? v[0] : v;
}

function bodiless(req: IncomingMessage): boolean {
  return (
    (req.method === 'GET' || req.method === 'HEAD' || req.method === 'OPTIONS') &&
    !req.headers['content-length'] &&
    !req.headers['transfer-encoding']
  );
}

/** Constant-time: sha256 of what was presented against the stored sha256, both 32 bytes. */
function checkToken(req: IncomingMessage, expectedSha256: string): void {
  const presented = TRAFFIC_TOKEN_HEADERS.map((h) => single(req.headers[h])).find((v) => v !== undefined && v !== '');
  if (presented === undefined)
    throw new IngressError(401, 'INGRESS_TOKEN_REQUIRED', 'this port is private: send the VM traffic token in X-Traffic-Token');
  const got = createHash('sha256').update(presented).digest();
  const want = Buffer.from(expectedSha256, 'hex');
  if (want.length !== got.length || !timingSafeEqual(got, want))
    throw new IngressError(403, 'INGRESS_TOKEN_INVALID', 'the traffic token is not this VM’s');
}

/** Neither the sandbox nor a handler sees the traffic token or the routing headers. */
function stripIngressHeaders(headers: IncomingHttpHeaders): void {
  for (const h of [...TRAFFIC_TOKEN_HEADERS, SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER]) Reflect.deleteProperty(headers, h);
}

function forwardHeaders(req: IncomingMessage): Record<string, string | string[]> {
  const out: Record<string, string | string[]> = {};
  const extraHop = new Set(
    (req.headers.connection ?? '')
      .split(',')
      .map((s) => s.trim().toLowerCase())
      .filter(Boolean),
  );
  for (const [k, v] of Object.entries(req.headers)) if (v !== undefined && !HOP_BY_HOP.has(k) && !extraHop.has(k)) out[k] = v;
  const prior = single(req.headers['x-forwarded-for']);
  const addr = req.socket.remoteAddress ?? '';
  out['x-forwarded-for'] = prior ? `${prior}, ${addr}` : addr;
  out['x-forwarded-host'] = req.headers.host ?? '';
  out['x-forwarded-proto'] = single(req.headers['x-forwarded-proto']) ?? 'http';
  return out;
}

function upstreamError(err: unknown): IngressError {
  const code = (err as NodeJS.ErrnoException).code ?? '';
  return new IngressError(502, 'INGRESS_UPSTREAM_UNAVAILABLE', `the sandbox's port did not answer (${code || 'error'})`);
}
