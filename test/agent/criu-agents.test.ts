import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import {
  MEMORY_HOLDER,
  memoryHolder,
  prepareImages,
  slowPagesCriu,
  startAgent,
  throttledCgroup,
  uniquePrefix,
  uniqueSubnet,
  type AgentOptions,
  type RunningAgent,
} from './harness.js';

/**
 * Memory state between real agent processes, over their HTTP API: a paused
 * sandbox's checkpoint moves to another agent under an artifact grant (its
 * memory files verified against their sha256 like the rootfs) and resumes
 * there, processes and listening server included; an agent without CRIU
 * refuses to pause before anything stops. CRIU through CRIU_PATH; under
 * CI=true a missing CRIU fails instead of skipping.
 */

const criu = process.env.CRIU_PATH;
const skip =
  process.platform !== 'linux' || process.getuid?.() !== 0
    ? 'Linux and root'
    : !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0
      ? 'a working CRIU at CRIU_PATH (scripts/criu/build.sh prints one)'
      : undefined;
if (skip && process.env.CI === 'true') test('CRIU is available in CI', () => assert.fail(`missing: ${skip}`));

const STARTUP =
  'echo 0 > /tmp/count; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 & ' +
  '(while true; do echo -e "HTTP/1.0 200 OK\\r\\n\\r\\ncount $(cat /tmp/count)" | nc -l -p 8080; done) >/dev/null 2>&1 & echo started';

