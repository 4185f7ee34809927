import { spawn, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { createReadStream, createWriteStream } from 'node:fs';
import { mkdtemp, readdir, readFile, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { get as httpGet } from 'node:http';
import { fetchFile } from '../packages/agent/src/artifacts.js';
import { Cgroups } from '../packages/agent/src/backend/process/cgroups.js';
import { spawnViaSpawner } from '../packages/agent/src/backend/process/guest-process.js';
import { missingPrerequisite, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from '../test/agent/harness.js';

/**
 * `npm run bench -- agent [--runs N] [--execs N] [--gib N] [--pull-rounds N] [--only create,exec,pull]`
 *
 * Two real agents (process backend) on this machine:
 * 1. sandbox create → first successful exec, p50/p99 over N runs (default 50);
 * 2. exec round trip of `true`, p50 over --execs (default 200), and beside it,
 *    in the same run, the profile: an HTTP round trip that spawns nothing
 *    (GET the VM), the spawn-to-exit time the agent reports, a Node spawn of
 *    /bin/true and of the helper's `enter … true` from this process (the old
 *    path), the same through agent A's exec spawner socket (the new one), and the
 *    same helper run from a static busybox sh loop (fork+exec from a small
 *    process: what a long-lived spawner could reach);
 * 3. artifact pull of a --gib GiB (default 1) checkpoint from A to B, with
 *    sha256 verification, in MB/s, beside a plain streamed copy of the same
 *    file (read + write, no hashing) and a copy that also hashes, measured
 *    in the same run.
 */
export default async function agentBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: number) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const runs = opt('runs', 50);
  const execs = opt('execs', 200);
  const gib = opt('gib', 1);
  const pullRounds = opt('pull-rounds', 2);
  const onlyIdx = args.indexOf('--only');
  const only = new Set(onlyIdx >= 0 ? String(args[onlyIdx + 1]).split(',') : ['create', 'exec', 'pull']);

  const missing = await missingPrerequisite();
  if (missing) throw new Error(`cannot run the agent benchmark: ${missing}`);
  const images = await prepareImages();
  if ('skip' in images) throw new Error(`cannot run the agent benchmark: ${images.skip}`);
  const dirs = [images.imageDir];
  const agents: RunningAgent[] = [];
  const log = (s: string) => process.stdout.write(`${s}\n`);
  try {
    const mk = async () => {
      const dataDir = await mkdtemp(join(tmpdir(), 'bench-agent-'));
      dirs.push(dataDir);
      const agent = await startAgent(
        { dataDir, imageDir: images.imageDir, subnet: uniqueSubnet(), bridgePrefix: uniquePrefix(), env: { AGENT_LOG_LEVEL: 'warn' } },
        60_000,
      );
      agents.push(agent);
      return agent;
    };
    const a = await mk();
    const b = await mk();
    log(`agents: A ${a.url}, B ${b.url}`);

    // 1. create → first successful exec
    const createMs: number[] = [];
    for (let i = 0; i < (only.has('create') ? runs : 0); i++) {
      const name = `bench-${i}`;
      const t0 = performance.now();
      await a.client.createVm({ name, image: 'base' });
      for (;;) {
        const r = await a.client.exec(name, { argv: ['true'] }).catch(() => undefined);
        if (r?.exit_code === 0) break;
      }
      createMs.push(performance.now() - t0);
      await a.client.destroyVm(name, { force: true });
      if ((i + 1) % 10 === 0) log(`  create→exec ${i + 1}/${runs}: last ${createMs.at(-1)!.toFixed(1)} ms`);
    }
    if (only.has('create'))
      log(`create → first exec: p50 ${pct(createMs, 50).toFixed(1)} ms, p99 ${pct(createMs, 99).toFixed(1)} ms (n=${runs})`);

    // 2. exec round trip
    await a.client.createVm({ name: 'bench-exec', image: 'base' });
    for (let i = 0; i < 10; i++) await a.client.exec('bench-exec', { argv: ['true'] });
    if (only.has('exec')) await execProfile(a, execs, log);
    if (!only.has('pull')) return;

    // 3. artifact pull of a large checkpoint
    const bytes = Math.round(gib * 1024 * 1024 * 1024);
    log(`writing ${gib} GiB of random data in a sandbox…`);
    await a.client.exec(
      'bench-exec',
      { argv: ['sh', '-c', `head -c ${bytes} /dev/urandom > /big.bin`], timeout_ms: 600_000 },
      { timeoutMs: 660_000 },
    );
    log('checkpointing…');
    let t0 = performance.now();
    const cp = await a.client.checkpoint('bench-exec', { comment: 'bench' }, { timeoutMs: 600_000 });
    log(`checkpoint: ${mb(cp.size_bytes)} MB in ${((performance.now() - t0) / 1000).toFixed(2)} s`);

    const src = join(a.opts.dataDir, 'checkpoints', cp.id, 'rootfs.tar');
    const copyDst = join(b.opts.dataDir, 'plain-copy.tar');
    const plainCopy = async (hash: boolean): Promise<number> => {
      const t = performance.now();
      const h = createHash('sha256');
      const stages = [
        createReadStream(src, { highWaterMark: 1024 * 1024 }),
        ...(hash
          ? [
              new Transform({
                transform(c: Buffer, _e, cb) {
                  h.update(c);
                  cb(null, c);
                },
              }),
            ]
          : []),
        createWriteStream(copyDst),
      ] as const;
      await (pipeline as (...s: unknown[]) => Promise<void>)(...stages);
      const secs = (performance.now() - t) / 1000;
      const size = (await stat(copyDst)).size;
      await rm(copyDst);
      return size / 1e6 / secs;
    };
    // Interleaved and repeated: on a shared 2-core machine one sample of either is mostly noise.
    const copyRates: number[] = [];
    const hashRates: number[] = [];
    const pullRates: number[] = [];
    for (let round = 1; round <= pullRounds; round++) {
      copyRates.push(await plainCopy(false));
      hashRates.push(await plainCopy(true));
      const grant = await a.client.grantArtifact(cp.id, 600);
      // Where a pull's time goes: the same file from agent A's artifact route, received by this process (a) into
      // /dev/null (the sender and HTTP alone), (b) with the receiver the agent uses (worker thread, sha256, file).
      const fileUrl = `${a.url}/v1/artifacts/${cp.id}/files/rootfs.tar`;
      const auth = { authorization: `Bearer ${grant.grant}` };
      let t = performance.now();
      await new Promise<void>((resolve, reject) => {
        httpGet(fileUrl, { headers: auth }, (res) => {
          res.on('data', () => undefined);
          res.on('end', resolve);
          res.on('error', reject);
        }).on('error', reject);
      });
      const nullRate = cp.size_bytes / 1e6 / ((performance.now() - t) / 1000);
      t = performance.now();
      const recvDst = join(b.opts.dataDir, 'recv-peer.tar');
      const got = await fetchFile(fileUrl, auth, AbortSignal.timeout(600_000), recvDst);
      const recvRate = got.size / 1e6 / ((performance.now() - t) / 1000);
      await rm(recvDst);
      log(
        `  round ${round} peers: HTTP from A into /dev/null ${nullRate.toFixed(0)} MB/s; the agent's receiver (worker, sha256, file) in this process ${recvRate.toFixed(0)} MB/s`,
      );
      t0 = performance.now();
      const moved = await b.client.pullArtifact(
        { snapshot_id: `${cp.id}-pull${round}`, source_snapshot_id: cp.id, digest: cp.digest, from: { url: a.url, grant: grant.grant } },
        { timeoutMs: 900_000 },
      );
      const pullS = (performance.now() - t0) / 1000;
      pullRates.push(moved.size_bytes / 1e6 / pullS);
      log(
        `  round ${round}: plain copy ${copyRates.at(-1)!.toFixed(0)} MB/s, copy+sha256 ${hashRates.at(-1)!.toFixed(0)} MB/s, ` +
          `pull ${mb(moved.size_bytes)} MB in ${pullS.toFixed(2)} s = ${pullRates.at(-1)!.toFixed(0)} MB/s`,
      );
      await b.client.deleteCheckpoint(moved.snapshot_id);
    }
    const copyRate = Math.max(...copyRates);
    const pullRate = Math.max(...pullRates);
    const ratios = pullRates.map((p, i) => `${((p / copyRates[i]!) * 100).toFixed(0)}%`);
    log(
      `plain copy (read+write, best of ${pullRounds}): ${copyRate.toFixed(0)} MB/s; copy with sha256: ${Math.max(...hashRates).toFixed(0)} MB/s`,
    );
    log(
      `artifact pull A→B (HTTP, sha256-verified, atomic commit; best of ${pullRounds}): ${pullRate.toFixed(0)} MB/s = ${((pullRate / copyRate) * 100).toFixed(0)}% of the plain copy (per round: ${ratios.join(', ')})`,
    );
  } finally {
    for (const agent of agents) {
      try {
        for (const vm of await agent.client.listVms()) await agent.client.destroyVm(vm.name, { force: true });
        await agent.client.prune();
      } catch (err) {
        process.stderr.write(`cleanup failed: ${String(err)}\n`);
      }
      await agent.stop();
      await agent.cleanupHost();
    }
    for (const d of dirs) await rm(d, { recursive: true, force: true }).catch(() => {});
  }
}

/** Exec of `true` through the API, and where its time goes, all on one warm sandbox in the same run. */
async function execProfile(a: RunningAgent, execs: number, log: (s: string) => void): Promise<void> {
  // The helper's own share, outside the agent: the same argv the agent runs, from this process.
  const state = JSON.parse(await readFile(join(a.opts.dataDir, 'sandboxes', 'bench-exec', 'state.json'), 'utf8')) as {
    init_pid: number;
    init_start: string;
  };
  const helperDir = join(a.opts.dataDir, 'runtime-helper');
  const helper = join(
    helperDir,
    (await readdir(helperDir)).find((n) => /^fleet-sandbox-[0-9a-f]+$/.test(n))!,
  );
  const cgArgs = Cgroups.detect(`fleet-${a.opts.bridgePrefix}`)
    .procsFiles('bench-exec')
    .flatMap((f) => ['--cg', f]);
  const enter = [helper, 'enter', String(state.init_pid), '--start', state.init_start, ...cgArgs, '--cwd', '/', '--', 'exec', 'true'];
  const viaSpawner = async (): Promise<number> => {
    const t0 = performance.now();
    const h = spawnViaSpawner(
      join(a.opts.dataDir, 'exec.sock'),
      enter.slice(1),
      { FLEET_E0: Buffer.from('PATH=/bin:/usr/bin').toString('hex') },
      false,
    );
    h.stdout.resume();
    h.stderr.resume();
    const st = await h.wait();
    if (st.exitCode !== 0) throw new Error(`exec through the spawner exited ${st.exitCode ?? st.signal}`);
    return performance.now() - t0;
  };
  const nodeSpawn = async (argv: string[]): Promise<number> => {
    const t0 = performance.now();
    await new Promise<void>((resolve, reject) => {
      const c = spawn(argv[0]!, argv.slice(1), {
        detached: true,
        stdio: ['ignore', 'pipe', 'pipe'],
        env: { FLEET_E0: Buffer.from('PATH=/bin:/usr/bin').toString('hex') },
      });
      let err = '';
      c.stdout.resume();
      c.stderr.setEncoding('utf8').on('data', (d: string) => (err += d));
      c.once('error', reject);
      c.once('close', (code) => (code === 0 ? resolve() : reject(new Error(`${argv[0]} exited ${code}: ${err}`))));
    });
    return performance.now() - t0;
  };
  // Interleaved, one of each per iteration: on a shared machine the load changes from second to second.
  const execMs: number[] = [];
  const insideMs: number[] = [];
  const getMs: number[] = [];
  const trueMs: number[] = [];
  const helperMs: number[] = [];
  const spawnerMs: number[] = [];
  for (let i = 0; i < execs; i++) {
    let t0 = performance.now();
    const r = await a.client.exec('bench-exec', { argv: ['true'] });
    execMs.push(performance.now() - t0);
    insideMs.push(r.duration_ms);
    if (r.exit_code !== 0) throw new Error(`exec of true exited ${r.exit_code}`);
    t0 = performance.now();
    await a.client.getVm('bench-exec');
    getMs.push(performance.now() - t0);
    trueMs.push(await nodeSpawn(['/bin/true']));
    helperMs.push(await nodeSpawn(enter));
    spawnerMs.push(await viaSpawner());
  }
  const f = (xs: number[]) => `p50 ${pct(xs, 50).toFixed(2)} ms, p99 ${pct(xs, 99).toFixed(2)} ms`;
  log(`exec round trip of true: ${f(execMs)} (n=${execs})`);
  log(`  of which spawn → exit inside the agent (duration_ms): ${f(insideMs)}`);
  log(`  peer: GET /v1/vms/:name round trip (same HTTP and auth path, no spawn): ${f(getMs)}`);
  log(`  peer: Node spawn of /bin/true from the bench process: ${f(trueMs)}`);
  log(`  old path, no HTTP: Node spawn of the helper's enter … exec true from the bench process: ${f(helperMs)}`);
  log(`  new path, no HTTP: the same enter … exec true through agent A's spawner socket, from the bench process: ${f(spawnerMs)}`);
  // A static shell forking the helper: the fork+exec of a small process instead of Node's.
  const loop = `i=0; while [ $i -lt ${execs} ]; do "$@" || exit 1; i=$((i+1)); done`;
  let t0 = performance.now();
  let r = spawnSync('/bin/busybox', ['sh', '-c', loop, 'loop', ...enter], {
    env: { FLEET_E0: Buffer.from('PATH=/bin:/usr/bin').toString('hex') },
  });
  const shHelper = (performance.now() - t0) / execs;
  if (r.status !== 0) throw new Error(`helper loop failed: ${String(r.stderr)}`);
  t0 = performance.now();
  r = spawnSync('/bin/busybox', ['sh', '-c', loop, 'loop', '/bin/true']);
  const shTrue = (performance.now() - t0) / execs;
  log(
    `  peer: busybox sh loop, per iteration: helper enter … true ${shHelper.toFixed(2)} ms, /bin/true ${shTrue.toFixed(2)} ms (mean of ${execs})`,
  );
}

function pct(xs: number[], p: number): number {
  const s = [...xs].sort((x, y) => x - y);
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)] ?? NaN;
}

function mb(n: number): string {
  return (n / 1e6).toFixed(0);
}
