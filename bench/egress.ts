import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { missingPrerequisite, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from '../test/agent/harness.js';
import { startTestInternet, type TestInternet } from '../test/support/test-internet.js';

/**
 * `npm run bench -- egress [--mib N] [--runs N]`
 *
 * Egress throughput from a sandbox to the test "internet" (a namespace this
 * bench makes and removes, test/support/test-internet.ts), one real agent:
 * `direct` (nftables forward + masquerade) against `proxy` (the agent's
 * HTTP forward proxy, the same bytes relayed through node), N MiB per GET
 * (default 256), median of --runs (default 3). Each time is an exec of
 * `nc … | wc -c` in the sandbox minus the same exec fetching 0 bytes, so
 * exec overhead is not counted.
 */
export default async function egressBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: number) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const mib = opt('mib', 256);
  const runs = opt('runs', 3);
  const log = (s: string) => process.stdout.write(`${s}\n`);
  const missing = await missingPrerequisite();
  if (missing) throw new Error(`egress bench needs ${missing}`);
  const images = await prepareImages();
  if ('skip' in images) throw new Error(images.skip);
  const prefix = uniquePrefix();
  const dataDir = await mkdtemp(join(tmpdir(), 'egress-bench-'));
  const proxyPort = 20_000 + (randomBytes(2).readUInt16BE() % 20_000);
  let net: TestInternet | undefined;
  let agent: RunningAgent | undefined;
  try {
    net = await startTestInternet(`q${randomBytes(2).toString('hex')}`);
    agent = await startAgent(
      {
        dataDir,
        imageDir: images.imageDir,
        subnet: uniqueSubnet(),
        bridgePrefix: prefix,
        env: { AGENT_LOG_LEVEL: 'warn', AGENT_EGRESS_PROXY_PORT: String(proxyPort), AGENT_OUTPUT_CAP_BYTES: String(1024 * 1024) },
      },
      60_000,
    );
    const c = agent.client;
    await c.createVm({ name: 'bench-direct', cpus: 1, ram_mb: 256, egress: { mode: 'direct' } });
    const proxied = await c.createVm({ name: 'bench-proxy', cpus: 1, ram_mb: 256, egress: { mode: 'proxy', provider: 'fleet' } });
    const endpoint = (proxied.egress?.endpoint ?? '').replace(/^http:\/\//, '').replace(':', ' ');
    const bytes = mib * 1024 * 1024;
    const fetchCmd = (n: number, viaProxy: boolean): string =>
      viaProxy
        ? `printf 'GET http://${net!.ip1}/bytes?n=${n} HTTP/1.0\\r\\nHost: ${net!.ip1}\\r\\n\\r\\n' | nc ${endpoint} | wc -c`
        : `printf 'GET /bytes?n=${n} HTTP/1.0\\r\\nHost: ${net!.ip1}\\r\\n\\r\\n' | nc ${net!.ip1} 80 | wc -c`;
    const timed = async (name: string, cmd: string): Promise<{ ms: number; out: string }> => {
      const t0 = performance.now();
      const r = await c.exec(name, { argv: ['/bin/sh', '-c', cmd], timeout_ms: 300_000 });
      return { ms: performance.now() - t0, out: r.stdout.trim() };
    };
    const median = (xs: number[]): number => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
    log(`egress throughput, ${mib} MiB per GET, median of ${runs} (host: ${spawnSync('nproc', { encoding: 'utf8' }).stdout.trim()} cores)`);
    for (const [label, name, viaProxy] of [
      ['direct (nftables NAT)', 'bench-direct', false],
      ['proxy (agent HTTP proxy)', 'bench-proxy', true],
    ] as const) {
      const base = median(await Promise.all([0, 1, 2].map(() => timed(name, fetchCmd(0, viaProxy)).then((r) => r.ms))));
      const mbps: number[] = [];
      for (let i = 0; i < runs; i++) {
        const r = await timed(name, fetchCmd(bytes, viaProxy));
        if (Number(r.out) < bytes) throw new Error(`${label}: got ${r.out} bytes, expected more than ${bytes}`);
        mbps.push(mib / (Math.max(1, r.ms - base) / 1000));
      }
      log(
        `  ${label.padEnd(26)} ${median(mbps).toFixed(0).padStart(6)} MiB/s  (runs: ${mbps.map((x) => x.toFixed(0)).join(', ')}; exec baseline ${base.toFixed(0)} ms)`,
      );
    }
  } finally {
    if (agent) {
      for (const vm of await agent.client.listVms('').catch(() => []))
        await agent.client.destroyVm(vm.name, { force: true }).catch(() => undefined);
      await agent.client.prune().catch(() => undefined);
      await agent.stop().catch(() => undefined);
      await agent.cleanupHost().catch(() => undefined);
    }
    net?.remove();
    await rm(dataDir, { recursive: true, force: true });
  }
}
