import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { missingPrerequisite, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from '../test/agent/harness.js';

/**
 * `npm run bench -- standby [--layer-mib N] [--mib N] [--wait-ms N]`
 *
 * What a standby copy (CHECKPOINT_INTERVAL_MS) saves a live migrate, with
 * two real agents (process backend, CRIU through CRIU_PATH): a sandbox on A
 * with --layer-mib MiB (default 64) written to its layer and --mib MiB
 * (default 64) resident in memory beside a counter. A standby tick (live
 * checkpoint on A, pulled by B), --wait-ms later (default 2000) the freeze
 * of a live migrate, whose checkpoint B pulls twice: against the standby
 * copy (`base_snapshot_id`) and without it. Bytes moved, bytes taken from
 * the copy, and the pull's time, measured in the same run.
 */
export default async function standbyBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: number): number => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const layerMib = opt('layer-mib', 64);
  const mib = opt('mib', 64);
  const waitMs = opt('wait-ms', 2000);
  const missing = await missingPrerequisite();
  if (missing) throw new Error(`cannot run the standby benchmark: ${missing}`);
  const images = await prepareImages();
  if ('skip' in images) throw new Error(`cannot run the standby benchmark: ${images.skip}`);
  const dirs: string[] = [];
  const agents: RunningAgent[] = [];
  const log = (s: string): void => void process.stdout.write(`${s}\n`);
  const mb = (n: number): string => `${(n / 1048576).toFixed(1)} MiB`;
  const name = 'bench-standby';
  try {
    for (let i = 0; i < 2; i++) {
      const dataDir = await mkdtemp(join(tmpdir(), 'bench-standby-'));
      dirs.push(dataDir);
      agents.push(
        await startAgent(
          { dataDir, imageDir: images.imageDir, subnet: uniqueSubnet(), bridgePrefix: uniquePrefix(), env: { AGENT_LOG_LEVEL: 'warn' } },
          60_000,
        ),
      );
    }
    const [a, b] = agents as [RunningAgent, RunningAgent];
    if (!(await a.client.capacity()).live_snapshot) throw new Error('no working CRIU: set CRIU_PATH');
    await a.client.createVm({ name, image: 'base', ram_mb: mib * 2 + 128 });
    await a.client.exec(name, {
      argv: [
        'sh',
        '-c',
        `dd if=/dev/urandom of=/layer.bin bs=1M count=${layerMib} 2>/dev/null; ` +
          `(i=0; while true; do i=$((i+1)); echo $i > /dev/count; sleep 0.1; done) >/dev/null 2>&1 & ` +
          `awk 'BEGIN{s=sprintf("%${mib * 1024 * 1024}s",""); while(1) system("sleep 100")}' >/dev/null 2>&1 & echo ok`,
      ],
      timeout_ms: 120_000,
    });
    await new Promise((r) => setTimeout(r, 2000 + mib * 10));
    const pull = async (id: string, as: string, digest: string, files: Record<string, string>, base?: string) => {
      const grant = await a.client.grantArtifact(id, 600);
      const t0 = performance.now();
      const moved = await b.client.pullArtifact(
        {
          snapshot_id: as,
          source_snapshot_id: id,
          digest,
          from: { url: a.url, grant: grant.grant },
          files,
          ...(base ? { base_snapshot_id: base } : {}),
        },
        { timeoutMs: 600_000 },
      );
      return { ...moved, ms: Math.round(performance.now() - t0) };
    };

    const tick = await a.client.checkpoint(name, { id: 'standby-1', live: true, comment: 'standby' }, { timeoutMs: 600_000 });
    const first = await pull(tick.id, tick.id, tick.digest, tick.files);
    await a.client.deleteCheckpoint(tick.id);
    log(`standby tick: guest frozen ${tick.pause_ms ?? 0} ms; first copy to B moved ${mb(first.size_bytes)} in ${first.ms} ms`);
    await new Promise((r) => setTimeout(r, waitMs));

    const frozen = await a.client.pauseVm(name, { id: 'migrate-1', comment: 'migrate' }, { timeoutMs: 600_000 });
    const cp = frozen.checkpoint;
    const withCopy = await pull(cp.id, 'migrate-1', cp.digest, cp.files, tick.id);
    const without = await pull(cp.id, 'migrate-1-nobase', cp.digest, cp.files);
    log(`live-migrate pull to B, ${layerMib} MiB layer + ${mib} MiB resident, ${waitMs} ms after the standby tick:`);
    log(
      `  with the standby copy:    moved ${mb(withCopy.size_bytes)}, taken from the copy ${mb(withCopy.reused_bytes ?? 0)}, ${withCopy.ms} ms`,
    );
    log(`  without (a plain pull):   moved ${mb(without.size_bytes)}, ${without.ms} ms`);
    log(
      `  saving: ${mb(without.size_bytes - withCopy.size_bytes)} (${((1 - withCopy.size_bytes / without.size_bytes) * 100).toFixed(0)} % of the bytes)`,
    );
    await a.client.resumeVm(name);
    log(`  counter on A after the resume: ${(await a.client.exec(name, { argv: ['cat', '/dev/count'] })).stdout.trim()}`);
  } finally {
    for (const ag of agents) {
      for (const v of await ag.client.listVms().catch(() => [])) await ag.client.destroyVm(v.name, { force: true }).catch(() => undefined);
      await ag.stop().catch(() => undefined);
      await ag.cleanupHost().catch(() => undefined);
    }
    for (const d of dirs) await rm(d, { recursive: true, force: true }).catch(() => undefined);
  }
}
