import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { appendFile, open, mkdir, mkdtemp, readdir, readFile as readFileText, rm, stat, writeFile } from 'node:fs/promises';
import { createServer, connect, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import WebSocket from 'ws';
import { HostAgentClient } from '../../src/adapters/host-agent.client.js';
import { listLinks } from '../../packages/agent/src/backend/process/network.js';
import type { ServerFrame } from '@fleet/agent-protocol';
import { AppError } from '@fleet/agent-protocol';
import { classifyHostAgentError, type AgentStream } from '../../src/domain/host-agent.port.js';
import {
  featureSkip,
  missingPrerequisite,
  prepareImages,
  startAgent,
  uniquePrefix,
  uniqueSubnet,
  withTimeout,
  type AgentOptions,
  type RunningAgent,
} from './harness.js';

/**
 * Real host-agent processes with the process backend: two agents (A and B)
 * on this machine, each with its own data directory, port, bridge prefix
 * and subnet. Needs root; a missing kernel feature skips with its name.
 * Tests run in order and build on each other (a1 → checkpoint → pull to B).
 */

async function expectCode(p: Promise<unknown>, code: string): Promise<AppError> {
  try {
    await p;
  } catch (err) {
    assert.ok(err instanceof AppError, `expected an AppError ${code}, got ${String(err)}`);
    assert.equal(err.code, code, `expected ${code}, got ${err.code}: ${err.message}`);
    return err;
  }
  assert.fail(`expected ${code}, but the call succeeded`);
}

async function collect(
  stream: AgentStream,
  untilMs = 15_000,
): Promise<{ stdout: string; stderr: string; exit?: Extract<ServerFrame, { type: 'exit' }> }> {
  let stdout = '';
  let stderr = '';
  let exit: Extract<ServerFrame, { type: 'exit' }> | undefined;
  await withTimeout(
    (async () => {
      for await (const f of stream.frames) {
        if (f.type === 'stdout') stdout += Buffer.from(f.data, 'base64').toString();
        if (f.type === 'stderr') stderr += Buffer.from(f.data, 'base64').toString();
        if (f.type === 'exit') exit = f;
      }
    })(),
    untilMs,
    'stream',
  );
  return { stdout, stderr, ...(exit ? { exit } : {}) };
}

/** Reads stdout frames until `pattern` shows up in the accumulated output. */
async function readUntil(it: AsyncIterator<ServerFrame>, pattern: RegExp, ms = 10_000): Promise<string> {
  let acc = '';
  return withTimeout(
    (async () => {
      for (;;) {
        const r = await it.next();
        if (r.done) throw new Error(`stream ended before ${pattern}; got ${JSON.stringify(acc)}`);
        if (r.value.type === 'stdout' || r.value.type === 'stderr') acc += Buffer.from(r.value.data, 'base64').toString();
        if (pattern.test(acc)) return acc;
      }
    })(),
    ms,
    `waiting for ${pattern}`,
  );
}

// These tests pin a host without memory checkpoints (test/agent/criu*.test.ts cover CRIU): a live request is filed as disk.
process.env.CRIU_PATH = 'off';

describe('host agent (real processes, process backend)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let imageDir = '';
  const dirs: string[] = [];
  let a: RunningAgent | undefined;
  let b: RunningAgent | undefined;
  let aOpts: AgentOptions;
  const proxies: Server[] = [];
  const state: { cpId?: string; cpDigest?: string; bigCpId?: string; bigDigest?: string } = {};

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
    imageDir = images.imageDir;
    dirs.push(imageDir);
    const mk = async (): Promise<AgentOptions> => {
      const dataDir = await mkdtemp(join(tmpdir(), 'agent-data-'));
      dirs.push(dataDir);
      return { dataDir, imageDir, subnet: uniqueSubnet(), bridgePrefix: uniquePrefix(), env: { AGENT_OUTPUT_CAP_BYTES: '65536' } };
    };
    aOpts = await mk();
    try {
      a = await startAgent(aOpts);
      b = await startAgent(await mk());
      // The first create tells whether this kernel can run the backend at all.
      await a.client.createVm({ name: 'a1', image: 'base' });
    } catch (err) {
      skip = featureSkip(err);
      if (!skip) throw err;
    }
    if (skip) process.stderr.write(`host-agent tests skipped: ${skip}\n`);
  });

  after(async () => {
    for (const p of proxies) p.close();
    for (const agent of [a, b]) {
      if (!agent || agent.proc.exitCode !== null || agent.proc.signalCode !== null) continue;
      try {
        for (const vm of await agent.client.listVms('', { timeoutMs: 10_000 }))
          await agent.client.destroyVm(vm.name, { force: true, timeoutMs: 20_000 });
        await agent.client.prune({ timeoutMs: 20_000 });
      } catch (err) {
        process.stderr.write(`cleanup of ${agent.url} failed: ${String(err)}\n${agent.output().slice(-4000)}\n`);
      }
      await agent.stop();
      await agent.cleanupHost();
    }
    for (const d of dirs) await rm(d, { recursive: true, force: true }).catch(() => {});
  });

  it('refuses requests without the host token, over the wire', async (t) => {
    if (guard(t)) return;
    const res = await fetch(`${a!.url}/v1/vms`);
    assert.equal(res.status, 401);
    const wrong = new HostAgentClient({ hostId: 'x', url: a!.url, token: 'not-the-token-at-all' });
    const err = await expectCode(wrong.listVms(), 'AGENT_ERROR');
    assert.equal(classifyHostAgentError(err), 'host');
    assert.ok(!err.message.includes('not-the-token-at-all'));
    const wsErr = await expectCode(wrong.execStream('a1', { type: 'start', argv: ['true'] }), 'AGENT_ERROR');
    assert.equal(wsErr.details?.agent_status, 401);
    assert.ok(!a!.output().includes(a!.token), 'the token never reaches a log line');
  });

  it('creates, execs, uploads and downloads through the client', async (t) => {
    if (guard(t)) return;
    const c = a!.client;
    const vm = await c.getVm('a1');
    assert.equal(vm.state, 'running');
    assert.equal(vm.image, 'base');
    assert.ok((await c.listVms('a')).some((v) => v.name === 'a1'));
    assert.deepEqual(await c.listVms('zz'), []);
    const console1 = await c.consoleLog('a1');
    assert.ok(console1.length > 0, 'the init wrote to its serial-style log');
    assert.equal((await c.consoleLog('a1', 5)).length <= 5, true);

    const r = await c.exec('a1', { argv: ['sh', '-c', 'echo hi; echo err >&2; exit 3'] });
    assert.equal(r.exit_code, 3, 'a non-zero exit is a result');
    assert.equal(r.stdout, 'hi\n');
    assert.equal(r.stderr, 'err\n');
    assert.equal(r.timed_out, false);

    const env = await c.exec('a1', { argv: ['sh', '-c', 'echo $FOO; pwd'], env: { FOO: 'bar' }, cwd: '/tmp' });
    assert.equal(env.stdout, 'bar\n/tmp\n');

    const stdin = await c.exec('a1', { argv: ['cat'], stdin: Buffer.from('from stdin').toString('base64') });
    assert.equal(stdin.stdout, 'from stdin');

    const slow = await c.exec('a1', { argv: ['sleep', '10'], timeout_ms: 300 });
    assert.equal(slow.timed_out, true);
    assert.notEqual(slow.exit_code, 0);
    assert.ok(slow.duration_ms < 5000);

    const big = await c.exec('a1', { argv: ['sh', '-c', 'head -c 200000 /dev/zero; echo done >&2'], encoding: 'base64' });
    assert.equal(big.stdout_truncated, true);
    assert.equal(Buffer.from(big.stdout, 'base64').length, 65536);
    assert.equal(big.stderr_truncated, false);
    assert.equal(big.exit_code, 0);

    const data = randomBytes(300_000);
    const up = await c.upload('a1', '/tmp/blob.bin', data, { mode: '600' });
    assert.equal(up.size_bytes, data.length);
    const down = await c.download('a1', '/tmp/blob.bin');
    assert.ok(Buffer.from(down).equals(data));
    const inside = await c.exec('a1', { argv: ['sh', '-c', 'wc -c < /tmp/blob.bin; stat -c %a /tmp/blob.bin'] });
    assert.equal(inside.stdout.replace(/ +/g, ''), `${data.length}\n600\n`);

    // Confinement: ".." above the root and a symlink pointing out are refused.
    await expectCode(c.download('a1', '/../../etc/passwd'), 'PATH_ESCAPES_SANDBOX');
    await c.exec('a1', { argv: ['ln', '-s', '../../../../../../etc', '/tmp/up'] });
    await expectCode(c.download('a1', '/tmp/up/passwd'), 'PATH_ESCAPES_SANDBOX');
    await expectCode(c.upload('a1', '/tmp/up/evil', Buffer.from('x')), 'PATH_ESCAPES_SANDBOX');
    await expectCode(c.download('a1', '/no/such/file'), 'GUEST_PATH_NOT_FOUND');
    await expectCode(c.download('a1', '/tmp'), 'GUEST_PATH_NOT_A_FILE');
  });

  it('maps refusals to typed errors with the right class', async (t) => {
    if (guard(t)) return;
    const c = a!.client;
    const nf = await expectCode(c.exec('nope', { argv: ['true'] }), 'SANDBOX_NOT_FOUND');
    assert.equal(classifyHostAgentError(nf), 'not_found');
    await expectCode(c.getVm('nope'), 'SANDBOX_NOT_FOUND');
    assert.deepEqual(await c.destroyVm('nope'), { name: 'nope', destroyed: false, drained: false });
    const dup = await expectCode(c.createVm({ name: 'a1', image: 'base' }), 'SANDBOX_EXISTS');
    assert.equal(classifyHostAgentError(dup), 'rejected');
    await expectCode(c.createVm({ name: 'x1', image: 'no-such-image' }), 'IMAGE_NOT_FOUND');
    await expectCode(c.createVm({ name: 'x1', checkpoint_id: 'no-such-cp' }), 'CHECKPOINT_NOT_FOUND');
    await expectCode(c.createVm({ name: 'Bad!' }), 'VALIDATION_FAILED');

    const timedOut = await expectCode(c.exec('a1', { argv: ['sleep', '3'] }, { timeoutMs: 200 }), 'HOST_UNREACHABLE');
    assert.equal(classifyHostAgentError(timedOut), 'host');
    const dead = new HostAgentClient({ hostId: 'dead', url: 'http://127.0.0.1:9', token: 'x'.repeat(20), attempts: 2, backoffMs: 10 });
    const down = await expectCode(dead.capacity({ timeoutMs: 2000 }), 'HOST_UNREACHABLE');
    assert.equal(classifyHostAgentError(down), 'host');

    const cap = await c.capacity();
    assert.ok(cap.cpus > 0 && cap.ram_mb > 0 && cap.vm_count > 0);
    assert.equal(cap.backend, 'process');
    assert.match(cap.arch ?? 'amd64', /^[a-z0-9]+$/);
  });

  it('streams an exec over a websocket', async (t) => {
    if (guard(t)) return;
    const s = await a!.client.execStream('a1', { type: 'start', argv: ['sh', '-c', 'read x; echo got:$x; echo oops >&2; exit 4'] });
    s.write('hello\n');
    const r = await collect(s);
    assert.equal(r.stdout, 'got:hello\n');
    assert.equal(r.stderr, 'oops\n');
    assert.equal(r.exit?.code, 4);

    const timed = await a!.client.execStream('a1', { type: 'start', argv: ['sleep', '10'], timeout_ms: 300 });
    const rt = await collect(timed);
    assert.equal(rt.exit?.timed_out, true);

    await expectCode(a!.client.execStream('nope', { type: 'start', argv: ['true'] }), 'SANDBOX_NOT_FOUND');

    // A raw client that sends stdin right behind the start frame, before "started": nothing is lost.
    const raw = new WebSocket(`ws://127.0.0.1:${a!.port}/v1/vms/a1/exec`, { headers: { authorization: `Bearer ${a!.token}` } });
    const frames: ServerFrame[] = [];
    await withTimeout(
      new Promise<void>((resolve, reject) => {
        raw.on('open', () => {
          raw.send(JSON.stringify({ type: 'start', argv: ['cat'] }));
          raw.send(JSON.stringify({ type: 'stdin', data: Buffer.from('early bytes').toString('base64') }));
          raw.send(JSON.stringify({ type: 'eof' }));
        });
        raw.on('message', (d: Buffer) => frames.push(JSON.parse(d.toString()) as ServerFrame));
        raw.on('close', () => resolve());
        raw.on('error', reject);
      }),
      10_000,
      'raw websocket exec',
    );
    const echoed = frames.flatMap((f) => (f.type === 'stdout' ? [Buffer.from(f.data, 'base64').toString()] : [])).join('');
    assert.equal(echoed, 'early bytes');
    assert.deepEqual(frames.at(-1), { type: 'exit', code: 0, timed_out: false });
  });

  it('bounds what a caller can make it hold: a download over max_bytes is refused before it streams, stdin waits for the pipe, early frames are capped', async (t) => {
    if (guard(t)) return;
    const rss = async (): Promise<number> =>
      Number(/VmRSS:\s+(\d+) kB/.exec(await readFileText(`/proc/${a!.proc.pid}/status`, 'utf8'))![1]) * 1024;
    await a!.client.exec('a1', { argv: ['truncate', '-s', '100G', '/tmp/huge'] });
    const before = await rss();
    try {
      const refused = await expectCode(a!.client.openDownload('a1', '/tmp/huge', { maxBytes: 1024 ** 3 }), 'FILE_TOO_LARGE');
      assert.equal(refused.status, 413);
      await expectCode(a!.client.download('a1', '/tmp/huge'), 'FILE_TOO_LARGE');
      const ps = await a!.client.exec('a1', { argv: ['sh', '-c', 'ps -o args | grep "[c]at /tmp/huge" || echo none'] });
      assert.equal(ps.stdout.trim(), 'none', 'the reader was stopped');
    } finally {
      // The later checkpoint tests archive a1's writable layer.
      await a!.client.exec('a1', { argv: ['rm', '-f', '/tmp/huge'] });
    }

    // A process that never reads stdin: the agent stops reading the socket, so the sender is held back.
    const raw = new WebSocket(`ws://127.0.0.1:${a!.port}/v1/vms/a1/exec`, { headers: { authorization: `Bearer ${a!.token}` } });
    await withTimeout(
      new Promise<void>((resolve, reject) => {
        raw.once('open', () => resolve());
        raw.once('error', reject);
      }),
      10_000,
      'open',
    );
    raw.send(JSON.stringify({ type: 'start', argv: ['sleep', '60'] }));
    const frame = JSON.stringify({ type: 'stdin', data: Buffer.alloc(512 * 1024).toString('base64') });
    let sent = 0;
    const deadline = Date.now() + 5_000;
    while (Date.now() < deadline && sent < 512 * 1024 ** 2) {
      if (raw.bufferedAmount < 1024 ** 2) {
        raw.send(frame);
        sent += 512 * 1024;
      } else await new Promise((r) => setTimeout(r, 5));
    }
    const grew = (await rss()) - before;
    raw.terminate();
    t.diagnostic(`stdin accepted ${Math.round(sent / 1024 ** 2)} MiB; agent grew ${Math.round(grew / 1024 ** 2)} MiB`);
    assert.ok(sent < 64 * 1024 ** 2, `${sent} bytes of stdin accepted for a process that reads none`);
    assert.ok(grew < 64 * 1024 ** 2, `the agent grew by ${grew} bytes`);

    // Hundreds of frames behind the start frame, before the process exists: refused, not queued without end.
    const early = new WebSocket(`ws://127.0.0.1:${a!.port}/v1/vms/a1/exec`, { headers: { authorization: `Bearer ${a!.token}` } });
    await withTimeout(
      new Promise<void>((resolve, reject) => {
        early.once('open', () => resolve());
        early.once('error', reject);
      }),
      10_000,
      'open',
    );
    const closed = new Promise<number>((resolve) => early.once('close', (code) => resolve(code)));
    const sock = (early as unknown as { _socket: Socket })._socket;
    sock.cork();
    early.send(JSON.stringify({ type: 'start', argv: ['cat'] }));
    for (let i = 0; i < 600; i++) early.send(JSON.stringify({ type: 'stdin', data: 'eA==' }));
    sock.uncork();
    assert.equal(await withTimeout(closed, 10_000, 'the close'), 4008);
  });

  it('attaches with a TTY and follows resize frames', async (t) => {
    if (guard(t)) return;
    let s: AgentStream;
    try {
      s = await a!.client.attach('a1', { type: 'start', cmd: ['/bin/sh'], tty: true, rows: 30, cols: 100 });
    } catch (err) {
      const why = featureSkip(err);
      if (why) {
        t.skip(why);
        return;
      }
      throw err;
    }
    const frames = s.frames[Symbol.asyncIterator]();
    try {
      // stty only answers on a terminal: its size proves the pty and the initial rows/cols.
      s.write('stty size\n');
      await readUntil(frames, /30 100/);
      s.send({ type: 'resize', rows: 40, cols: 120 });
      s.write('stty size\n');
      await readUntil(frames, /40 120/);
      s.write('exit 7\n');
      let exit: ServerFrame | undefined;
      await withTimeout(
        (async () => {
          for (;;) {
            const r = await frames.next();
            if (r.done) break;
            if (r.value.type === 'exit') exit = r.value;
          }
        })(),
        10_000,
        'attach exit',
      );
      assert.equal(exit?.type === 'exit' ? exit.code : undefined, 7);
    } finally {
      s.close();
    }
  });

  it('starts the in-guest agent and runs its drain command on graceful destroy', async (t) => {
    if (guard(t)) return;
    const c = a!.client;
    await c.createVm({ name: 'a3', image: 'base' });
    const started = await c.startAgent('a3', {
      files: { '/opt/agent/run.sh': Buffer.from('#!/bin/sh\necho started > /tmp/agent.state\nexec sleep 1000\n').toString('base64') },
      command: '/opt/agent/run.sh',
      drain_command: 'echo drained > /tmp/drained',
    });
    assert.equal(started.started, true);
    const seen = await withTimeout(
      (async () => {
        for (;;) {
          const r = await c.exec('a3', { argv: ['cat', '/tmp/agent.state'] });
          if (r.exit_code === 0) return r.stdout;
          await new Promise((res) => setTimeout(res, 100));
        }
      })(),
      10_000,
      'agent start',
    );
    assert.equal(seen, 'started\n');
    await expectCode(c.startAgent('a3', { command: 'true', expose: [{ port: 8080, as: 'http' }] }), 'EXPOSE_NOT_PUBLISHED');
    const d = await c.destroyVm('a3');
    assert.deepEqual(d, { name: 'a3', destroyed: true, drained: true });
    await expectCode(c.getVm('a3'), 'SANDBOX_NOT_FOUND');
  });

  it('checkpoints a sandbox (reporting the kind it produced) and creates one from it', async (t) => {
    if (guard(t)) return;
    const c = a!.client;
    await c.exec('a1', { argv: ['sh', '-c', 'mkdir -p /root && echo persisted-state > /root/state.txt'] });
    const cp = await c.checkpoint('a1', { comment: 'first', live: true });
    assert.equal(cp.kind, 'disk', 'the process backend cannot capture memory and says so');
    assert.match(cp.digest, /^[0-9a-f]{64}$/);
    assert.ok(cp.size_bytes > 0);
    assert.equal(cp.comment, 'first');
    assert.ok((await c.listCheckpoints()).some((x) => x.id === cp.id && x.digest === cp.digest));
    state.cpId = cp.id;
    state.cpDigest = cp.digest;

    const vm = await c.createVm({ name: 'a2', checkpoint_id: cp.id });
    assert.equal(vm.from_checkpoint, cp.id);
    const r = await c.exec('a2', { argv: ['cat', '/root/state.txt'] });
    assert.equal(r.stdout, 'persisted-state\n');
  });

  it('moves an artifact between two agents and verifies it', async (t) => {
    if (guard(t) || !state.cpId) return;
    const grant = await a!.client.grantArtifact(state.cpId, 60);
    const moved = await b!.client.pullArtifact({
      snapshot_id: state.cpId,
      digest: state.cpDigest!,
      from: { url: a!.url, grant: grant.grant },
    });
    assert.equal(moved.snapshot_id, state.cpId);
    assert.equal(moved.kind, 'disk');
    assert.ok(moved.size_bytes > 0);
    const onB = (await b!.client.listCheckpoints()).find((x) => x.id === state.cpId);
    assert.equal(onB?.digest, state.cpDigest);
    // A retried pull of the same bytes succeeds without a second copy.
    const again = await b!.client.pullArtifact({
      snapshot_id: state.cpId,
      digest: state.cpDigest!,
      from: { url: a!.url, grant: grant.grant },
    });
    assert.equal(again.snapshot_id, state.cpId);

    // Two pulls of the same snapshot at once: both succeed, one copy is kept.
    const twin = {
      snapshot_id: `${state.cpId}-twin`,
      source_snapshot_id: state.cpId,
      digest: state.cpDigest!,
      from: { url: a!.url, grant: grant.grant },
    };
    const [p1, p2] = await Promise.all([b!.client.pullArtifact(twin), b!.client.pullArtifact(twin)]);
    assert.equal(p1.snapshot_id, twin.snapshot_id);
    assert.equal(p2.snapshot_id, twin.snapshot_id);
    assert.equal((await b!.client.listCheckpoints()).filter((x) => x.id === twin.snapshot_id).length, 1);
    assert.deepEqual(await b!.client.deleteCheckpoint(twin.snapshot_id), { id: twin.snapshot_id, deleted: true });
    assert.deepEqual(await b!.client.deleteCheckpoint(twin.snapshot_id), { id: twin.snapshot_id, deleted: false });

    await b!.client.createVm({ name: 'b1', checkpoint_id: state.cpId });
    const r = await b!.client.exec('b1', { argv: ['cat', '/root/state.txt'] });
    assert.equal(r.stdout, 'persisted-state\n');

    for (const agent of [a!, b!]) assert.ok(!agent.output().includes(grant.grant), 'a grant never reaches a log line');
    // Range reads are served under the grant.
    const part = await fetch(`${a!.url}/v1/artifacts/${state.cpId}/files/rootfs.tar`, {
      headers: { authorization: `Bearer ${grant.grant}`, range: 'bytes=0-99' },
    });
    assert.equal(part.status, 206);
    assert.equal((await part.arrayBuffer()).byteLength, 100);
  });

  it('refuses an expired or wrong-snapshot grant, and a wrong digest, leaving nothing behind', async (t) => {
    if (guard(t) || !state.cpId) return;
    const grant = await a!.client.grantArtifact(state.cpId, 1);
    await new Promise((r) => setTimeout(r, 1100));
    const expired = await expectCode(
      b!.client.pullArtifact({
        snapshot_id: 'exp1',
        source_snapshot_id: state.cpId,
        digest: state.cpDigest!,
        from: { url: a!.url, grant: grant.grant },
      }),
      'ARTIFACT_TRANSFER_FAILED',
    );
    assert.equal(expired.details?.peer_code, 'GRANT_EXPIRED');

    const a2cp = await a!.client.checkpoint('a2', { comment: 'other' });
    const wrongGrant = await a!.client.grantArtifact(a2cp.id, 60);
    const wrong = await expectCode(
      b!.client.pullArtifact({
        snapshot_id: 'wrong1',
        source_snapshot_id: state.cpId,
        digest: state.cpDigest!,
        from: { url: a!.url, grant: wrongGrant.grant },
      }),
      'ARTIFACT_TRANSFER_FAILED',
    );
    assert.equal(wrong.details?.peer_code, 'GRANT_INVALID');

    const good = await a!.client.grantArtifact(state.cpId, 60);
    await expectCode(
      b!.client.pullArtifact({
        snapshot_id: 'dig1',
        source_snapshot_id: state.cpId,
        digest: 'f'.repeat(64),
        from: { url: a!.url, grant: good.grant },
      }),
      'ARTIFACT_DIGEST_MISMATCH',
    );
    const ids = (await b!.client.listCheckpoints()).map((x) => x.id);
    for (const id of ['exp1', 'wrong1', 'dig1']) assert.ok(!ids.includes(id), `${id} must not exist on B`);
    await assertNoStaging(b!);
  });

  it('refuses a small file (fetched without a receiver thread) that changed at the source, and leaves nothing behind', async (t) => {
    if (guard(t)) return;
    const c = a!.client;
    const cp = await c.checkpoint('a2', { comment: 'grown' });
    const archive = join(aOpts.dataDir, 'checkpoints', cp.id, 'rootfs.tar');
    assert.ok((await stat(archive)).size < 1 << 20, 'a file the pull fetches on its own thread');
    await appendFile(archive, Buffer.alloc(64 * 1024, 1));
    const grant = await c.grantArtifact(cp.id, 60);
    const err = await expectCode(
      b!.client.pullArtifact({ snapshot_id: cp.id, digest: cp.digest, from: { url: a!.url, grant: grant.grant } }),
      'ARTIFACT_DIGEST_MISMATCH',
    );
    assert.match(err.message, /rootfs\.tar/);
    assert.ok(!(await b!.client.listCheckpoints()).some((x) => x.id === cp.id));
    await assertNoStaging(b!);
    await c.deleteCheckpoint(cp.id);
  });

  it('refuses a tampered file (digest mismatch) and leaves nothing behind', async (t) => {
    if (guard(t)) return;
    const c = a!.client;
    await c.exec('a1', { argv: ['sh', '-c', 'head -c 3000000 /dev/urandom > /root/big.bin'] });
    const cp = await c.checkpoint('a1', { comment: 'big' });
    state.bigCpId = cp.id;
    state.bigDigest = cp.digest;
    // Flip one byte of the source's archive in place: same size, different bytes.
    const fh = await open(join(aOpts.dataDir, 'checkpoints', cp.id, 'rootfs.tar'), 'r+');
    const buf = Buffer.alloc(1);
    await fh.read(buf, 0, 1, 1_000_000);
    buf[0] = (buf[0] ?? 0) ^ 0xff;
    await fh.write(buf, 0, 1, 1_000_000);
    await fh.close();
    const grant = await c.grantArtifact(cp.id, 60);
    const err = await expectCode(
      b!.client.pullArtifact({ snapshot_id: cp.id, digest: cp.digest, from: { url: a!.url, grant: grant.grant } }),
      'ARTIFACT_DIGEST_MISMATCH',
    );
    assert.match(err.message, /rootfs\.tar/);
    assert.ok(!(await b!.client.listCheckpoints()).some((x) => x.id === cp.id));
    await assertNoStaging(b!);
    // Put the byte back for the next test.
    const fh2 = await open(join(aOpts.dataDir, 'checkpoints', cp.id, 'rootfs.tar'), 'r+');
    buf[0] = (buf[0] ?? 0) ^ 0xff;
    await fh2.write(buf, 0, 1, 1_000_000);
    await fh2.close();
  });

  it('a peer killed mid-transfer leaves nothing behind; the restarted agent rediscovers its sandboxes', async (t) => {
    if (guard(t) || !state.bigCpId) return;
    const grant = await a!.client.grantArtifact(state.bigCpId, 300);
    // A TCP relay that SIGKILLs agent A once 1 MB of its answer has gone through.
    const agentA = a!;
    let relayed = 0;
    let killed = false;
    const proxy = createServer((down: Socket) => {
      const up = connect(agentA.port, '127.0.0.1');
      down.pipe(up);
      up.on('data', (chunk: Buffer) => {
        relayed += chunk.length;
        if (relayed > 1_000_000 && !killed) {
          killed = true;
          agentA.proc.kill('SIGKILL');
          up.destroy();
          down.destroy();
          return;
        }
        if (!killed) down.write(chunk);
      });
      up.on('error', () => down.destroy());
      down.on('error', () => up.destroy());
      up.on('close', () => down.destroy());
    });
    proxies.push(proxy);
    await new Promise<void>((r) => proxy.listen(0, '127.0.0.1', r));
    const proxyPort = (proxy.address() as { port: number }).port;
    const err = await expectCode(
      b!.client.pullArtifact({
        snapshot_id: state.bigCpId,
        digest: state.bigDigest!,
        from: { url: `http://127.0.0.1:${proxyPort}`, grant: grant.grant },
      }),
      'ARTIFACT_TRANSFER_FAILED',
    );
    assert.ok(killed, 'the peer was killed mid-transfer');
    assert.match(err.message, /broke off|could not reach|refused/);
    assert.ok(!(await b!.client.listCheckpoints()).some((x) => x.id === state.bigCpId));
    await assertNoStaging(b!);

    // Agent A died with SIGKILL while a1 and a2 ran: a new agent on the same data dir lists them and can exec.
    await a!.kill();
    a = await startAgent(aOpts);
    const names = (await a.client.listVms()).map((v) => v.name).sort();
    assert.ok(names.includes('a1') && names.includes('a2'), `rediscovered ${names.join(',')}`);
    const r = await a.client.exec('a1', { argv: ['cat', '/root/state.txt'] });
    assert.equal(r.stdout, 'persisted-state\n');
  });

  it('an agent SIGKILLed in the middle of creates: after restart and prune, every host resource belongs to a listed sandbox', async (t) => {
    if (guard(t)) return;
    const prefix = aOpts.bridgePrefix;
    // Creates in flight at staggered points, then a crash.
    const inflight = [0, 1, 2, 3].map((i) =>
      a!.client.createVm({ name: `crash${i}`, image: 'base' }, { timeoutMs: 20_000 }).catch(() => undefined),
    );
    await new Promise((r) => setTimeout(r, 60));
    await a!.kill();
    await Promise.all(inflight);
    a = await startAgent(aOpts);
    await a.client.prune();
    const listed = new Set((await a.client.listVms()).map((v) => v.name));
    assert.ok(listed.has('a1') && listed.has('a2'), 'the sandboxes that ran before survive');

    const dirs = await readdir(join(aOpts.dataDir, 'sandboxes')).catch(() => [] as string[]);
    assert.deepEqual(
      dirs.filter((d) => !listed.has(d)),
      [],
      'no sandbox directory without a sandbox',
    );
    const cg = await readdir(`/sys/fs/cgroup/pids/fleet-${prefix}`, { withFileTypes: true }).catch(() => []);
    const cgNames = cg.filter((e) => e.isDirectory()).map((e) => e.name);
    assert.deepEqual(
      cgNames.filter((n) => !listed.has(n)),
      [],
      'no cgroup without a sandbox',
    );
    const veths = (await listLinks('veth')).filter((l) => l.startsWith(`${prefix}v`));
    const owned = new Set(
      await Promise.all(
        [...listed].map(
          async (n) => (JSON.parse(await readFileText(join(aOpts.dataDir, 'sandboxes', n, 'state.json'), 'utf8')) as { veth: string }).veth,
        ),
      ),
    );
    assert.deepEqual(
      veths.filter((v) => !owned.has(v)),
      [],
      'no veth without a sandbox',
    );
    for (const name of listed) {
      const info = await a.client.getVm(name);
      if (info.state === 'running') assert.equal((await a.client.exec(name, { argv: ['true'] })).exit_code, 0, `${name} runs`);
    }
  });

  it('prune reclaims leftovers that no known sandbox owns, and spares the running ones', async (t) => {
    if (guard(t)) return;
    // Leftovers of a crashed pull and of a sandbox the agent no longer knows.
    const staging = join(b!.opts.dataDir, 'staging');
    await mkdir(join(staging, 'pull-crashed-abc'), { recursive: true });
    await writeFile(join(staging, 'pull-crashed-abc', 'rootfs.tar'), 'partial');
    await mkdir(join(b!.opts.dataDir, 'guest-agents'), { recursive: true });
    await writeFile(join(b!.opts.dataDir, 'guest-agents', 'gone.json'), '{"drain_command":"x"}');
    const report = await b!.client.prune();
    assert.ok(report.reclaimed.includes('staging pull-crashed-abc'), report.reclaimed.join('; '));
    assert.ok(report.reclaimed.includes('guest-agent record gone'), report.reclaimed.join('; '));
    await assertNoStaging(b!);
    const again = await b!.client.prune();
    assert.deepEqual(again.reclaimed, [], 'a second prune finds nothing');
    const r = await b!.client.exec('b1', { argv: ['true'] });
    assert.equal(r.exit_code, 0, 'running sandboxes survive prune');
  });

  it('SIGTERM shuts the agent down gracefully with a stream open; its sandboxes keep running', async (t) => {
    if (guard(t)) return;
    const s = await b!.client.execStream('b1', { type: 'start', argv: ['sleep', '30'] });
    const ended = collect(s, 15_000).catch((err: unknown) => err);
    const t0 = Date.now();
    const bOpts = b!.opts;
    b!.proc.kill('SIGTERM');
    const code = await withTimeout(new Promise<number | null>((r) => b!.proc.once('exit', (c) => r(c))), 12_000, 'graceful shutdown');
    assert.equal(code, 0);
    assert.ok(Date.now() - t0 < 11_000);
    await ended;
    assert.ok(!b!.output().includes(b!.token), 'the token never reaches a log line');
    b = await startAgent(bOpts);
    assert.equal((await b.client.exec('b1', { argv: ['cat', '/root/state.txt'] })).stdout, 'persisted-state\n');
  });
});

async function assertNoStaging(agent: RunningAgent): Promise<void> {
  const entries = await readdir(join(agent.opts.dataDir, 'staging')).catch(() => [] as string[]);
  assert.deepEqual(
    entries.filter((e) => e.startsWith('pull-')),
    [],
    'no staging directory is left behind',
  );
}
