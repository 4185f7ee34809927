import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { Agent, request as httpRequest } from 'node:http';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { freePort } from '../src/adapters/postgres/embedded.js';

/**
 * `npm run bench -- ingress [--seconds N] [--connections N] [--keep]`
 *
 * Ingress request overhead: the same busybox httpd in one sandbox, asked
 * for the same small file by --connections (32) keep-alive connections for
 * --seconds (10) each, first directly at the host agent's per-sandbox port,
 * then through the in-process ingress of `npm start` (Host routing, private
 * port: the traffic token is checked on every request). Reports p50/p99
 * latency and requests/s for both. The load generator, the control plane
 * (with the ingress) and the sandbox share this machine's cores, so the
 * numbers are an upper bound on the overhead a separate ingress host adds.
 */
const ROOT = resolve(fileURLToPath(new URL('..', import.meta.url)));

interface Started {
  readonly base: string;
  readonly ingress: string;
  readonly ingressPort: number;
  readonly key: string;
  readonly agentUrl: string;
  readonly agentToken: string;
  readonly child: ChildProcess;
  readonly dataDir: string;
}

async function startEmbeddedDefault(): Promise<Started> {
  const dataDir = await mkdtemp(join(tmpdir(), 'fleet-ingress-bench-'));
  const [port, pgPort, agentPort, ingressPort] = [await freePort(), await freePort(), await freePort(), await freePort()];
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    DATA_DIR: dataDir,
    PORT: String(port),
    EMBEDDED_PG_PORT: String(pgPort),
    LOCAL_AGENT_PORT: String(agentPort),
    INGRESS_PORT: String(ingressPort),
    AGENT_BRIDGE_PREFIX: 'ib',
    AGENT_SUBNET: '10.251.0.0/16',
    LOG_LEVEL: 'warn',
    AGENT_LOG_LEVEL: 'warn',
  };
  const child = spawn(process.execPath, ['--import', 'tsx', join(ROOT, 'src/main.ts')], {
    cwd: ROOT,
    env,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (out += d.toString()));
  const base = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 180_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`npm start exited (${child.exitCode}):\n${out.slice(-3000)}`);
    if (Date.now() > deadline) {
      child.kill('SIGKILL');
      throw new Error(`npm start was not ready within 180 s:\n${out.slice(-3000)}`);
    }
    try {
      const secrets = JSON.parse(await readFile(join(dataDir, 'secrets.json'), 'utf8')) as Record<string, string>;
      const hosts = await fetch(`${base}/v1/hosts`, { headers: { authorization: `Bearer ${secrets.admin_api_key}` } });
      const body = (await hosts.json()) as { hosts?: Array<{ id: string; state: string }> };
      if (hosts.ok && body.hosts?.some((h) => h.id === 'local' && h.state === 'active')) {
        return {
          base,
          ingress: `http://127.0.0.1:${ingressPort}`,
          ingressPort,
          key: secrets.demo_api_key!,
          agentUrl: `http://127.0.0.1:${agentPort}`,
          agentToken: secrets.local_agent_token!,
          child,
          dataDir,
        };
      }
    } catch {
      /* not yet */
    }
    await new Promise((r) => setTimeout(r, 250));
  }
}

async function stop(s: Started, keep: boolean): Promise<void> {
  if (s.child.exitCode === null) {
    s.child.kill('SIGTERM');
    await new Promise<void>((r) => {
      const t = setTimeout(() => {
        s.child.kill('SIGKILL');
        r();
      }, 30_000);
      s.child.once('exit', () => {
        clearTimeout(t);
        r();
      });
    });
  }
  if (!keep) await rm(s.dataDir, { recursive: true, force: true }).catch(() => undefined);
}

