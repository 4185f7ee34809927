import { createSocket, type RemoteInfo, type Socket as UdpSocket } from 'node:dgram';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import type { Protocol } from '../../backend.js';

/**
 * Published endpoints: a userspace proxy in the agent from a host port to
 * the sandbox's ip:port. Proxies die with the agent, so recover() recreates
 * them on the same host ports (persisted in state.json).
 */

export interface Proxy {
  readonly hostPort: number;
  readonly protocol: Protocol;
  close(): Promise<void>;
}

export async function startProxy(opts: {
  protocol: Protocol;
  listenHost: string;
  listenPort: number;
  targetHost: string;
  targetPort: number;
}): Promise<Proxy> {
  return opts.protocol === 'udp' ? startUdp(opts) : startTcp(opts);
}

async function startTcp(opts: { listenHost: string; listenPort: number; targetHost: string; targetPort: number }): Promise<Proxy> {
  const sockets = new Set<Socket>();
  const server: Server = createServer((client) => {
    const upstream = createConnection({ host: opts.targetHost, port: opts.targetPort });
    sockets.add(client);
    sockets.add(upstream);
    const done = (): void => {
      client.destroy();
      upstream.destroy();
      sockets.delete(client);
      sockets.delete(upstream);
    };
    client.on('error', done).on('close', done);
    upstream.on('error', done).on('close', done);
    client.pipe(upstream);
    upstream.pipe(client);
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(opts.listenPort, opts.listenHost, () => {
      server.off('error', reject);
      resolve();
    });
  });
  const address = server.address();
  const hostPort = typeof address === 'object' && address ? address.port : opts.listenPort;
  return {
    hostPort,
    protocol: 'tcp',
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}

const UDP_IDLE_MS = 60_000;

async function startUdp(opts: { listenHost: string; listenPort: number; targetHost: string; targetPort: number }): Promise<Proxy> {
  const front: UdpSocket = createSocket('udp4');
  // One upstream socket per client, so replies find their way back to the right client.
  const flows = new Map<string, { sock: UdpSocket; timer: NodeJS.Timeout }>();
  const flowFor = (rinfo: RemoteInfo): UdpSocket => {
    const key = `${rinfo.address}:${rinfo.port}`;
    const existing = flows.get(key);
    if (existing) {
      existing.timer.refresh();
      return existing.sock;
    }
    const sock = createSocket('udp4');
    sock.on('message', (msg) => {
      front.send(msg, rinfo.port, rinfo.address);
      flows.get(key)?.timer.refresh();
    });
    sock.on('error', () => undefined);
    const timer = setTimeout(() => {
      sock.close();
      flows.delete(key);
    }, UDP_IDLE_MS);
    timer.unref();
    flows.set(key, { sock, timer });
    return sock;
  };
  front.on('message', (msg, rinfo) => flowFor(rinfo).send(msg, opts.targetPort, opts.targetHost));
  front.on('error', () => undefined);
  await new Promise<void>((resolve, reject) => {
    front.once('error', reject);
    front.bind(opts.listenPort, opts.listenHost, () => {
      front.off('error', reject);
      resolve();
    });
  });
  return {
    hostPort: front.address().port,
    protocol: 'udp',
    close: async () => {
      for (const { sock, timer } of flows.values()) {
        clearTimeout(timer);
        sock.close();
      }
      flows.clear();
      await new Promise<void>((resolve) => front.close(() => resolve()));
    },
  };
}
