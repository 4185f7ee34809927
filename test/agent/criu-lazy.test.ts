import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import WebSocket from 'ws';
import { ballastScript, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from './harness.js';

/**
 * Lazy (post-copy) moves between two real agents: the target runs the
 * sandbox before its memory is there and pages it in from the source's
 * pinned capture, through the source agent's grant-authenticated websocket.
 * Needs the CRIU scripts/criu/build.sh builds (its /dev/userfaultfd patch:
 * the sysctl vm.unprivileged_userfaultfd stays 0); under CI=true a host
 * without lazy pages fails instead of skipping.
 */

const criu = process.env.CRIU_PATH;
const skip =
  process.platform !== 'linux' || process.getuid?.() !== 0
    ? 'Linux and root'
    : !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0
      ? 'a working CRIU at CRIU_PATH (scripts/criu/build.sh prints one)'
      : undefined;
if (skip && process.env.CI === 'true') test('CRIU is available in CI', () => assert.fail(`missing: ${skip}`));

/** A counter, and 48 MiB of resident memory for the pages to move. */
const STARTUP =
  'echo 0 > /tmp/count; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 & ' +
  `${ballastScript(50)} echo started`;

interface MemoryStatus {
  resident_chunks: number;
  total_chunks: number;
  done: boolean;
  error?: string;
}

// eslint-disable-next-line @typescript-eslint/no-unnecessary-type-parameters -- the caller names the shape of the answer
async function call<T>(agent: RunningAgent, method: string, path: string, body?: unknown): Promise<{ status: number; body: T }> {
  const res = await fetch(`${agent.url}${path}`, {
    method,
    headers: { authorization: `Bearer ${agent.token}`, ...(body !== undefined ? { 'content-type': 'application/json' } : {}) },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
    signal: AbortSignal.timeout(120_000),
  });
  return { status: res.status, body: (await res.json()) as T };
}

async function waitFor<T>(what: string, fn: () => Promise<T | undefined>, ms = 60_000): Promise<T> {
  const until = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v !== undefined) return v;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** The upgrade answer of the page route for a grant (101 when it lets the socket through). */
function upgradeStatus(agent: RunningAgent, id: string, grant: string): Promise<number> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${agent.url.replace(/^http/, 'ws')}/v1/artifacts/${id}/pages`, {
      headers: { authorization: `Bearer ${grant}` },
    });
    ws.once('unexpected-response', (_req, res) => {
      resolve(res.statusCode ?? 0);
      ws.terminate();
    });
    ws.once('open', () => {
      resolve(101);
      ws.terminate();
    });
    ws.once('error', (err) => {
      if (!/Unexpected server response/.test(err.message)) reject(err);
    });
  });
}

describe('criu lazy moves between agents', { skip: skip ? `missing: ${skip}` : false, timeout: 300_000 }, () => {
  let root: string;
  let a: RunningAgent;
  let b: RunningAgent;
  const agents: RunningAgent[] = [];

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'criu-lazy-'));
    const images = await prepareImages();
    if ('skip' in images) throw new Error(images.skip);
    const start = async (): Promise<RunningAgent> => {
      const agent = await startAgent({
        dataDir: await mkdtemp(join(root, 'data-')),
        imageDir: images.imageDir,
        subnet: uniqueSubnet(),
        bridgePrefix: uniquePrefix(),
        env: { CRIU_PATH: criu! },
      });
      agents.push(agent);
      return agent;
    };
    [a, b] = await Promise.all([start(), start()]);
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

  async function lazyPause(name: string, id: string): Promise<{ digest: string; files: Record<string, string>; grant: string }> {
    await a.client.createVm({ name, ram_mb: 256, storage_gb: 1 });
    assert.equal((await a.client.exec(name, { argv: ['/bin/sh', '-c', STARTUP] })).stdout.trim(), 'started');
    await waitFor('the ballast', async () =>
      (await a.client.exec(name, { argv: ['test', '-e', '/tmp/ballast'] })).exit_code === 0 ? true : undefined,
    );
    await new Promise((r) => setTimeout(r, 300));
    const paused = await call<{ vm: { state: string }; checkpoint: { digest: string; files: Record<string, string>; kind: string } }>(
      a,
      'POST',
      `/v1/vms/${name}/lazy-pause`,
      { id },
    );
    assert.equal(paused.status, 200, JSON.stringify(paused.body));
    assert.equal(paused.body.vm.state, 'paused');
    assert.equal(paused.body.checkpoint.kind, 'live');
    const grant = await a.client.grantArtifact(id, 60);
    await b.client.pullArtifact({
      snapshot_id: id,
      digest: paused.body.checkpoint.digest,
      files: paused.body.checkpoint.files,
      from: { url: a.url, grant: grant.grant },
    });
    return { ...paused.body.checkpoint, grant: grant.grant };
  }

  test('both hosts say they can restore lazily (vm.unprivileged_userfaultfd stays 0)', async () => {
    assert.equal((await a.client.capacity()).lazy_pages, true);
    assert.equal(spawnSync('sysctl', ['-n', 'vm.unprivileged_userfaultfd'], { encoding: 'utf8' }).stdout.trim(), '0');
  });

  test('lazy move: the counter keeps counting on the target, memory reaches done, the source releases its pages', async () => {
    const cp = await lazyPause('lz', 'lz-lazy');
    assert.equal((await call<{ pinned: boolean }>(a, 'GET', '/v1/checkpoints/lz-lazy/pages')).body.pinned, true);
    // Only the granted snapshot's pages: another snapshot's grant, or none, is refused before any upgrade.
    const other = await a.client.createVm({ name: 'other', ram_mb: 64 }).then(() => a.client.checkpoint('other', { id: 'other-cp' }));
    assert.equal(await upgradeStatus(a, 'lz-lazy', (await a.client.grantArtifact(other.id, 60)).grant), 403);
    assert.equal(await upgradeStatus(a, 'lz-lazy', 'x.y'), 403);
    assert.equal((await call<{ streaming: boolean }>(a, 'GET', '/v1/checkpoints/lz-lazy/pages')).body.streaming, false);

    const t0 = performance.now();
    const created = await call<{ state: string }>(b, 'POST', '/v1/vms/lazy', {
      name: 'lz',
      checkpoint_id: 'lz-lazy',
      ram_mb: 256,
      storage_gb: 1,
      from: { url: a.url, grant: cp.grant },
    });
    const runningMs = performance.now() - t0;
    assert.equal(created.status, 201, JSON.stringify(created.body));
    assert.equal(created.body.state, 'running');
    const first = Number((await b.client.exec('lz', { argv: ['cat', '/tmp/count'] })).stdout);
    const status = await waitFor('memory done', async () => {
      const s = (await call<MemoryStatus>(b, 'GET', '/v1/vms/lz/memory')).body;
      assert.equal(s.error, undefined);
      return s.done ? s : undefined;
    });
    assert.ok(status.total_chunks > 10_000, `48 MiB and more came over lazily: ${status.total_chunks} pages`);
    assert.equal(status.resident_chunks, status.total_chunks);
    await new Promise((r) => setTimeout(r, 300));
    const later = Number((await b.client.exec('lz', { argv: ['cat', '/tmp/count'] })).stdout);
    assert.ok(first > 0 && later > first, `the counter continues on the target: ${first} -> ${later}`);
    await waitFor('source released', async () =>
      (await call<{ pinned: boolean }>(a, 'GET', '/v1/checkpoints/lz-lazy/pages')).body.pinned ? undefined : true,
    );
    console.log(`lazy move: running on the target after ${Math.round(runningMs)} ms; ${status.total_chunks} pages paged in`);
  });

  test('the source lost before done: the target VM is lost cleanly, with the error in its memory status', async () => {
    const cp = await lazyPause('gone', 'gone-lazy');
    const released = await call<{ released: boolean }>(a, 'DELETE', '/v1/checkpoints/gone-lazy/pages');
    assert.equal(released.body.released, true);
    const created = await call<{ state?: string; code?: string }>(b, 'POST', '/v1/vms/lazy', {
      name: 'gone',
      checkpoint_id: 'gone-lazy',
      ram_mb: 256,
      storage_gb: 1,
      from: { url: a.url, grant: cp.grant },
    });
    if (created.status === 201) {
      const s = await waitFor('memory error', async () => {
        const st = (await call<MemoryStatus>(b, 'GET', '/v1/vms/gone/memory')).body;
        return st.error !== undefined ? st : undefined;
      });
      assert.equal(s.done, false);
      const vm = await waitFor('vm stopped', async () => {
        const v = await b.client.getVm('gone');
        return v.state === 'running' ? undefined : v;
      });
      assert.notEqual(vm.state, 'running');
    } else {
      assert.ok(created.status >= 400 && created.status < 600 && created.body.code, JSON.stringify(created.body));
      assert.equal((await b.client.listVms()).filter((v) => v.name === 'gone').length, 0, 'nothing half-made is left');
    }
  });
});
