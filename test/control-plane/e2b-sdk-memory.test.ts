import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import { CommandExitError, InvalidArgumentError, RateLimitError, Sandbox, SandboxError, SandboxNotFoundError } from 'e2b';
import { pino } from 'pino';
import { startIngress, type RunningIngress } from '../../src/adapters/ingress/ingress.js';
import { startAgent, type RunningAgent } from '../agent/harness.js';
import {
  registerHost,
  startCheckedAgent,
  startCheckedFleet,
  startControlPlane,
  TENANT_KEYS,
  type AgentFleet,
  type ControlPlane,
} from '../support/control-plane.js';

/**
 * Issue 19's memory verbs through the stock npm `e2b` SDK, unpatched and
 * configured only by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY: pause then
 * Sandbox.connect (resume) with a process still running and a file intact,
 * fork, createSnapshot then create from it, listSnapshots, deleteSnapshot,
 * getMetrics and updateNetwork, against a real agent whose CRIU comes from
 * CRIU_PATH (a missing CRIU fails under CI=true, skips elsewhere).
 */

const criu = process.env.CRIU_PATH;
const noCriu = !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0 ? 'a working CRIU at CRIU_PATH' : undefined;
if (noCriu && process.env.CI === 'true') it('CRIU is available in CI', () => assert.fail(`missing: ${noCriu}`));

