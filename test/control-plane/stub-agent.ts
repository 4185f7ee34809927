import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import type { HostCapacity } from '@fleet/agent-protocol';

/**
 * TEST DOUBLE of the host agent: a tiny, real HTTP server speaking the
 * agent protocol's create path (capacity, create, exec, files, destroy) for
 * many hosts at once (host `h` lives under `/<h>/v1/...`), answering at once
 * without booting anything.
 *
 * Why a double: the races and the control-plane overhead are about placement
 * and reservations on the host streams. Proving them needs hundreds of
 * creates against tens of hosts; booting 400 real sandboxes on 20 real agents
 * on the 2-core CI machine is not feasible, and the agent's own work would
 * drown the figure being measured. Everything on the control-plane side is
 * real (HTTP client, event store, projections, placement); the real agent
 * path is covered by the other control-plane tests, which use real agent
 * processes and sandboxes.
 *
 * The double still keeps its own books: each host counts its live sandboxes
 * and refuses (507 HOST_CAPACITY_EXHAUSTED) beyond its vm_count, recording a
 * violation — a second, independent over-commit check.
 */
export interface StubHost {
  readonly capacity: HostCapacity;
  readonly token: string;
  /** Sandboxes alive now, by name. */
  readonly live: Set<string>;
  /** Calls that would have over-committed this host (must stay 0). */
  overCommits: number;
  /** Answer the next create with this status (e.g. 500) instead of creating. */
  failCreateWith?: number | undefined;
  /** The message of that injected failure. */
  failCreateMessage?: string | undefined;
  /** Extra latency per call, ms. */
  delayMs?: number;
}

export interface StubAgents {
  readonly url: string;
  readonly hosts: Map<string, StubHost>;
  add(id: string, capacity: Partial<HostCapacity> & Pick<HostCapacity, 'vm_count'>): { url: string; token: string };
  readonly calls: { creates: number; destroys: number; execs: number; uploads: number };
  close(): Promise<void>;
}

export async function startStubAgents(): Promise<StubAgents> {
  const hosts = new Map<string, StubHost>();
  const calls = { creates: 0, destroys: 0, execs: 0, uploads: 0 };
  let base = '';

  const handle = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    const send = (status: number, body: unknown): void => {
      res.writeHead(status, { 'content-type': 'application/json' });
      res.end(JSON.stringify(body));
    };
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    const url = new URL(req.url ?? '/', 'http://stub');
    const m = /^\/([a-z0-9-]+)\/v1(\/.*)$/.exec(url.pathname);
    const host = m ? hosts.get(m[1]!) : undefined;
    if (!m || !host) {
      send(404, { code: 'NOT_FOUND', message: `no stub host at ${url.pathname}` });
      return;
    }
    if (req.headers.authorization !== `Bearer ${host.token}`) {
      send(401, { code: 'UNAUTHORIZED', message: 'bad token' });
      return;
    }
    if (host.delayMs) await new Promise((r) => setTimeout(r, host.delayMs));
    const path = m[2]!;
    const method = req.method ?? 'GET';
    if (method === 'GET' && path === '/capacity') {
      send(200, { ...host.capacity, backend: 'process', vms_running: host.live.size });
      return;
    }
    if (method === 'POST' && path === '/vms') {
      calls.creates++;
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as {
        name: string;
        cpus?: number;
        ram_mb?: number;
        tenant?: string;
        image?: string;
        files?: unknown[];
      };
      if (host.failCreateWith) {
        send(host.failCreateWith, { code: 'AGENT_ERROR', message: host.failCreateMessage ?? 'stub: injected failure' });
        return;
      }
      if (host.live.has(body.name)) {
        send(409, { code: 'SANDBOX_EXISTS', message: `${body.name} exists` });
        return;
      }
      if (host.live.size >= host.capacity.vm_count) {
        host.overCommits++;
        {
          send(507, { code: 'HOST_CAPACITY_EXHAUSTED', message: 'stub: no room' });
          return;
        }
      }
      host.live.add(body.name);
      {
        send(201, {
          name: body.name,
          state: 'running',
          image: body.image ?? 'base',
          tenant: body.tenant ?? 'default',
          ip: '10.0.0.2',
          cpus: body.cpus ?? 1,
          ram_mb: body.ram_mb ?? 512,
          created_at: new Date().toISOString(),
          endpoints: [],
          // As a real agent: the files a create carries are written before it answers.
          ...(body.files ? { files_written: body.files.length } : {}),
        });
        return;
      }
    }
    const vm = /^\/vms\/([^/]+)(\/.*)?$/.exec(path);
    if (!vm) {
      send(404, { code: 'NOT_FOUND', message: `stub: no route ${method} ${path}` });
      return;
    }
    const name = decodeURIComponent(vm[1]!);
    const sub = vm[2] ?? '';
    if (method === 'DELETE' && sub === '') {
      calls.destroys++;
      const existed = host.live.delete(name);
      {
        send(200, { name, destroyed: existed, drained: false });
        return;
      }
    }
    if (!host.live.has(name)) {
      send(404, { code: 'SANDBOX_NOT_FOUND', message: `no sandbox ${name}` });
      return;
    }
    if (method === 'POST' && sub === '/exec') {
      calls.execs++;
      {
        send(200, {
          exit_code: 0,
          stdout: '',
          stderr: '',
          encoding: 'utf8',
          stdout_truncated: false,
          stderr_truncated: false,
          timed_out: false,
          duration_ms: 0,
        });
        return;
      }
    }
    if (method === 'PUT' && sub === '/files') {
      calls.uploads++;
      {
        send(200, { path: url.searchParams.get('path') ?? '', size_bytes: Buffer.concat(chunks).length });
        return;
      }
    }
    {
      send(404, { code: 'NOT_FOUND', message: `stub: no route ${method} ${path}` });
      return;
    }
  };

  const server: Server = createServer((req, res) => {
    handle(req, res).catch((err: unknown) => {
      if (!res.headersSent) res.writeHead(500, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ code: 'AGENT_ERROR', message: String(err) }));
    });
  });
  server.keepAliveTimeout = 30_000;
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;

  return {
    url: base,
    hosts,
    calls,
    add(id, capacity) {
      const token = `stub-token-${id}-${'x'.repeat(16)}`;
      hosts.set(id, {
        capacity: { cpus: 64, ram_mb: 262_144, storage_gb: 2_048, arch: 'amd64', ...capacity },
        token,
        live: new Set(),
        overCommits: 0,
      });
      return { url: `${base}/${id}`, token };
    },
    async close() {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}
