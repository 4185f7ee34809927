import { cp, mkdtemp, readdir, readFile, rm, stat } from 'node:fs/promises';
import { availableParallelism } from 'node:os';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Writable } from 'node:stream';
import { pino } from 'pino';
import { transparentHugepages } from '../packages/agent/src/backend/process/criu.js';
import { ProcessBackend } from '../packages/agent/src/backend/process/process-backend.js';
import { buildImage } from '../packages/agent/src/images.js';
import { collect } from '../test/support/process.js';
import { uniquePrefix, uniqueSubnet } from '../test/agent/harness.js';

/**
 * `npm run bench -- memory [--mib 64,256] [--runs N] [--forks N] [--full-restore]`
 *
 * Memory checkpoints (CRIU, found through CRIU_PATH or PATH) of real
 * sandboxes holding --mib MiB resident (an awk string) beside a counter:
 * live snapshot time, pause window and size; pause and resume latency
 * p50/p99 over --runs cycles; fork ×--forks from one live snapshot to all
 * running; a move to a second backend (pause, copy of the checkpoint, resume
 * there: the downtime a live migrate between hosts pays, without the
 * network). Published figures beside them. Restores page memory in after
 * they run (the agent's default, AGENT_LAZY_RESTORE) unless --full-restore:
 * the resume line is then followed by the time until every page was in.
 */