async function until<T>(what: string, f: () => T | undefined | false | Promise<T | undefined | false>, timeoutMs = 15_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await f();
    if (v !== undefined && v !== false) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** The numbers of "tick N" lines, checked to follow each other. */
function ticksOf(chunks: readonly string[]): number[] {
  const ticks = chunks
    .join('')
    .split('\n')
    .filter(Boolean)
    .map((l) => Number(/^tick (\d+)$/.exec(l)?.[1]));
  assert.ok(
    ticks.every((n, i) => Number.isInteger(n) && (i === 0 || n === ticks[i - 1]! + 1)),
    `in order: ${chunks.join('')}`,
  );
  return ticks;
}

const TICKER = 'i=0; while true; do i=$((i+1)); echo "tick $i"; sleep 0.1; done';

/** A counter the sandbox keeps in a file, detached from any envd process. */
const COUNTER =
  '(i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done) >/dev/null 2>&1 </dev/null &';

describe('e2b SDK memory verbs (stock npm SDK, real agent with CRIU)', { timeout: 600_000 }, () => {
  let skip: string | undefined = noCriu;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  let base = '';
  let ingress: RunningIngress | undefined;
  let sbx: Sandbox;
  const made: Sandbox[] = [];
  const env: Record<string, string | undefined> = {};

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const ours = async (id: string): Promise<{ state: string; spec: { egress?: unknown } }> =>
    (await (await fetch(`${base}/v1/vms/${id}`, { headers: { authorization: `Bearer ${TENANT_KEYS.acme}` } })).json()) as {
      state: string;
      spec: { egress?: unknown };
    };
  /** The /v1 read model is a moment behind the VM's stream: its view settles on what `check` wants. */
  const settles = async (id: string, check: (v: Awaited<ReturnType<typeof ours>>) => void): Promise<void> => {
    const deadline = Date.now() + 10_000;
    for (;;) {
      const v = await ours(id);
      try {
        check(v);
        return;
      } catch (err) {
        if (Date.now() > deadline) throw err;
        await new Promise((r) => setTimeout(r, 100));
      }
    }
  };
  const count = async (s: Sandbox): Promise<number> => Number((await s.files.read('/tmp/count')).trim());

  before(async () => {
    if (skip) return;
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    if (skip) return;
    agent = started.agents[0]!;
    cp = await startControlPlane({ env: { RECONCILER_ENABLED: 'false' } });
    const h = await registerHost(cp, 'h1', agent, { capacity_overrides: { cpus: 16 } });
    assert.equal(h.status, 201, JSON.stringify(h.body));
    base = await cp.listen();
    ingress = await startIngress({
      pool: cp.service.pool,
      domain: 'sbx.test',
      host: '127.0.0.1',
      port: 0,
      routeCacheMs: 1000,
      activityFlushMs: 1000,
      recordActivity: cp.service.recordIngressActivity,
      handlers: cp.service.ingressHandlers,
      logger: pino({ level: 'silent' }),
    });
    for (const k of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'E2B_DOMAIN', 'E2B_DEBUG']) env[k] = process.env[k];
    process.env.E2B_API_URL = `${base}/e2b`;
    process.env.E2B_SANDBOX_URL = ingress.url;
    process.env.E2B_API_KEY = TENANT_KEYS.acme;
    sbx = await Sandbox.create({ metadata: { suite: 'e2b-memory' }, requestTimeoutMs: 180_000 });
  });

  after(async () => {
    for (const s of [...made, ...(sbx ? [sbx] : [])]) await s.kill().catch(() => undefined);
    for (const [k, v] of Object.entries(env)) {
      if (v === undefined) Reflect.deleteProperty(process.env, k);
      else process.env[k] = v;
    }
    await ingress?.close();
    await cp?.close();
    await fleet?.close();
  });

  it('pause, then Sandbox.connect with a process still running and a file intact', async (t) => {
    if (guard(t)) return;
    await sbx.files.write('/root/kept.txt', 'kept across a pause\n');
    await sbx.commands.run(COUNTER);
    const before = await until('the counter', async () => (await count(sbx).catch(() => 0)) > 3 && count(sbx));

    assert.equal(await sbx.pause(), true);
    assert.equal(await sbx.pause(), false, 'a second pause is E2B\'s 409: "already paused"');
    await settles(sbx.sandboxId, (v) => assert.equal(v.state, 'paused'));
    const info = await Sandbox.getInfo(sbx.sandboxId);
    assert.equal(info.state, 'paused');
    const paused = await Sandbox.list({ query: { state: ['paused'], metadata: { suite: 'e2b-memory' } } }).nextItems();
    assert.deepEqual(
      paused.map((s) => s.sandboxId),
      [sbx.sandboxId],
    );
    const running = await Sandbox.list({ query: { state: ['running'], metadata: { suite: 'e2b-memory' } } }).nextItems();
    assert.deepEqual(running, [], 'a paused sandbox is not listed as running');
    // Paused means stopped: no envd answers, and the counter the file holds does not move.
    assert.equal(await sbx.isRunning(), false);

    const resumed = await Sandbox.connect(sbx.sandboxId);
    assert.equal(resumed.sandboxId, sbx.sandboxId);
    await settles(sbx.sandboxId, (v) => assert.equal(v.state, 'running'));
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'running');
    assert.equal(await resumed.files.read('/root/kept.txt'), 'kept across a pause\n');
    const at = await count(resumed);
    assert.ok(at >= before, `the counter went on from where it was (${before} → ${at}), not from 0`);
    await until('the counter to move on after the resume', async () => (await count(resumed)) > at);
    // E2B's older resume verb: a running sandbox is its 409.
    const resume = await fetch(`${base}/e2b/sandboxes/${sbx.sandboxId}/resume`, {
      method: 'POST',
      headers: { 'x-api-key': TENANT_KEYS.acme, 'content-type': 'application/json' },
      body: '{}',
    });
    assert.equal(resume.status, 409);
    // Connecting to a running sandbox changes nothing.
    assert.equal((await Sandbox.connect(sbx.sandboxId)).sandboxId, sbx.sandboxId);
    sbx = resumed;
  });

  it('pause keeps an envd background process: commands.connect(pid) after the resume, output in order', async (t) => {
    if (guard(t)) return;
    // An envd background process: it must survive the pause and be re-attachable by pid after the resume, its output in order.
    const seen: string[] = [];
    const bg = await sbx.commands.run('i=0; while true; do i=$((i+1)); echo "tick $i"; sleep 0.1; done', {
      background: true,
      timeoutMs: 0,
      onStdout: (d) => void seen.push(d),
    });
    await until('ticks before the pause', () => seen.join('').includes('tick 3'));
    await bg.disconnect();
    assert.equal(await sbx.pause(), true);
    const resumed = await Sandbox.connect(sbx.sandboxId);
    sbx = resumed;
    const procs = await resumed.commands.list();
    assert.ok(
      procs.some((p) => p.pid === bg.pid),
      `the envd process ${bg.pid} is still listed: ${JSON.stringify(procs)}`,
    );
    const after: string[] = [];
    const again = await resumed.commands.connect(bg.pid, { timeoutMs: 0, onStdout: (d) => void after.push(d) });
    await until('ticks after the resume', () => after.join('').split('\n').filter(Boolean).length >= 3);
    const ticks = after
      .join('')
      .split('\n')
      .filter(Boolean)
      .map((l) => Number(/^tick (\d+)$/.exec(l)?.[1]));
    const lastBefore = Number(/tick (\d+)\n$/.exec(seen.join(''))?.[1] ?? '0');
    assert.ok(
      ticks.every((n, i) => Number.isInteger(n) && (i === 0 || n === ticks[i - 1]! + 1)),
      `in order: ${after.join('')}`,
    );
    assert.ok(ticks[0]! > lastBefore, `continues after ${lastBefore}: ${ticks[0]}`);
    assert.equal(await resumed.commands.kill(bg.pid), true);
    const end = await again.wait().catch((e: unknown) => e);
    assert.ok(end instanceof Error || (end as { exitCode: number }).exitCode !== 0);
  });

  it('stdin across a pause: sendStdin and closeStdin after Sandbox.connect reach the same process', async (t) => {
    if (guard(t)) return;
    const out: string[] = [];
    const h = await sbx.commands.run('n=0; while read -r l; do n=$((n+1)); echo "got $l"; done; echo "eof after $n lines"', {
      background: true,
      stdin: true,
      timeoutMs: 0,
      onStdout: (d) => void out.push(d),
    });
    await sbx.commands.sendStdin(h.pid, 'one\n');
    await until('the first line back', () => out.join('').includes('got one'));
    // Sent while no client follows: it waits in the FIFO the pause keeps.
    await h.disconnect();
    await sbx.commands.sendStdin(h.pid, 'two\n');
    assert.equal(await sbx.pause(), true);
    const resumed = await Sandbox.connect(sbx.sandboxId);
    sbx = resumed;
    assert.ok(
      (await resumed.commands.list()).some((p) => p.pid === h.pid),
      'the stdin process is still listed',
    );
    const after: string[] = [];
    const again = await resumed.commands.connect(h.pid, { timeoutMs: 0, onStdout: (d) => void after.push(d) });
    await resumed.commands.sendStdin(h.pid, 'three\n');
    await until('the line sent after the resume', () => after.join('').includes('got three'));
    await resumed.commands.closeStdin(h.pid);
    const r = await again.wait();
    assert.equal(r.exitCode, 0);
    // The line sent before the pause was read too (its echo went to no client: nothing is replayed).
    assert.ok(after.join('').endsWith('eof after 3 lines\n'), `EOF after the close: ${after.join('')}`);
  });

  it('a chatty durable process: what it wrote stays bounded on the sandbox disk while all of it arrives in order', async (t) => {
    if (guard(t)) return;
    let got = 0;
    let partial = '';
    let last = 0;
    let disorder = '';
    const h = await sbx.commands.run('i=1; while :; do seq $i $((i+9999)); i=$((i+10000)); sleep 0.05; done', {
      background: true,
      timeoutMs: 0,
      onStdout: (d) => {
        got += Buffer.byteLength(d);
        const lines = (partial + d).split('\n');
        partial = lines.pop() ?? '';
        for (const l of lines) {
          if (Number(l) !== last + 1 && !disorder) disorder = `${l} after ${last}`;
          last = Number(l);
        }
      },
    });
    const usage = async (): Promise<number> => {
      const r = await sbx.commands.run(
        `for d in /run/fleet-envd/p.*; do read -r p _ <"$d/pid"; [ "$p" = ${h.pid} ] && du -sk "$d" | cut -f1; done; true`,
      );
      return Number(r.stdout.trim());
    };
    const sizes: number[] = [];
    for (const mib of [4, 8, 12]) {
      await until(`${mib} MiB of output`, () => got >= mib * 1024 * 1024, 120_000);
      sizes.push(await usage());
    }
    // Two chunks of at most 512 KiB a stream stay once delivered; the rest is what the follower has not read yet.
    assert.ok(
      sizes.every((k) => k > 0 && k <= 2560),
      `KiB on disk at 4, 8 and 12 MiB of output: ${sizes.join(', ')}`,
    );
    assert.equal(disorder, '', 'every line in order');
    assert.equal(await sbx.commands.kill(h.pid), true);
    await assert.rejects(h.wait());
    assert.equal(disorder, '');
  });

  it('a durable process whose supervisor is gone without a status ends as lost (-1), its directory removed', async (t) => {
    if (guard(t)) return;
    const h = await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0 });
    // As after a stop→start with /run on the sandbox's disk: the directory stays, its supervisor and command do not.
    await sbx.commands.run(`for d in /run/fleet-envd/p.*; do read -r p s <"$d/pid"; [ "$p" = ${h.pid} ] && kill -9 "$s" "$p"; done; true`);
    // Bounded: without the check, the follower polls the directory forever.
    const err = await Promise.race([
      h.wait().catch((e: unknown) => e),
      new Promise((r) => setTimeout(() => r(new Error('no end within 30 s')), 30_000)),
    ]);
    assert.ok(err instanceof CommandExitError, String(err));
    assert.equal(err.exitCode, -1);
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid), 'not listed');
    const left = await sbx.commands.run(
      `for d in /run/fleet-envd/p.*; do read -r p _ <"$d/pid" && [ "$p" = ${h.pid} ] && echo "$d"; done; true`,
    );
    assert.equal(left.stdout.trim(), '', 'its directory is removed');
  });

  it('envs stay off every argv in the guest; oversized args and envs are refused with a 400', async (t) => {
    if (guard(t)) return;
    const secret = `S3CRETMARK${'x'.repeat(60_000)}`;
    const h = await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0, envs: { FLEET_TEST_SECRET: secret } });
    // The bracket keeps grep's own argv from matching.
    const found = await sbx.commands.run("grep -l 'S[3]CRETMARK' /proc/[0-9]*/cmdline 2>/dev/null; true");
    assert.equal(found.stdout.trim(), '', 'no process has the env on its command line');
    const listed = (await sbx.commands.list()).find((p) => p.pid === h.pid);
    assert.equal(listed?.envs.FLEET_TEST_SECRET, secret, 'the envs are still what the process was started with');
    assert.equal(await sbx.commands.kill(h.pid), true);
    const tooBig: Record<string, string>[] = [
      { BIG: 'y'.repeat(200_000) },
      Object.fromEntries(['A', 'B', 'C', 'D', 'E'].map((k) => [k, k.repeat(60_000)])),
    ];
    for (const envs of tooBig) await assert.rejects(sbx.commands.run('true', { envs }), InvalidArgumentError);
    await assert.rejects(sbx.commands.run(`echo ${'z'.repeat(200_000)}`), InvalidArgumentError);
  });

  it('stdin the process does not read: sendStdin is refused past 4 MiB pending (resource exhausted)', async (t) => {
    if (guard(t)) return;
    const h = await sbx.commands.run('sleep 1000', { background: true, stdin: true, timeoutMs: 0 });
    const chunk = 'x'.repeat(512 * 1024);
    let refused: unknown;
    for (let i = 0; i < 32 && !refused; i++)
      refused = await sbx.commands.sendStdin(h.pid, chunk).then(
        () => undefined,
        (e: unknown) => e,
      );
    assert.ok(refused instanceof RateLimitError, String(refused));
    assert.match(refused.message, /not yet read/);
    assert.equal(await sbx.commands.kill(h.pid), true);
    await assert.rejects(h.wait());
  });

  it('getMetrics: E2B-shaped samples of the running sandbox', async (t) => {
    if (guard(t)) return;
    const m = await until(
      'two metric samples',
      async () => {
        const r = await sbx.getMetrics();
        return r.length > 0 && r;
      },
      30_000,
    );
    const last = m.at(-1)!;
    assert.ok(last.timestamp instanceof Date && !Number.isNaN(last.timestamp.getTime()));
    assert.equal(last.cpuCount, 1);
    assert.ok(last.cpuUsedPct >= 0 && last.cpuUsedPct <= 100, String(last.cpuUsedPct));
    assert.ok(last.memUsed > 0 && last.memUsed <= last.memTotal, `${last.memUsed} of ${last.memTotal}`);
    assert.equal(last.memTotal, 512 * 1024 * 1024);
    assert.equal(last.diskTotal, 1024 * 1024 * 1024);
    // A window in the future holds no sample.
    assert.deepEqual(await sbx.getMetrics({ start: new Date(Date.now() + 3_600_000) }), []);
    await assert.rejects(Sandbox.getMetrics('no-such-sandbox'), SandboxNotFoundError);
    // Another tenant's sandbox does not exist for any of these verbs.
    const globex = { apiKey: TENANT_KEYS.globex };
    await assert.rejects(Sandbox.getMetrics(sbx.sandboxId, globex), SandboxNotFoundError);
    await assert.rejects(Sandbox.pause(sbx.sandboxId, globex), SandboxNotFoundError);
    await assert.rejects(Sandbox.createSnapshot(sbx.sandboxId, globex), SandboxNotFoundError);
    await assert.rejects(Sandbox.updateNetwork(sbx.sandboxId, { allowInternetAccess: false }, globex), SandboxNotFoundError);
    await assert.rejects(Sandbox.fork(sbx.sandboxId, globex), SandboxNotFoundError);
    await assert.rejects(Sandbox.connect(sbx.sandboxId, globex), SandboxNotFoundError);
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'running', 'and nothing happened to it');
  });

  it('updateNetwork: replaces the egress policy (omitted fields cleared)', async (t) => {
    if (guard(t)) return;
    await sbx.updateNetwork({ allowOut: ['198.51.100.7'], denyOut: ['0.0.0.0/0'] });
    await settles(sbx.sandboxId, (v) =>
      assert.deepEqual(v.spec.egress, { mode: 'direct', allow_out: ['198.51.100.7'], deny_out: ['0.0.0.0/0'] }),
    );
    await sbx.updateNetwork({ allowInternetAccess: false });
    await settles(sbx.sandboxId, (v) => assert.deepEqual(v.spec.egress, { mode: 'none' }));
    assert.equal((await sbx.getInfo()).allowInternetAccess, false);
    await sbx.updateNetwork({});
    await settles(sbx.sandboxId, (v) => assert.deepEqual(v.spec.egress, { mode: 'direct' }));
    // What has no counterpart here is refused, never dropped.
    await assert.rejects(
      sbx.updateNetwork({ allowOut: ['example.com'] }),
      (e: unknown) => e instanceof SandboxError && /400/.test(e.message),
    );
    await assert.rejects(
      sbx.updateNetwork({ egressProxy: { address: 'http://198.51.100.9:3128' } }),
      (e: unknown) => e instanceof SandboxError && /400/.test(e.message),
    );
    await settles(sbx.sandboxId, (v) => assert.deepEqual(v.spec.egress, { mode: 'direct' }));
    await assert.rejects(Sandbox.updateNetwork('no-such-sandbox', {}), SandboxNotFoundError);
  });

  it('createSnapshot, then Sandbox.create from it; listSnapshots; deleteSnapshot', async (t) => {
    if (guard(t)) return;
    await sbx.files.write('/root/snap.txt', 'in the snapshot\n');
    const snap = await sbx.createSnapshot({ name: 'e2b-memory-snap' });
    assert.match(snap.snapshotId, /\S/);
    assert.deepEqual(snap.names, ['e2b-memory-snap']);
    assert.equal(await sbx.isRunning(), true, 'the source runs on');
    const listed = await sbx.listSnapshots().nextItems();
    assert.ok(
      listed.some((s) => s.snapshotId === snap.snapshotId),
      JSON.stringify(listed),
    );
    const byName = await Sandbox.listSnapshots({ name: 'e2b-memory-snap' }).nextItems();
    assert.deepEqual(
      byName.map((s) => s.snapshotId),
      [snap.snapshotId],
    );
    assert.deepEqual(await Sandbox.listSnapshots({ apiKey: TENANT_KEYS.globex }).nextItems(), [], 'another tenant sees none');

    const child = await Sandbox.create(snap.snapshotId, { requestTimeoutMs: 180_000 });
    made.push(child);
    assert.notEqual(child.sandboxId, sbx.sandboxId);
    assert.equal(await child.files.read('/root/snap.txt'), 'in the snapshot\n');
    assert.equal(await child.files.read('/root/kept.txt'), 'kept across a pause\n');
    assert.equal((await child.getInfo()).templateId, snap.snapshotId);

    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, { apiKey: TENANT_KEYS.globex }), false, "another tenant's is not found");
    // Two racing deletes: exactly one deletes it; a delete right after is not found.
    const raced = await Promise.all([Sandbox.deleteSnapshot(snap.snapshotId), Sandbox.deleteSnapshot(snap.snapshotId)]);
    assert.deepEqual([...raced].sort(), [false, true], `racing deletes answered ${JSON.stringify(raced)}`);
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false);
    assert.equal(await Sandbox.deleteSnapshot('no-such-snapshot'), false);
  });

  it('fork: the child lists the durable process under its pid; its output from the fork point on is its own; kill in one', async (t) => {
    if (guard(t)) return;
    const seen: string[] = [];
    const bg = await sbx.commands.run(TICKER, { background: true, timeoutMs: 0, onStdout: (d) => void seen.push(d) });
    await until('ticks before the fork', () => seen.join('').includes('tick 3'));
    const [child] = await sbx.fork({ count: 1, timeoutMs: 120_000, requestTimeoutMs: 240_000 });
    assert.ok(child instanceof Sandbox, child instanceof Error ? child.message : 'not a sandbox');
    made.push(child);
    const atFork = ticksOf(seen).at(-1)!;
    const listed = await child.commands.list();
    assert.ok(
      listed.some((p) => p.pid === bg.pid && p.cmd === '/bin/bash' && p.args.join(' ').includes('tick')),
      `the fork lists ${bg.pid} with its command: ${JSON.stringify(listed)}`,
    );
    const mine: string[] = [];
    const inChild = await child.commands.connect(bg.pid, { timeoutMs: 0, onStdout: (d) => void mine.push(d) });
    await until('ticks in the fork', () => mine.join('').split('\n').filter(Boolean).length >= 3);
    const ticks = ticksOf(mine);
    // The child's follower starts where the source's had delivered at the checkpoint, which came before the fork's answer.
    assert.ok(ticks[0]! >= 4 && ticks[0]! <= atFork + 5, `the fork goes on from the fork point (${atFork}): ${ticks[0]}`);
    assert.equal(await child.commands.kill(bg.pid), true);
    await assert.rejects(inChild.wait());
    assert.ok(!(await child.commands.list()).some((p) => p.pid === bg.pid), 'gone from the fork');
    // The source's process is its own: still listed, still ticking.
    assert.ok((await sbx.commands.list()).some((p) => p.pid === bg.pid));
    const n = seen.length;
    await until('the source ticks on', () => seen.length > n + 2);
    ticksOf(seen);
    assert.equal(await sbx.commands.kill(bg.pid), true);
    await assert.rejects(bg.wait());
  });

  it('fork of a running sandbox: count forks with the source files, each its own sandbox', async (t) => {
    if (guard(t)) return;
    await sbx.files.write('/root/fork.txt', 'before the fork\n');
    // What the agent did meanwhile, printed when the fork rejects or answers an error for one fork.
    const diagnose = (): void => {
      // A restore that never ends shows its last step here.
      const log = agent.output().split('\n');
      t.diagnostic(`agent log, last 80 of ${log.length} lines:\n${log.slice(-80).join('\n')}`);
      // The whole criu log of each restore that hung (the agent keeps them; a retry's is -v4, with timestamps).
      const hung = join(agent.opts.dataDir, 'criu-hung');
      for (const f of existsSync(hung) ? readdirSync(hung).sort() : []) {
        const [restore = '', daemon = ''] = readFileSync(join(hung, f), 'utf8').split('\n---- lazy-pages.log ----\n');
        const lines = restore.split('\n');
        // Where each restored task got to (a -v4 line names its task: "(ts) pie: 5: ..." or "(ts)      5: ...").
        const lastOf = new Map<string, string>();
        for (const l of lines) {
          const task = /^\(\s*[\d.]+\)\s+(?:pie: )?(\d+): /.exec(l)?.[1];
          if (task !== undefined) lastOf.set(task, l);
        }
        t.diagnostic(`${f}: the last line of each task:\n${[...lastOf.values()].join('\n')}`);
        t.diagnostic(`${f}, last 150 of ${lines.length} lines:\n${lines.slice(-150).join('\n')}`);
        if (daemon !== '') t.diagnostic(`its lazy-pages daemon, last 60 lines:\n${daemon.split('\n').slice(-60).join('\n')}`);
      }
    };
    const forks = await sbx.fork({ count: 2, timeoutMs: 120_000, requestTimeoutMs: 240_000 }).catch((err: unknown) => {
      diagnose();
      throw err;
    });
    if (forks.some((f) => f instanceof Error)) diagnose();
    assert.equal(forks.length, 2);
    const ids = new Set<string>([sbx.sandboxId]);
    for (const f of forks) {
      assert.ok(f instanceof Sandbox, f instanceof Error ? f.message : 'not a sandbox');
      made.push(f);
      ids.add(f.sandboxId);
      assert.equal(await f.files.read('/root/fork.txt'), 'before the fork\n');
      const info = await f.getInfo();
      assert.ok(Math.abs(info.endAt.getTime() - Date.now() - 120_000) < 30_000, `endAt ${info.endAt.toISOString()}`);
      // Each fork is its own sandbox: a write in one is not in the others.
      await f.files.write('/root/mine.txt', f.sandboxId);
    }
    assert.equal(ids.size, 3);
    assert.equal(await sbx.files.exists('/root/mine.txt'), false);
    await assert.rejects(Sandbox.fork('no-such-sandbox'), SandboxNotFoundError);
  });

  // A command that ends leaves its supervisor (a session leader) and part of its session as zombies until the
  // init reaps them, about a second later. A fork then restores those zombies under helpers that stand in for the
  // dead leader, and the init waits for them to be reparented to it. Unpatched CRIU 4.1.1 waited for that by waiting
  // for a count that never changes once every other task is done: the restore hung at each try, and the fork failed
  // (about one round in two here; scripts/criu/criu-4.1.1-zombie-reparent.patch).
  it('fork right after a command is killed, three rounds: every fork restores', async (t) => {
    if (guard(t)) return;
    // A sandbox of its own with nothing else running: the init is then the last task to finish the stage.
    const lone = await Sandbox.create({ requestTimeoutMs: 180_000 });
    made.push(lone);
    let zombies = 0;
    for (let round = 0; round < 3; round++) {
      const seen: string[] = [];
      const bg = await lone.commands.run(TICKER, { background: true, timeoutMs: 0, onStdout: (d) => void seen.push(d) });
      await until('ticks', () => seen.join('').includes('tick 2'));
      assert.equal(await lone.commands.kill(bg.pid), true);
      const states = await lone.commands.run('cut -d" " -f3 /proc/[0-9]*/stat 2>/dev/null; true');
      zombies += states.stdout.split('\n').filter((s) => s === 'Z').length;
      const forks = await lone.fork({ count: 2, timeoutMs: 60_000, requestTimeoutMs: 120_000 });
      for (const f of forks) if (f instanceof Sandbox) made.push(f);
      for (const f of forks) {
        assert.ok(f instanceof Sandbox, `round ${round}: ${f instanceof Error ? f.message : 'not a sandbox'}`);
        assert.equal((await f.commands.run('echo up')).stdout, 'up\n');
        await f.kill();
      }
    }
    // Whether a round caught zombies depends on when the init last reaped (about once a second); most do.
    t.diagnostic(`zombies in the sandbox right before the three forks: ${zombies}`);
  });

  it('agent restart: durable processes re-listed, connect and kill work, an exit nobody watched keeps its code', async (t) => {
    if (guard(t)) return;
    const seen: string[] = [];
    const ticker = await sbx.commands.run(TICKER, { background: true, timeoutMs: 0, onStdout: (d) => void seen.push(d) });
    const quitter = await sbx.commands.run('sleep 2; echo bye; exit 7', { background: true, timeoutMs: 0 });
    await until('ticks before the restart', () => seen.join('').includes('tick 3'));
    await ticker.disconnect();
    await quitter.disconnect();
    // A directory left from an earlier boot whose supervisor's pid is now another process's (here the init's).
    await sbx.commands.run(
      'mkdir -p /run/fleet-envd/p.phantom1 && cd /run/fleet-envd/p.phantom1 && echo "4242 1" >pid && ' +
        `printf '%s' '{"cmd":"/bin/bash","args":["-c","phantom"],"envs":{}}' >meta`,
    );
    // SIGKILL, as a crash; the quitter ends while no agent runs. Back on the same port: the host's URL is unchanged.
    const old = agent;
    await old.kill();
    await new Promise((r) => setTimeout(r, 3_000));
    agent = await startAgent({ ...old.opts, token: old.token, env: { ...old.opts.env, AGENT_PORT: String(old.port) } }, 60_000);
    fleet!.agents[fleet!.agents.indexOf(old)] = agent;
    const procs = await until('the envd answers again', () => sbx.commands.list().catch(() => undefined), 30_000);
    assert.ok(
      procs.some((p) => p.pid === ticker.pid),
      `the ticker ${ticker.pid} is listed again: ${JSON.stringify(procs)}`,
    );
    assert.ok(!procs.some((p) => p.pid === quitter.pid), 'an ended process is not listed as running');
    assert.ok(!procs.some((p) => p.pid === 4242), `no phantom from a stale directory: ${JSON.stringify(procs)}`);
    await until('the stale directory removed', async () => !(await sbx.files.exists('/run/fleet-envd/p.phantom1')));
    const ended = await sbx.commands.connect(quitter.pid);
    const err = await ended.wait().catch((e: unknown) => e);
    assert.ok(err instanceof CommandExitError, String(err));
    assert.equal(err.exitCode, 7);
    await assert.rejects(sbx.commands.connect(quitter.pid), 'told once, then gone');

    const after: string[] = [];
    const again = await sbx.commands.connect(ticker.pid, { timeoutMs: 0, onStdout: (d) => void after.push(d) });
    await until('ticks after the restart', () => after.join('').split('\n').filter(Boolean).length >= 3);
    assert.ok(ticksOf(after)[0]! > ticksOf(seen).at(-1)!, 'goes on after what was delivered');
    assert.equal(await sbx.commands.kill(ticker.pid), true);
    await assert.rejects(again.wait());
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === ticker.pid));
  });
  it('move (live migrate): the target lists the durable process under the same pid; connect and kill work there', async (t) => {
    if (guard(t)) return;
    const seen: string[] = [];
    const bg = await sbx.commands.run(TICKER, { background: true, timeoutMs: 0, onStdout: (d) => void seen.push(d) });
    await until('ticks before the move', () => seen.join('').includes('tick 3'));
    await bg.disconnect();
    const target = await startCheckedAgent(fleet!);
    if ('skip' in target) return t.skip(target.skip);
    assert.equal((await registerHost(cp!, 'h2', target, { capacity_overrides: { cpus: 16 } })).status, 201);
    const moved = await cp!.request('POST', `/v1/vms/${sbx.sandboxId}/migrate`, { as: 'acme', body: { live: true, target_host_id: 'h2' } });
    assert.ok(moved.status < 300, JSON.stringify(moved.body));
    await settles(sbx.sandboxId, (v) => assert.equal((v as unknown as { host_id: string }).host_id, 'h2'));
    assert.ok((await target.client.listVms('')).length > 0, 'the sandbox runs on the target');
    const procs = await until('the envd answers on the target', () => sbx.commands.list().catch(() => undefined), 30_000);
    assert.ok(
      procs.some((p) => p.pid === bg.pid),
      `the ticker ${bg.pid} is listed on the target: ${JSON.stringify(procs)}`,
    );
    const after: string[] = [];
    const again = await sbx.commands.connect(bg.pid, { timeoutMs: 0, onStdout: (d) => void after.push(d) });
    await until('ticks after the move', () => after.join('').split('\n').filter(Boolean).length >= 3);
    assert.ok(ticksOf(after)[0]! > ticksOf(seen).at(-1)!, 'goes on after what was delivered');
    assert.equal(await sbx.commands.kill(bg.pid), true);
    await assert.rejects(again.wait());
  });
});
