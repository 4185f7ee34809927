import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { buildImage } from '../../packages/agent/src/images.js';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import { featureSkip, missingPrerequisite, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from './harness.js';

/**
 * The agent's sandbox monitor against real sandboxes: OOM kills in a
 * 128 MiB sandbox (a command killed, the sandbox living on; then the init
 * itself), resource samples under load, and the console log served from an
 * offset, kept after the destroy.
 */

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function until<T>(what: string, fn: () => Promise<T | undefined>, ms = 20_000): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v !== undefined) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(150);
  }
}

describe('agent observability (real agent, real sandboxes)', { timeout: 240_000 }, () => {
  let skip: string | undefined;
  let agent: RunningAgent | undefined;
  const dirs: string[] = [];
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    skip = await missingPrerequisite();
    if (skip) return;
    const images = await prepareImages();
    if ('skip' in images) {
      skip = images.skip;
      return;
    }
    dirs.push(images.imageDir);
    // Images whose init is a memory hog / exits at once (after a second: the sandbox is up first).
    for (const [name, tail] of [
      ['hoginit', 'exec dd if=/dev/zero of=/dev/null bs=200M count=1'],
      ['exitinit', 'exit 3'],
      // Exits 7 when the host sends it SIGUSR1 (a pid 1 gets the signals it has a handler for).
      ['codeinit', "trap 'exit 7' USR1; while :; do usleep 50000; done"],
    ] as const) {
      await buildImage(images.imageDir, name);
      const init = join(images.imageDir, name, 'sbin', 'init');
      await rm(init, { force: true });
      await writeFile(init, `#!/bin/sh\necho init-start\nsleep 1\n${tail}\n`, { mode: 0o755 });
    }
    const dataDir = await mkdtemp(join(tmpdir(), 'obs-agent-'));
    dirs.push(dataDir);
    try {
      agent = await startAgent({
        dataDir,
        imageDir: images.imageDir,
        subnet: uniqueSubnet(),
        bridgePrefix: uniquePrefix(),
        env: { AGENT_METRICS_INTERVAL_MS: '250', AGENT_OOM_POLL_MS: '200', AGENT_CONSOLE_LOG_MAX_BYTES: '65536' },
      });
      await agent.client.createVm({ name: 'hog', image: 'base', ram_mb: 128 });
    } catch (err) {
      skip = featureSkip(err);
      if (!skip) throw err;
    }
  });

  after(async () => {
    if (agent) {
      // One failed destroy does not leave the others behind: each is tried, then prune sweeps what is left.
      const cleanup = async (what: string, fn: () => Promise<unknown>): Promise<void> => {
        try {
          await fn();
        } catch (err) {
          process.stderr.write(`cleanup (${what}) failed: ${String(err)}\n${agent!.output().slice(-4000)}\n`);
        }
      };
      for (const vm of await agent.client.listVms('', { timeoutMs: 10_000 }).catch(() => []))
        await cleanup(vm.name, () => agent!.client.destroyVm(vm.name, { force: true, timeoutMs: 20_000 }));
      await cleanup('prune', () => agent!.client.prune({ timeoutMs: 20_000 }));
      await agent.stop();
      await agent.cleanupHost();
    }
    for (const d of dirs) await rm(d, { recursive: true, force: true }).catch(() => {});
  });

  it('an exec that outgrows the memory limit answers oom_killed, and the kill is reported naming it; the sandbox lives on', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    const r = await c.exec('hog', { argv: ['dd', 'if=/dev/zero', 'of=/dev/null', 'bs=200M', 'count=1'] });
    assert.equal(r.oom_killed, true, JSON.stringify(r));
    assert.equal(r.signal, 'SIGKILL');
    const oom = await until('the OOM report', async () => {
      const info = await c.getVm('hog');
      return info.oom && info.oom.events.length > 0 ? info.oom : undefined;
    });
    assert.ok(oom.kills >= 1);
    assert.equal(oom.limit_mb, 128);
    assert.equal(oom.events.at(-1)!.process, 'dd');
    assert.equal(oom.init_oom_killed, false);
    const plain = await c.exec('hog', { argv: ['sh', '-c', 'kill -9 $$'] });
    assert.equal(plain.signal, 'SIGKILL');
    assert.equal(plain.oom_killed, undefined, 'a SIGKILL without an OOM kill is not called one');
    assert.equal((await c.getVm('hog')).state, 'running');
  });

  it('metrics show CPU rising under a busy loop and memory under an allocation', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    const first = await until('a sample', async () => (await c.metrics('hog')).samples.at(-1));
    await c.exec('hog', { argv: ['timeout', '2', 'sh', '-c', 'while :; do :; done'] });
    const after = Date.now();
    const busy = await until('a sample after the loop', async () => (await c.metrics('hog', after)).samples.at(-1), 5000);
    assert.ok(first.cpu_usec !== null && busy.cpu_usec !== null, 'CPU accounting is there');
    assert.ok(busy.cpu_usec - first.cpu_usec > 250_000, `cpu went from ${first.cpu_usec} to ${busy.cpu_usec} us`);
    // (A shared 2-core machine gives the loop a fraction of its 2 s: a quarter second of CPU is plenty to tell.)
    // 64 MiB held by dd while its reader sleeps.
    await c.exec('hog', { argv: ['sh', '-c', '(dd if=/dev/zero bs=64M count=1 2>/dev/null | sleep 4) >/dev/null 2>&1 & sleep 1'] });
    const held = await until('a sample with the allocation', async () => {
      const s = (await c.metrics('hog')).samples.at(-1);
      return s && s.memory_bytes > first.memory_bytes + 50 * 1024 * 1024 ? s : undefined;
    });
    assert.ok(held.memory_peak_bytes !== null && held.memory_peak_bytes >= held.memory_bytes);
    assert.ok(held.pids >= 2);
    const host = await c.hostMetrics();
    assert.equal(host.sandboxes, 1);
    assert.ok(host.oom_kills_total >= 1);
  });

  it('the console log is served from an offset, follows new lines, and outlives the destroy for the retention', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    await c.createVm({ name: 'talk', image: 'base' });
    const start = await c.logs('talk', { offset: 0 });
    // Written from outside the init's tree (an exec): the console is open to the sandbox's root through /proc/1/fd/1.
    await c.exec('talk', { argv: ['sh', '-c', 'echo written-later > /proc/1/fd/1'] });
    const next = await until('the new line', async () => {
      const r = await c.logs('talk', { offset: start.next_offset });
      return /written-later/.test(Buffer.from(r.data, 'base64').toString()) ? r : undefined;
    });
    assert.equal(next.ended, false);
    await c.destroyVm('talk', { force: true });
    const kept = await c.logs('talk', { offset: 0 });
    assert.equal(kept.ended, true);
    assert.match(Buffer.from(kept.data, 'base64').toString(), /written-later/);
  });

  it('an init that outgrows the limit dies of it, and is reported as OOM-killed', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    await c.createVm({ name: 'inithog', image: 'hoginit', ram_mb: 128 });
    const oom = await until('the init OOM', async () => {
      const info = (await c.listVms('inithog')).find((v) => v.name === 'inithog');
      return info?.oom?.init_oom_killed ? info : undefined;
    });
    assert.equal(oom.state, 'stopped');
    assert.equal(oom.oom!.events.at(-1)!.pid, 1);
    assert.ok(oom.oom!.kills >= 1);
    assert.deepEqual(oom.init_exit, { exit_signal: 'SIGKILL' });
  });

  it('a sandbox whose init exits on its own is not called OOM-killed', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    await c.createVm({ name: 'initexit', image: 'exitinit', ram_mb: 128 });
    await until('the init to exit', async () => ((await c.getVm('initexit')).state === 'stopped' ? true : undefined));
    await sleep(600);
    const info = await c.getVm('initexit');
    assert.equal(info.oom?.init_oom_killed ?? false, false);
    assert.equal(info.oom?.kills ?? 0, 0);
    assert.deepEqual(info.init_exit, { exit_code: 3 });
    assert.deepEqual((await c.listVms('initexit'))[0]!.init_exit, { exit_code: 3 });
  });

  it('how an init ended is recorded by its parent: an exit while the agent was down, and a signal death', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    await c.createVm({ name: 'codea', image: 'codeinit' });
    await c.createVm({ name: 'codeb', image: 'codeinit' });
    const initPid = async (name: string): Promise<number> =>
      (JSON.parse(await readFile(join(agent!.opts.dataDir, 'sandboxes', name, 'state.json'), 'utf8')) as { init_pid: number }).init_pid;
    const a = { init_pid: await initPid('codea') };
    const b = { init_pid: await initPid('codeb') };
    assert.equal((await c.getVm('codea')).init_exit, undefined, 'a running sandbox has no exit');
    // The agent crashes; the init ends while no agent runs; a new agent on the same data directory still knows how.
    await agent!.kill();
    // Again until it ends: its trap is set a second after its start.
    await until('the init to exit', () => {
      if (!existsSync(`/proc/${a.init_pid}`)) return Promise.resolve(true);
      process.kill(a.init_pid, 'SIGUSR1');
      return Promise.resolve(undefined);
    });
    agent = await startAgent(agent!.opts);
    const ended = await until('the listing of the ended sandbox', async () => {
      const info = (await agent!.client.listVms('code')).find((v) => v.name === 'codea');
      return info?.state === 'stopped' ? info : undefined;
    });
    assert.deepEqual(ended.init_exit, { exit_code: 7 });
    // Killed from outside (a signal, not an exit code): told apart from `exit 137`.
    process.kill(b.init_pid, 'SIGKILL');
    const killed = await until('the killed init', async () => {
      const info = await agent!.client.getVm('codeb');
      return info.state === 'stopped' ? info : undefined;
    });
    assert.deepEqual(killed.init_exit, { exit_signal: 'SIGKILL' });
    assert.equal(killed.oom?.init_oom_killed ?? false, false);
  });
});