async function answer(url: string): Promise<string> {
  for (let i = 0; ; i++) {
    try {
      return await fetch(url, { signal: AbortSignal.timeout(3000) }).then((r) => r.text());
    } catch (err) {
      if (i >= 20) throw err;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

describe('criu between agents', { skip: skip ? `missing: ${skip}` : false, timeout: 300_000 }, () => {
  let root: string;
  let a: RunningAgent;
  let b: RunningAgent;
  let plain: RunningAgent;
  let imageDir: string;
  const agents: RunningAgent[] = [];

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'criu-agents-'));
    const images = await prepareImages();
    if ('skip' in images) throw new Error(images.skip);
    imageDir = images.imageDir;
    const start = async (env: Record<string, string>): Promise<RunningAgent> => {
      const agent = await startAgent({
        dataDir: await mkdtemp(join(root, 'data-')),
        imageDir: images.imageDir,
        subnet: uniqueSubnet(),
        bridgePrefix: uniquePrefix(),
        env,
      });
      agents.push(agent);
      return agent;
    };
    [a, b, plain] = await Promise.all([
      start({ CRIU_PATH: criu! }),
      start({ CRIU_PATH: criu! }),
      start({ CRIU_PATH: '/nonexistent/criu' }),
    ]);
  });

  after(async () => {
    for (const agent of agents) {
      for (const vm of await agent.client.listVms().catch(() => [])) await agent.client.destroyVm(vm.name).catch(() => undefined);
      await agent.client.prune().catch(() => undefined);
      await agent.stop();
      await agent.cleanupHost();
    }
    await rm(root, { recursive: true, force: true });
  });

  test('capacity reports memory checkpoints where CRIU works, and only there', async () => {
    assert.equal((await a.client.capacity()).live_snapshot, true);
    assert.equal((await plain.client.capacity()).live_snapshot, false);
  });

  test('pause on one agent, move the checkpoint under a grant, resume on another: the counter and the server carry on', async () => {
    const vm = await a.client.createVm({ name: 'mover', ram_mb: 256, storage_gb: 1, expose: [{ port: 8080, as: 'http' }] });
    assert.equal((await a.client.exec('mover', { argv: ['/bin/sh', '-c', STARTUP] })).stdout.trim(), 'started');
    await new Promise((r) => setTimeout(r, 300));
    const before = Number((await a.client.exec('mover', { argv: ['cat', '/tmp/count'] })).stdout);
    assert.match(await answer(vm.endpoints[0]!.url), /^count \d+/);

    const paused = await a.client.pauseVm('mover', { id: 'mover-pause' });
    assert.equal(paused.vm.state, 'paused');
    assert.equal(paused.checkpoint.kind, 'live');
    assert.ok(Object.keys(paused.checkpoint.files).length > 5);

    const grant = await a.client.grantArtifact('mover-pause', 60);
    const moved = await b.client.pullArtifact({
      snapshot_id: 'mover-pause',
      digest: paused.checkpoint.digest,
      files: paused.checkpoint.files,
      from: { url: a.url, grant: grant.grant },
    });
    assert.equal(moved.kind, 'live', 'the memory files travelled with the rootfs');

    const there = await b.client.createVm({
      name: 'mover',
      checkpoint_id: 'mover-pause',
      resume: true,
      ram_mb: 256,
      storage_gb: 1,
      expose: [{ port: 8080, as: 'http' }],
    });
    assert.equal(there.state, 'running');
    const after = Number((await b.client.exec('mover', { argv: ['cat', '/tmp/count'] })).stdout);
    assert.ok(after >= before && after < before + 200, `the counter continued from ${before}, got ${after}`);
    assert.match(await answer(there.endpoints[0]!.url), /^count \d+/, "the server answers through the target's endpoint");
    await a.client.destroyVm('mover');
    assert.equal(
      (await a.client.listCheckpoints()).filter((c) => c.id === 'mover-pause').length,
      0,
      "the source's pause checkpoint went with it",
    );
  });

  test('an agent stopped while a resume still pages memory in leaves the daemon be, and adopts it when it comes back: a pause waits for every page', async (t) => {
    if (!(await a.client.capacity()).lazy_pages) return t.skip('this host cannot restore lazily');
    // The daemon held to 2% of a CPU (fault injection, as in criu.test.ts): the agent is killed with pages missing.
    const cg = throttledCgroup();
    if (!cg) return t.skip('no cpu cgroup controller to slow the daemon with');
    t.after(() => cg.remove());
    const slow = join(root, 'slow');
    const opts: AgentOptions = {
      dataDir: await mkdtemp(join(root, 'data-')),
      imageDir,
      subnet: uniqueSubnet(),
      bridgePrefix: uniquePrefix(),
      env: { CRIU_PATH: await slowPagesCriu(join(root, 'criu-slow-pages'), criu!, slow, cg.procs) },
    };
    let agent = await startAgent(opts);
    agents.push(agent);
    await agent.client.createVm({ name: 'adopt', ram_mb: 512, storage_gb: 1 });
    // Through whichever agent runs now (it is restarted below).
    const sh = async (script: string): Promise<{ stdout: string; exitCode: number | null }> => {
      const r = await agent.client.exec('adopt', { argv: ['/bin/sh', '-c', script] });
      return { stdout: r.stdout, exitCode: r.exit_code };
    };
    const holder = memoryHolder(sh);
    // A pause, then a resume whose daemon gets 2% of a CPU for the restore's hand-over and 0.1% after it.
    const slowResume = async (): Promise<void> => {
      await agent.client.pauseVm('adopt');
      cg.throttle();
      await writeFile(slow, '');
      try {
        await agent.client.resumeVm('adopt');
      } finally {
        await rm(slow);
      }
      cg.tighten();
    };
    await sh(MEMORY_HOLDER);
    await holder.ready();
    const before = await holder.sum();
    assert.match(before, / 67108864$/);
    await slowResume();
    let st = await agent.client.memoryStatus('adopt');
    for (let i = 0; i < 100 && st.total_chunks === 0; i++) {
      await new Promise((r) => setTimeout(r, 50));
      st = await agent.client.memoryStatus('adopt');
    }
    assert.ok(st.total_chunks > 15_000 && !st.done, JSON.stringify(st));
    // A clean stop (SIGTERM: the backend closes) must leave the daemon to finish, as a crash does.
    await agent.stop();
    agent = await startAgent(opts);
    agents.push(agent);
    // The daemon outlived the agent; the new one took it back and counts its pages again.
    const again = await agent.client.memoryStatus('adopt');
    assert.ok(again.total_chunks >= st.total_chunks && !again.done && again.error === undefined, JSON.stringify(again));
    const paused = agent.client.pauseVm('adopt');
    const waited = await Promise.race([paused.then(() => false), new Promise((r) => setTimeout(() => r(true), 1000))]);
    assert.ok(waited, 'the pause waits for the adopted daemon');
    cg.unthrottle();
    await paused;
    await agent.client.resumeVm('adopt');
    assert.equal(await holder.sum(), before, 'the memory came back whole');

    // Again, but the daemon dies while no agent runs: the next agent finds its exit status and takes the sandbox as
    // lost (its missing pages would fault in as zeros), instead of recovering it as running.
    await slowResume();
    await agent.stop();
    const daemon = spawnSync('pgrep', ['-f', `^\\S*criu lazy-pages -D ${opts.dataDir}`], { encoding: 'utf8' }).stdout.trim();
    assert.match(daemon, /^\d+$/, 'the daemon outlived the agent');
    // Given the CPU to die (a throttled task exits only when it is scheduled), and gone before the agent starts.
    cg.unthrottle();
    process.kill(Number(daemon), 'SIGKILL');
    for (let i = 0; i < 200 && existsSync(`/proc/${daemon}`); i++) await new Promise((r) => setTimeout(r, 25));
    agent = await startAgent(opts);
    agents.push(agent);
    const lost = await agent.client.memoryStatus('adopt').catch((err: unknown) => err as Error);
    assert.ok(!(lost instanceof Error) && !lost.done && /lost/.test(lost.error ?? ''), JSON.stringify(lost));
    await assert.rejects(agent.client.exec('adopt', { argv: ['true'] }), 'its processes were ended');
    await agent.client.destroyVm('adopt');
  });

  test('a tampered memory file is refused by the pulling agent', async () => {
    await a.client.createVm({ name: 'tamper', ram_mb: 128 });
    const cp = await a.client.checkpoint('tamper', { live: true, id: 'tamper-live' });
    assert.equal(cp.kind, 'live');
    const files = { ...cp.files };
    const first = Object.keys(files).find((f) => f.startsWith('criu-pages'))!;
    files[first] = '0'.repeat(64);
    const grant = await a.client.grantArtifact(cp.id, 60);
    await assert.rejects(
      b.client.pullArtifact({ snapshot_id: cp.id, digest: cp.digest, files, from: { url: a.url, grant: grant.grant } }),
      (err: unknown) => err instanceof AppError && /DIGEST|MISMATCH/i.test(err.code),
    );
    assert.equal((await b.client.listCheckpoints()).filter((c) => c.id === cp.id).length, 0, 'nothing was kept');
  });

  test('an agent without CRIU refuses to pause, and the sandbox runs on', async () => {
    await plain.client.createVm({ name: 'stays', ram_mb: 128 });
    await assert.rejects(
      plain.client.pauseVm('stays'),
      (err: unknown) => err instanceof AppError && err.code === 'MEMORY_CHECKPOINT_UNSUPPORTED',
    );
    assert.equal((await plain.client.getVm('stays')).state, 'running');
    assert.equal((await plain.client.exec('stays', { argv: ['true'] })).exit_code, 0);
  });
});
