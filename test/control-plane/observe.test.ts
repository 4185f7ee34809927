import assert from 'node:assert/strict';
import { readFile, rm, writeFile } from 'node:fs/promises';
import { request as httpRequest } from 'node:http';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import { buildImage } from '../../packages/agent/src/images.js';
import type { RunningAgent } from '../agent/harness.js';
import {
  eventually,
  keyOf,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
} from '../support/control-plane.js';

/**
 * Observability through the API, against a real agent and real sandboxes:
 * OOM kills become VmOomKilled events (the VM living on), an init killed by
 * one ends its VM with reason `oom` (exit_signal SIGKILL), an init that
 * exits 3 ends it `exited` with exit code 3, one killed by a signal with
 * exit_signal; metrics and the console log (startup
 * script output, a followed line written later) are the VM tenant's only.
 */

describe('observability through the API (real agent, real sandboxes)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    const started = await startCheckedFleet(0);
    ({ fleet, skip } = started);
    if (skip || !fleet) return;
    agent = await fleet.start({ env: { AGENT_METRICS_INTERVAL_MS: '250', AGENT_OOM_POLL_MS: '200' } });
    // An image whose init outgrows any small limit a second after it started.
    await buildImage(agent.opts.imageDir, 'obshog');
    const init = join(agent.opts.imageDir, 'obshog', 'sbin', 'init');
    await rm(init, { force: true });
    await writeFile(init, '#!/bin/sh\nsleep 1\nexec dd if=/dev/zero of=/dev/null bs=300M count=1\n', { mode: 0o755 });
    // An init that runs `exit 3` when it gets SIGUSR1 (a pid 1 gets the signals it has a handler for).
    await buildImage(agent.opts.imageDir, 'obsexit');
    const exitInit = join(agent.opts.imageDir, 'obsexit', 'sbin', 'init');
    await rm(exitInit, { force: true });
    await writeFile(exitInit, "#!/bin/sh\ntrap 'exit 3' USR1\nwhile :; do usleep 50000; done\n", { mode: 0o755 });
    cp = await startControlPlane({ env: { SSE_MAX_PER_TENANT: '1' } });
    const r = await registerHost(cp, 'ho', agent, { capacity_overrides: { cpus: 8 } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    await cp.service.runner.waitFor(r.body.position, 20_000);
  });

  after(async () => {
    await cp?.close();
    await fleet?.close();
  });

  async function create(body: Record<string, unknown>): Promise<string> {
    const r = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { cpus: 1, ram_mb: 128, ...body } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    return r.body.id as string;
  }

  async function events(vmId: string): Promise<Array<{ type: string; data: Record<string, unknown> }>> {
    return (await cp!.service.store.readStream(`vm-${vmId}`)) as never;
  }

  it('a command killed by the OOM killer answers oom_killed and becomes a VmOomKilled event; the VM keeps running', async (t) => {
    if (guard(t)) return;
    const id = await create({});
    const r = await cp!.request('POST', `/v1/vms/${id}/exec`, {
      as: 'acme',
      body: { argv: ['dd', 'if=/dev/zero', 'of=/dev/null', 'bs=200M', 'count=1'] },
    });
    assert.equal(r.status, 200, JSON.stringify(r.body));
    assert.equal(r.body.oom_killed, true);
    await eventually(
      async () => (await cp!.service.reconciler.reconcileOnce(), (await events(id)).some((e) => e.type === 'VmOomKilled')),
      20_000,
      'VmOomKilled',
    );
    const oom = (await events(id)).find((e) => e.type === 'VmOomKilled')!;
    assert.equal(oom.data.process, 'dd');
    assert.equal(oom.data.limit_mb, 128);
    assert.equal(oom.data.count, 1);
    // Reported again by the next cycle: recorded once.
    await cp!.service.reconciler.reconcileOnce();
    assert.equal((await events(id)).filter((e) => e.type === 'VmOomKilled').length, 1);
    assert.equal((await cp!.request('GET', `/v1/vms/${id}`, { as: 'acme' })).body.state, 'running');
  });

  it('a VM whose init dies of an OOM kill ends with reason oom', async (t) => {
    if (guard(t)) return;
    const id = await create({ image: 'obshog' });
    await eventually(
      async () => {
        await cp!.service.reconciler.reconcileOnce();
        const vm = await cp!.service.vms.get(id, { tenantId: 'acme', admin: false });
        return vm.status === 'failed' ? vm : undefined;
      },
      30_000,
      'the VM to end',
    );
    // An init that died is a failure of the VM (the stopped-sandbox verdict), with reason oom rather than exited.
    const evs = await events(id);
    const ended = evs.find((e) => e.type === 'VmFailed')!;
    assert.equal(ended.data.reason, 'oom');
    assert.equal(ended.data.error_code, 'OOM_KILLED');
    const kill = evs.find((e) => e.type === 'VmOomKilled')!;
    assert.equal(kill.data.pid, 1);
    const row = await eventually(async () => {
      const r = await cp!.request('GET', `/v1/vms/${id}`, { as: 'acme' });
      return r.body.state === 'failed' ? r.body : undefined;
    });
    assert.equal(row.reason, 'oom');
    assert.deepEqual([ended.data.exit_signal, row.exit_signal, row.exit_code], ['SIGKILL', 'SIGKILL', null]);
  });

  it('an init that runs `exit 3` ends its VM `exited` with exit code 3; one killed by a signal, with exit_signal', async (t) => {
    if (guard(t)) return;
    const [three, killed] = [await create({ image: 'obsexit' }), await create({ image: 'obsexit' })];
    await cp!.request('POST', `/v1/vms/${three}/exec`, { as: 'acme', body: { argv: ['kill', '-USR1', '1'] } });
    const state = JSON.parse(await readFile(join(agent.opts.dataDir, 'sandboxes', `fl-${killed}`, 'state.json'), 'utf8')) as {
      init_pid: number;
    };
    process.kill(state.init_pid, 'SIGKILL');
    for (const id of [three, killed])
      await eventually(
        async () => {
          await cp!.service.reconciler.reconcileOnce();
          return (await cp!.service.vms.get(id, { tenantId: 'acme', admin: false })).status === 'failed';
        },
        30_000,
        'the VM to end',
      );
    const head = await cp!.service.store.headPosition();
    if (head) await cp!.service.runner.waitFor(head, 15_000);
    const expected = { [three]: { exit_code: 3, exit_signal: null }, [killed]: { exit_code: null, exit_signal: 'SIGKILL' } };
    for (const [id, want] of Object.entries(expected)) {
      const ended = (await events(id)).find((e) => e.type === 'VmFailed')!;
      assert.deepEqual(
        [ended.data.reason, ended.data.error_code, ended.data.exit_code ?? null, ended.data.exit_signal ?? null],
        ['exited', 'SANDBOX_EXITED', want.exit_code, want.exit_signal],
      );
      const got = (await cp!.request('GET', `/v1/vms/${id}`, { as: 'acme' })).body;
      assert.deepEqual([got.state, got.reason, got.exit_code, got.exit_signal], ['failed', 'exited', want.exit_code, want.exit_signal]);
      const feed = (await cp!.request('GET', `/v1/vm-events?vm_id=${id}&type=vm.failed`, { as: 'acme' })).body.events;
      assert.deepEqual(
        [feed.at(-1).reason, feed.at(-1).exit_code ?? null, feed.at(-1).exit_signal ?? null],
        ['exited', want.exit_code, want.exit_signal],
      );
    }
    assert.match(String((await cp!.request('GET', `/v1/vms/${three}`, { as: 'acme' })).body.error), /exit code 3/);
    const from = new Date(Date.now() - 3_600_000).toISOString();
    const runs = (await cp!.request('GET', `/v1/usage/vms?from=${from}&reason=exited`, { as: 'acme' })).body.vms as Array<{
      vm_id: string;
      exit_code: number | null;
      exit_signal: string | null;
    }>;
    for (const [id, want] of Object.entries(expected)) {
      const run = runs.find((r) => r.vm_id === id);
      assert.deepEqual([run?.exit_code, run?.exit_signal], [want.exit_code, want.exit_signal], `billing row of ${id}`);
    }
  });

  it('metrics show CPU rising under a busy loop and memory under an allocation, for the tenant only', async (t) => {
    if (guard(t)) return;
    const id = await create({});
    const get = async (since = 0) => {
      const r = await cp!.request('GET', `/v1/vms/${id}/metrics?since=${since}`, { as: 'acme' });
      assert.equal(r.status, 200, JSON.stringify(r.body));
      return r.body as { samples: Array<{ t: number; cpu_usec: number; memory_bytes: number }> };
    };
    const first = await eventually(async () => (await get()).samples.at(-1), 10_000, 'a sample');
    await cp!.request('POST', `/v1/vms/${id}/exec`, { as: 'acme', body: { argv: ['timeout', '2', 'sh', '-c', 'while :; do :; done'] } });
    const mark = Date.now();
    const busy = await eventually(async () => (await get(mark)).samples.at(-1), 10_000, 'a sample after the loop');
    assert.ok(busy.cpu_usec - first.cpu_usec > 250_000, `cpu went from ${first.cpu_usec} to ${busy.cpu_usec}`);
    await cp!.request('POST', `/v1/vms/${id}/exec`, {
      as: 'acme',
      body: { argv: ['sh', '-c', '(dd if=/dev/zero bs=64M count=1 2>/dev/null | sleep 4) >/dev/null 2>&1 & sleep 1'] },
    });
    await eventually(
      async () => (await get()).samples.some((s) => s.memory_bytes > first.memory_bytes + 50 * 1024 * 1024),
      10_000,
      'memory to rise',
    );
    const other = await cp!.request('GET', `/v1/vms/${id}/metrics`, { as: 'globex' });
    assert.equal(other.status, 404);
    assert.equal(other.body.code, 'VM_NOT_FOUND');
    const bad = await cp!.request('GET', `/v1/vms/${id}/metrics?since=yesterday`, { as: 'acme' });
    assert.equal(bad.status, 400);
    const prom = await cp!.request('GET', '/metrics', { as: 'none' });
    assert.match(String(prom.body), /fleet_host_sandbox_memory_bytes\{host_id="ho"\} \d+/);
    assert.doesNotMatch(String(prom.body), new RegExp(id), 'no series per VM');
  });

  it('logs show the startup script output; follow streams a line written later, then ends when the VM is gone', async (t) => {
    if (guard(t)) return;
    const id = await create({ startup_script: 'echo hello-from-startup' });
    const text = await cp!.request('GET', `/v1/vms/${id}/logs`, { as: 'acme' });
    assert.equal(text.status, 200);
    assert.match(String(text.body), /hello-from-startup/);
    assert.equal((await cp!.request('GET', `/v1/vms/${id}/logs`, { as: 'globex' })).status, 404);

    const base = await cp!.listen();
    const url = new URL(`/v1/vms/${id}/logs?follow=true&offset=${String(text.headers['fleet-log-next-offset'])}`, base);
    let got = '';
    const done = new Promise<void>((resolve, reject) => {
      const req = httpRequest(url, { headers: { authorization: `Bearer ${keyOf('acme')}` } }, (res) => {
        assert.equal(res.headers['content-type'], 'text/event-stream; charset=utf-8');
        res.setEncoding('utf8');
        res.on('data', (d: string) => (got += d));
        res.on('end', () => resolve());
        res.on('error', reject);
      });
      req.on('error', reject);
      req.end();
    });
    await new Promise((r) => setTimeout(r, 500));
    const second = await cp!.request('GET', `/v1/vms/${id}/logs?follow=true`, { as: 'acme' });
    assert.equal(second.status, 429, 'one follow per caller here (SSE_MAX_PER_TENANT=1)');
    assert.equal(second.body.code, 'TOO_MANY_LOG_STREAMS');
    await cp!.request('POST', `/v1/vms/${id}/exec`, { as: 'acme', body: { argv: ['sh', '-c', 'echo written-later > /proc/1/fd/1'] } });
    await eventually(() => Promise.resolve(got.includes('written-later')), 15_000, 'the followed line');
    assert.match(got, /event: log\ndata: \{"data":"written-later\\n"/);
    assert.doesNotMatch(got, /hello-from-startup/, 'resumed at the offset given');
    assert.equal((await cp!.request('DELETE', `/v1/vms/${id}`, { as: 'acme' })).status, 200);
    await done;
    assert.match(got, /event: end/);
    // Kept after the VM ended, for the agent's retention.
    const kept = await cp!.request('GET', `/v1/vms/${id}/logs`, { as: 'acme' });
    assert.equal(kept.headers['fleet-log-ended'], 'true');
    assert.match(String(kept.body), /written-later/);
  });
});