export default async function memoryBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: string): string => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? String(args[i + 1]) : dflt;
  };
  const sizes = opt('mib', '64,256').split(',').map(Number);
  const runs = Number(opt('runs', '10'));
  const forks = Number(opt('forks', '10'));
  const log = (s: string): void => void process.stdout.write(`${s}\n`);
  const lazyRestore = !args.includes('--full-restore');
  // Restores fault the memory in: 4 KiB pages unless this is `always` (docs/host-agent.md).
  log(`transparent huge pages: ${(await transparentHugepages()) ?? 'none'}`);
  log(
    `restores: ${lazyRestore ? 'memory paged in after the tree runs (where the host has lazy pages)' : 'every page read before the tree runs (--full-restore)'}`,
  );
  const root = await mkdtemp(join(tmpdir(), 'bench-memory-'));
  const imageDir = join(root, 'images');
  await buildImage(imageDir, 'base');
  // The agent's own 'criu restore' records: where a resume's time goes, step by step.
  const restores: Array<Record<string, number>> = [];
  const logger = pino(
    { level: 'info' },
    new Writable({
      write(chunk: Buffer, _enc, done) {
        for (const line of chunk.toString().split('\n')) {
          if (!line.includes('"criu restore"')) continue;
          const r = JSON.parse(line) as Record<string, unknown>;
          restores.push(
            Object.fromEntries(Object.entries(r).filter((e): e is [string, number] => e[0].endsWith('_ms') && typeof e[1] === 'number')),
          );
        }
        done();
      },
    }),
  );
  const open = async (): Promise<ProcessBackend> =>
    ProcessBackend.open({
      logger,
      dataDir: await mkdtemp(join(root, 'data-')),
      imageDir,
      subnet: uniqueSubnet(),
      bridgePrefix: uniquePrefix(),
      lazyRestore,
      maxSandboxes: forks + 4,
      // The agent's default (AGENT_DISK_POOL): two disks formatted ahead of creates, as a deployed agent has them.
      diskPool: 2,
    });
  const a = await open();
  const b = await open();
  if (!(await a.capacity()).live_snapshot) throw new Error('no working CRIU: set CRIU_PATH (scripts/criu/build.sh prints one)');
  const ms = (t0: number): number => Math.round((performance.now() - t0) * 10) / 10;
  const pct = (xs: number[], p: number): number =>
    [...xs].sort((x, y) => x - y)[Math.min(xs.length - 1, Math.floor((p / 100) * xs.length))]!;
  const sh = async (backend: ProcessBackend, name: string, script: string): Promise<string> =>
    (await collect(await backend.spawn(name, { argv: ['/bin/sh', '-c', script], stdin: false }))).stdout.trim();
  try {
    for (const mib of sizes) {
      const name = `mem${mib}`;
      await a.create({ name, cpus: 1, ram_mb: mib * 2 + 128, storage_gb: 1, tenant: 'bench' });
      await sh(
        a,
        name,
        `(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) >/dev/null 2>&1 & ` +
          `awk 'BEGIN{s=sprintf("%${mib * 1024 * 1024}s",""); while(1) system("sleep 100")}' >/dev/null 2>&1 & echo ok`,
      );
      await new Promise((r) => setTimeout(r, 2000 + mib * 10));
      log(`\n== ${mib} MiB resident ==`);
      let t0 = performance.now();
      const live = await a.checkpoint(name, { live: true });
      const liveMs = ms(t0);
      const dir = await a.checkpointDir(live.id);
      let bytes = 0;
      for (const f of await readdir(dir)) bytes += (await stat(join(dir, f))).size;
      log(`live snapshot: ${liveMs} ms, guest frozen ${live.pause_ms} ms, ${(bytes / 1048576).toFixed(1)} MiB (rootfs + memory)`);

      const pauses: number[] = [];
      const resumes: number[] = [];
      const resident: number[] = [];
      const resumeCpu: number[] = [];
      restores.length = 0;
      for (let i = 0; i < runs; i++) {
        t0 = performance.now();
        await a.pause(name);
        pauses.push(ms(t0));
        t0 = performance.now();
        const cpu0 = await cpuBusyMs();
        await a.resume(name);
        resumes.push(ms(t0));
        resumeCpu.push((await cpuBusyMs()) - cpu0);
        for (let st = await a.lazy.memoryStatus(name); !st.done; st = await a.lazy.memoryStatus(name)) {
          if (st.error !== undefined) throw new Error(`paging the memory in failed: ${st.error}`);
          await new Promise((r) => setTimeout(r, 5));
        }
        resident.push(ms(t0));
      }
      log(`pause:  p50 ${pct(pauses, 50)} ms, p99 ${pct(pauses, 99)} ms over ${runs}`);
      log(`resume: p50 ${pct(resumes, 50)} ms, p99 ${pct(resumes, 99)} ms over ${runs} (aim at 64 MiB: p50 < 150 ms)`);
      log(`  resume to every page in (memory status done, polled every 5 ms): p50 ${pct(resident, 50)} ms, p99 ${pct(resident, 99)} ms`);
      log(`  host CPU busy during a resume (all cores, /proc/stat): p50 ${pct(resumeCpu, 50)} ms`);
      const stepNames = [...new Set(restores.flatMap((r) => Object.keys(r)))];
      log(
        `  of which, p50 per step of the agent's restore: ${stepNames
          .map(
            (k) =>
              `${k.replace(/_ms$/, '')} ${pct(
                restores.map((r) => r[k] ?? 0),
                50,
              )}`,
          )
          .join(', ')} ms`,
      );

      t0 = performance.now();
      const forkCpu0 = await cpuBusyMs();
      await Promise.all(
        Array.from({ length: forks }, (_, i) =>
          a.create({
            name: `${name}-f${i}`,
            checkpointId: live.id,
            resume: true,
            cpus: 1,
            ram_mb: mib * 2 + 128,
            storage_gb: 1,
            tenant: 'bench',
          }),
        ),
      );
      const forkCpu = (await cpuBusyMs()) - forkCpu0;
      log(`fork ×${forks} to all running: ${ms(t0)} ms (aim: < 1500 ms)`);
      log(`  host CPU busy meanwhile: ${forkCpu} ms, so on ${cores} cores no schedule ends before ${Math.round(forkCpu / cores)} ms`);
      for (let i = 0; i < forks; i++) await a.destroy(`${name}-f${i}`);

      // A move: the guest is down from the pause until it runs on the other backend.
      t0 = performance.now();
      const moveSteps: string[] = [];
      let t1 = t0;
      const lap = (step: string): void => {
        moveSteps.push(`${step} ${Math.round(performance.now() - t1)}`);
        t1 = performance.now();
      };
      const paused = await a.pause(name, { id: `${name}-move` });
      lap('pause');
      const staging = join(b.stagingDir(), `bench-${name}`);
      await cp(await a.checkpointDir(paused.id), staging, { recursive: true });
      lap('copy');
      await b.importCheckpoint(staging);
      lap('import');
      await b.create({ name, checkpointId: paused.id, resume: true, cpus: 1, ram_mb: mib * 2 + 128, storage_gb: 1, tenant: 'bench' });
      lap('create with resume');
      log(`move to another backend (pause + copy + resume): downtime ${ms(t0)} ms (aim at 64 MiB: < 500 ms)`);
      log(`  of which: ${moveSteps.join(', ')} ms`);
      log(`  counter there: ${await sh(b, name, 'cat /tmp/count')}`);
      await b.destroy(name);
      await a.destroy(name);
      await a.deleteCheckpoint(live.id);
    }
    log(
      '\nPublished: E2B pause ~4 s per GiB, resume ~1 s; Morph branch "under 250 ms"; CodeSandbox clone of a running VM ~2 s; Fly resume "a few hundred ms".',
    );
    // A lazy move needs two agent processes (the pages stream through the source agent's websocket), not two backends.
    log(
      'Lazy migration between two agents: time to running and to all pages are printed by test/control-plane/vm-lazy-move.test.ts and test/agent/criu-lazy.test.ts.',
    );
  } finally {
    for (const backend of [a, b]) {
      for (const s of await backend.list().catch(() => [])) await backend.destroy(s.name).catch(() => undefined);
      await backend.prune().catch(() => undefined);
      await backend.close();
    }
    await rm(root, { recursive: true, force: true });
  }
}

const cores = availableParallelism();

/** The host's busy CPU time so far, all cores (/proc/stat: everything but idle and iowait), in ms. */
async function cpuBusyMs(): Promise<number> {
  const fields = (await readFile('/proc/stat', 'utf8')).split('\n')[0]!.trim().split(/\s+/).slice(1).map(Number);
  const ticks = fields.slice(0, 8).reduce((a, b) => a + b, 0) - (fields[3] ?? 0) - (fields[4] ?? 0);
  return ticks * 10; // USER_HZ is 100 on Linux
}