async function api(s: Started, method: string, path: string, body?: unknown): Promise<any> {
  const r = await fetch(`${s.base}${path}`, {
    method,
    headers: { authorization: `Bearer ${s.key}`, ...(body ? { 'content-type': 'application/json' } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  const json = (await r.json()) as Record<string, unknown>;
  if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${JSON.stringify(json)}`);
  return json;
}

interface Result {
  readonly requests: number;
  readonly errors: number;
  readonly seconds: number;
  readonly p50: number;
  readonly p99: number;
}

/** `connections` workers, each one request at a time on its own keep-alive socket, for `seconds`. */
async function load(
  target: { port: number; host: string; headers: Record<string, string> },
  connections: number,
  seconds: number,
): Promise<Result> {
  const agent = new Agent({ keepAlive: true, maxSockets: connections });
  const latencies: number[] = [];
  let errors = 0;
  const one = (): Promise<void> =>
    new Promise((resolve) => {
      const t0 = performance.now();
      const req = httpRequest(
        { host: '127.0.0.1', port: target.port, path: '/index.html', headers: { host: target.host, ...target.headers }, agent },
        (res) => {
          res.resume();
          res.on('end', () => {
            if (res.statusCode === 200) latencies.push(performance.now() - t0);
            else errors++;
            resolve();
          });
        },
      );
      req.on('error', () => {
        errors++;
        resolve();
      });
      req.end();
    });
  // Warm-up: open the sockets and fill caches before anything is counted.
  const warmUntil = performance.now() + 1000;
  await Promise.all(
    Array.from({ length: connections }, async () => {
      while (performance.now() < warmUntil) await one();
    }),
  );
  latencies.length = 0;
  errors = 0;
  const t0 = performance.now();
  const until = t0 + seconds * 1000;
  await Promise.all(
    Array.from({ length: connections }, async () => {
      while (performance.now() < until) await one();
    }),
  );
  const elapsed = (performance.now() - t0) / 1000;
  agent.destroy();
  const sorted = [...latencies].sort((a, b) => a - b);
  const pct = (p: number): number => sorted[Math.min(sorted.length - 1, Math.ceil(sorted.length * p) - 1)] ?? NaN;
  return { requests: sorted.length, errors, seconds: elapsed, p50: pct(0.5), p99: pct(0.99) };
}

export default async function ingressBench(args: string[]): Promise<void> {
  const arg = (name: string, dflt: number): number => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const seconds = arg('seconds', 10);
  const connections = arg('connections', 32);
  const keep = args.includes('--keep');
  const s = await startEmbeddedDefault();
  try {
    const vm = await api(s, 'POST', '/v1/vms', {
      cpus: 1,
      ram_mb: 256,
      expose: [{ port: 8080, as: 'web' }],
      files: { '/www/index.html': Buffer.from('ok\n').toString('base64') },
      startup_script: 'httpd -p 8080 -h /www',
    });
    const grant = await api(s, 'GET', `/v1/vms/${vm.id as string}/ingress?after=${vm.position as string}`);
    const ingressUrl = new URL(grant.routes[0].url as string);
    // The host-level endpoint is no longer shown by the API: ask the host agent for it.
    const listed = (await (
      await fetch(`${s.agentUrl}/v1/vms?prefix=fl-`, { headers: { authorization: `Bearer ${s.agentToken}` } })
    ).json()) as { vms: Array<{ name: string; endpoints: Array<{ url: string }> }> };
    const direct = new URL(listed.vms.find((v) => v.name === `fl-${vm.id as string}`)!.endpoints[0]!.url);

    const results: Array<[string, Result]> = [];
    results.push(['direct', await load({ port: Number(direct.port), host: direct.host, headers: {} }, connections, seconds)]);
    results.push([
      'ingress',
      await load(
        { port: s.ingressPort, host: ingressUrl.host, headers: { 'x-traffic-token': grant.traffic_token as string } },
        connections,
        seconds,
      ),
    ]);
    await api(s, 'DELETE', `/v1/vms/${vm.id as string}`);

    const [d, i] = [results[0]![1], results[1]![1]];
    process.stdout.write(
      `ingress bench: ${connections} keep-alive connections, ${seconds} s each, GET of a 3-byte file from busybox httpd in one sandbox\n` +
        `machine: ${cpus().length} cores, load ${loadavg()
          .map((l) => l.toFixed(2))
          .join(' ')}\n\n` +
        `| path | requests/s | p50 ms | p99 ms | errors |\n|---|---|---|---|---|\n` +
        results
          .map(
            ([name, r]) => `| ${name} | ${(r.requests / r.seconds).toFixed(0)} | ${r.p50.toFixed(2)} | ${r.p99.toFixed(2)} | ${r.errors} |`,
          )
          .join('\n') +
        `\n\noverhead: p50 +${(i.p50 - d.p50).toFixed(2)} ms, p99 +${(i.p99 - d.p99).toFixed(2)} ms, throughput ${((i.requests / i.seconds / (d.requests / d.seconds)) * 100).toFixed(0)}% of direct\n`,
    );
  } finally {
    await stop(s, keep);
  }
}
