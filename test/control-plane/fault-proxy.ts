import { createServer, request, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';

/**
 * A fault injector in front of a REAL host agent: every request is forwarded
 * unchanged, except those a rule picks, which are answered with the rule's
 * status and an agent-shaped error body instead (the agent never sees them).
 * This is how a test makes a real agent "answer 5xx" at one step of a create.
 */
export type FaultRule = (method: string, path: string) => number | undefined;

export interface FaultProxy {
  readonly url: string;
  rule: FaultRule | undefined;
  /** Requests answered by a rule, as "METHOD /path". */
  readonly injected: string[];
  close(): Promise<void>;
}

export async function startFaultProxy(target: string): Promise<FaultProxy> {
  const upstream = new URL(target);
  const proxy: FaultProxy = {
    url: '',
    rule: undefined,
    injected: [],
    close: () => Promise.resolve(),
  };
  const server: Server = createServer((req: IncomingMessage, res: ServerResponse) => {
    const path = (req.url ?? '/').split('?')[0]!;
    const status = proxy.rule?.(req.method ?? 'GET', path);
    if (status !== undefined) {
      proxy.injected.push(`${req.method} ${path}`);
      req.resume();
      res.writeHead(status, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ code: 'AGENT_ERROR', message: `injected ${status} for ${req.method} ${path}` }));
      return;
    }
    const out = request({ host: upstream.hostname, port: upstream.port, method: req.method, path: req.url, headers: req.headers }, (up) => {
      res.writeHead(up.statusCode ?? 502, up.headers);
      up.pipe(res);
    });
    out.on('error', () => {
      if (!res.headersSent) res.writeHead(502, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ code: 'AGENT_ERROR', message: 'proxy: upstream failed' }));
    });
    req.pipe(out);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  Object.assign(proxy, {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    close: async () => {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  });
  return proxy;
}
