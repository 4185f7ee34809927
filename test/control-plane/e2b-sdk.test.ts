import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { promisify } from 'node:util';
import { after, before, describe, it, type TestContext } from 'node:test';
import { AuthenticationError, CommandExitError, FileNotFoundError, Sandbox, SandboxError, SandboxNotFoundError, TimeoutError } from 'e2b';
import { Code, ConnectError, createClient } from '@connectrpc/connect';
import { createConnectTransport } from '@connectrpc/connect-node';
import { EventType, Filesystem } from '../../packages/agent/src/envd/gen/filesystem_pb.js';
import { Process } from '../../packages/agent/src/envd/gen/process_pb.js';
import { pino } from 'pino';
import { startIngress, type RunningIngress } from '../../src/adapters/ingress/ingress.js';
import type { RunningAgent } from '../agent/harness.js';
import {
  eventually,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  TENANT_KEYS,
  type AgentFleet,
  type ControlPlane,
} from '../support/control-plane.js';

/**
 * Acceptance of issue 19: the stock npm `e2b` SDK, unpatched, configured only
 * through E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, against the control
 * plane (same wiring as `npm start`) and a real host agent running real
 * sandboxes. Tests run in order and share one sandbox where they can.
 */

const run = promisify(execFile);

async function until<T>(what: string, f: () => T | undefined | Promise<T | undefined>, timeoutMs = 15_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await f();
    if (v !== undefined && v !== false) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

describe('e2b SDK against the control plane (stock npm SDK, real agent)', { timeout: 600_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  let base = '';
  let ingress: RunningIngress | undefined;
  let sbx: Sandbox;
  const env: Record<string, string | undefined> = {};

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    agent = started.agents[0]!;
    if (skip) {
      process.stderr.write(`e2b SDK tests skipped: ${skip}\n`);
      return;
    }
    cp = await startControlPlane();
    const h = await registerHost(cp, 'h1', agent, { capacity_overrides: { cpus: 16 } });
    assert.equal(h.status, 201, JSON.stringify(h.body));
    base = await cp.listen();
    // The in-process ingress as `npm start` runs it: envd is its port handler, reached by the SDK's E2b-Sandbox-Id header.
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
    // Exactly what `npm start` prints (e2bShellExports): nothing else configures the SDK.
    process.env.E2B_API_URL = `${base}/e2b`;
    process.env.E2B_SANDBOX_URL = ingress.url;
    process.env.E2B_API_KEY = TENANT_KEYS.acme;
  });

  after(async () => {
    for (const [k, v] of Object.entries(env)) {
      if (v === undefined) Reflect.deleteProperty(process.env, k);
      else process.env[k] = v;
    }
    await ingress?.close();
    await cp?.close();
    await fleet?.close();
  });

  it('Sandbox.create with metadata and envs; getInfo shows them', async (t) => {
    if (guard(t)) return;
    // The first boot on a fresh machine may outlast the SDK's 60 s request timeout (cold image pages on a loaded host).
    sbx = await Sandbox.create({
      metadata: { suite: 'e2b-sdk', role: 'main' },
      envs: { GREETING: 'hello from envs' },
      requestTimeoutMs: 180_000,
    });
    assert.match(sbx.sandboxId, /^[a-z0-9-]+$/);
    const info = await sbx.getInfo();
    assert.equal(info.sandboxId, sbx.sandboxId);
    assert.equal(info.templateId, 'base');
    assert.equal(info.state, 'running');
    assert.deepEqual(info.metadata, { suite: 'e2b-sdk', role: 'main' });
    // E2B's default timeout (300 s) when none was asked for.
    assert.ok(Math.abs(info.endAt.getTime() - Date.now() - 300_000) < 30_000, `endAt ${info.endAt.toISOString()}`);
    assert.equal(await sbx.isRunning(), true);
    const r = await sbx.commands.run('echo "$GREETING"');
    assert.equal(r.stdout, 'hello from envs\n');
  });

  it('commands.run: stdout, stderr, exit codes (non-zero is CommandExitError), envs, cwd', async (t) => {
    if (guard(t)) return;
    const ok = await sbx.commands.run('echo out; echo err >&2', { envs: { X: '1' } });
    assert.equal(ok.exitCode, 0);
    assert.equal(ok.stdout, 'out\n');
    assert.equal(ok.stderr, 'err\n');
    const env = await sbx.commands.run('echo "$A-$B"', { envs: { A: 'x', B: 'y z' } });
    assert.equal(env.stdout, 'x-y z\n');
    const cwd = await sbx.commands.run('pwd', { cwd: '/tmp' });
    assert.equal(cwd.stdout, '/tmp\n');
    const home = await sbx.commands.run('pwd');
    assert.equal(home.stdout, '/root\n', 'the default cwd is the home of the (root) user');
    await assert.rejects(sbx.commands.run('echo partial; echo bad >&2; exit 7'), (err: unknown) => {
      assert.ok(err instanceof CommandExitError, String(err));
      assert.equal(err.exitCode, 7);
      assert.equal(err.stdout, 'partial\n');
      assert.equal(err.stderr, 'bad\n');
      return true;
    });
    await assert.rejects(sbx.commands.run('ls', { cwd: '/no/such/dir' }), SandboxError);
  });

  it('commands.run: onStdout streams output as it comes, in order', async (t) => {
    if (guard(t)) return;
    const chunks: Array<{ at: number; data: string }> = [];
    const started = Date.now();
    const r = await sbx.commands.run('for i in 1 2 3 4 5; do echo line$i; sleep 0.3; done', {
      onStdout: (data) => void chunks.push({ at: Date.now() - started, data }),
    });
    assert.equal(r.stdout, 'line1\nline2\nline3\nline4\nline5\n');
    assert.equal(chunks.map((c) => c.data).join(''), r.stdout);
    assert.ok(chunks.length >= 3, `output arrived in ${chunks.length} pieces`);
    assert.ok(chunks[0]!.at < 1000, `the first line came after ${chunks[0]!.at} ms, not at the end`);
  });

  it('commands.run: 24 MiB of output arrives whole and in order (the agent pauses the guest pipes while a client lags)', async (t) => {
    if (guard(t)) return;
    const r = await sbx.commands.run('i=0; while [ $i -lt 24 ]; do head -c 1048576 /dev/zero | tr "\\0" "$((i % 10))"; i=$((i+1)); done');
    assert.equal(r.stdout.length, 24 * 1024 * 1024);
    for (let i = 0; i < 24; i++) assert.equal(r.stdout[i * 1024 * 1024 + 512], String(i % 10), `MiB ${i} in its place`);
  });

  it('commands.run: a timeout is TimeoutError and kills the command', async (t) => {
    if (guard(t)) return;
    await assert.rejects(sbx.commands.run('sleep 30; echo never > /tmp/timeout-marker', { timeoutMs: 1500 }), TimeoutError);
    await new Promise((r) => setTimeout(r, 500));
    const procs = await sbx.commands.list();
    assert.ok(!procs.some((p) => p.args.some((a) => a.includes('timeout-marker'))), JSON.stringify(procs));
  });

  it('background: true, then list, disconnect, connect by pid, wait and kill', async (t) => {
    if (guard(t)) return;
    const h = await sbx.commands.run('echo started; sleep 1; echo finished', { background: true });
    assert.ok(h.pid > 0);
    const done = await h.wait();
    assert.equal(done.stdout, 'started\nfinished\n');

    const long = await sbx.commands.run('i=0; while true; do i=$((i+1)); echo tick$i; sleep 0.2; done', { background: true, timeoutMs: 0 });
    const listed = await sbx.commands.list();
    const mine = listed.find((p) => p.pid === long.pid);
    assert.ok(mine, `pid ${long.pid} in ${JSON.stringify(listed)}`);
    assert.equal(mine.cmd, '/bin/bash');
    assert.deepEqual(mine.args.slice(0, 2), ['-l', '-c']);
    // The client goes away; the process does not.
    await long.disconnect();
    await new Promise((r) => setTimeout(r, 800));
    assert.ok(
      (await sbx.commands.list()).some((p) => p.pid === long.pid),
      'still running after the client disconnected',
    );
    const seen: string[] = [];
    const again = await sbx.commands.connect(long.pid, { onStdout: (d) => void seen.push(d) });
    await until('output after re-attaching', () => /tick\d+/.test(seen.join('')) || undefined);
    const ticks = [...seen.join('').matchAll(/tick(\d+)/g)].map((m) => Number(m[1]));
    assert.deepEqual(
      ticks,
      ticks.map((_, i) => ticks[0]! + i),
      'output keeps its order',
    );
    assert.ok(ticks[0]! > 1, 'a re-attached client sees output from then on');
    assert.equal(await sbx.commands.kill(long.pid), true);
    await assert.rejects(again.wait(), (err: unknown) => err instanceof CommandExitError && err.exitCode !== 0);
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === long.pid));
    assert.equal(await sbx.commands.kill(long.pid), false, 'killing a process that is gone answers false');
  });

  it('stdin: sendStdin and closeStdin reach the command', async (t) => {
    if (guard(t)) return;
    const h = await sbx.commands.run('cat; echo "[eof]"', { background: true, stdin: true });
    await sbx.commands.sendStdin(h.pid, 'first line\n');
    await h.sendStdin('second line\n');
    await h.closeStdin();
    const r = await h.wait();
    assert.equal(r.stdout, 'first line\nsecond line\n[eof]\n');
  });

  it('envd over Connect beyond the JS SDK: StreamInput (client streaming) and the polling watchers of the Python SDK', async (t) => {
    if (guard(t)) return;
    const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
    const id = sbx.sandboxId;
    const transport = createConnectTransport({
      baseUrl: `${base}/e2b/envd`,
      httpVersion: '1.1',
      interceptors: [
        (next) => async (req) => {
          req.header.set('e2b-sandbox-id', id);
          req.header.set('x-access-token', token);
          return next(req);
        },
      ],
    });
    const processes = createClient(Process, transport);
    const h = await sbx.commands.run('cat', { background: true, stdin: true });
    async function* input() {
      yield { event: { case: 'start' as const, value: { process: { selector: { case: 'pid' as const, value: h.pid } } } } };
      for (const line of ['streamed one\n', 'streamed two\n']) {
        // Spaced out: the request body really is a stream, not one buffer.
        await new Promise((r) => setTimeout(r, 100));
        yield {
          event: { case: 'data' as const, value: { input: { input: { case: 'stdin' as const, value: new TextEncoder().encode(line) } } } },
        };
      }
    }
    await processes.streamInput(input());
    await h.closeStdin();
    assert.equal((await h.wait()).stdout, 'streamed one\nstreamed two\n');

    const fs = createClient(Filesystem, transport);
    await sbx.files.makeDir('/tmp/polled');
    const { watcherId } = await fs.createWatcher({ path: '/tmp/polled', recursive: true });
    await sbx.files.write('/tmp/polled/sub/a.txt', 'x');
    const first = await fs.getWatcherEvents({ watcherId });
    assert.deepEqual(first.events.map((e) => [e.name, e.type]).sort(), [
      ['sub', EventType.CREATE],
      ['sub/a.txt', EventType.CREATE],
    ]);
    assert.deepEqual((await fs.getWatcherEvents({ watcherId })).events, [], 'each poll reports what changed since the last');
    await fs.removeWatcher({ watcherId });
    await assert.rejects(fs.getWatcherEvents({ watcherId }), (err: unknown) => err instanceof ConnectError && err.code === Code.NotFound);
  });

  it('files: write, read, list, exists, makeDir, rename, remove, getInfo', async (t) => {
    if (guard(t)) return;
    const w = await sbx.files.write('/tmp/e2b/hello.txt', 'hello file');
    assert.equal(w.path, '/tmp/e2b/hello.txt');
    assert.equal(w.name, 'hello.txt');
    assert.equal(await sbx.files.read('/tmp/e2b/hello.txt'), 'hello file');
    const rel = await sbx.files.write('relative.txt', 'in home');
    assert.equal(rel.path, '/root/relative.txt', 'a relative path is relative to the home directory');
    assert.equal((await sbx.commands.run('cat /root/relative.txt')).stdout, 'in home');
    const many = await sbx.files.write([
      { path: '/tmp/e2b/a/one.txt', data: 'one' },
      { path: '/tmp/e2b/b/two.txt', data: new Blob(['two']) },
    ]);
    assert.deepEqual(
      many.map((f) => f.path),
      ['/tmp/e2b/a/one.txt', '/tmp/e2b/b/two.txt'],
    );
    assert.equal(await sbx.files.read('/tmp/e2b/b/two.txt'), 'two');

    assert.equal(await sbx.files.exists('/tmp/e2b/hello.txt'), true);
    assert.equal(await sbx.files.exists('/tmp/e2b/nope'), false);
    assert.equal(await sbx.files.makeDir('/tmp/e2b/dir/sub'), true);
    assert.equal(await sbx.files.makeDir('/tmp/e2b/dir/sub'), false, 'an existing directory answers false');
    const info = await sbx.files.getInfo('/tmp/e2b/hello.txt');
    assert.equal(info.type, 'file');
    assert.equal(info.size, 10);
    assert.equal(info.name, 'hello.txt');
    assert.equal(info.permissions, '-rw-r--r--');
    assert.ok(info.modifiedTime && Math.abs(info.modifiedTime.getTime() - Date.now()) < 120_000);
    await sbx.commands.run('ln -s /tmp/e2b/hello.txt /tmp/e2b/link');
    const link = await sbx.files.getInfo('/tmp/e2b/link');
    assert.equal(link.type, 'symlink');
    assert.equal(link.symlinkTarget, '/tmp/e2b/hello.txt');

    const top = await sbx.files.list('/tmp/e2b');
    assert.deepEqual(top.map((e) => `${e.name}:${e.type}`).sort(), ['a:dir', 'b:dir', 'dir:dir', 'hello.txt:file', 'link:symlink']);
    const deep = await sbx.files.list('/tmp/e2b', { depth: 2 });
    assert.ok(
      deep.some((e) => e.path === '/tmp/e2b/a/one.txt'),
      JSON.stringify(deep.map((e) => e.path)),
    );
    assert.ok(!deep.some((e) => e.path === '/tmp/e2b/dir/sub/x'));

    const moved = await sbx.files.rename('/tmp/e2b/hello.txt', '/tmp/e2b/dir/moved.txt');
    assert.equal(moved.path, '/tmp/e2b/dir/moved.txt');
    assert.equal(await sbx.files.read('/tmp/e2b/dir/moved.txt'), 'hello file');
    await sbx.files.remove('/tmp/e2b/dir');
    assert.equal(await sbx.files.exists('/tmp/e2b/dir'), false);
    await assert.rejects(sbx.files.read('/tmp/e2b/missing.txt'), FileNotFoundError);
    await assert.rejects(sbx.files.getInfo('/tmp/e2b/missing.txt'), FileNotFoundError);
    await assert.rejects(sbx.files.list('/tmp/e2b/missing'), FileNotFoundError);
  });

  it('files and filesystem calls see the sandbox, never the host, also through symlinks to / and /etc', async (t) => {
    if (guard(t)) return;
    await sbx.commands.run('ln -sfn / /tmp/rootlink; ln -sfn /etc /tmp/etclink');
    const guestRoot = (await sbx.commands.run('ls -A /')).stdout.split('\n').filter(Boolean).sort();
    assert.notDeepEqual(guestRoot, readdirSync('/').sort(), 'the guest root differs from the host root, or this test proves nothing');
    const listed = (await sbx.files.list('/tmp/rootlink')).map((e) => e.name).sort();
    assert.deepEqual(listed, guestRoot);
    const guestPasswd = (await sbx.commands.run('cat /etc/passwd')).stdout;
    assert.notEqual(guestPasswd, readFileSync('/etc/passwd', 'utf8'));
    assert.equal(await sbx.files.read('/tmp/etclink/passwd'), guestPasswd);
    const probe = `e2b-probe-${randomBytes(4).toString('hex')}`;
    await sbx.files.write(`/tmp/etclink/${probe}`, 'x');
    await sbx.files.makeDir(`/tmp/rootlink/${probe}`);
    assert.equal((await sbx.commands.run(`cat /etc/${probe}; test -d /${probe} && echo dir`)).stdout, 'xdir\n');
    assert.equal(existsSync(`/etc/${probe}`) || existsSync(`/${probe}`), false, 'nothing landed on the host');
    await sbx.files.remove(`/tmp/rootlink/${probe}`);
    await sbx.files.remove(`/tmp/etclink/${probe}`);
  });

  it('files: 10 MiB up and down byte for byte', async (t) => {
    if (guard(t)) return;
    const data = randomBytes(10 * 1024 * 1024);
    await sbx.files.write('/tmp/big.bin', new Blob([data]));
    const sum = await sbx.commands.run('sha256sum /tmp/big.bin');
    const { createHash } = await import('node:crypto');
    const want = createHash('sha256').update(data).digest('hex');
    assert.equal(sum.stdout.split(' ')[0], want, 'what landed in the sandbox');
    const back = await sbx.files.read('/tmp/big.bin', { format: 'bytes' });
    assert.equal(back.length, data.length);
    assert.ok(Buffer.from(back).equals(data), 'what came back');
    const streamed = await sbx.files.read('/tmp/big.bin', { format: 'stream' });
    let n = 0;
    for await (const chunk of streamed) n += chunk.length;
    assert.equal(n, data.length);
  });

  it('files.watchDir reports creates, writes and removes', async (t) => {
    if (guard(t)) return;
    await sbx.files.makeDir('/tmp/watched');
    const events: Array<{ name: string; type: string }> = [];
    const handle = await sbx.files.watchDir('/tmp/watched', (e) => void events.push({ name: e.name, type: e.type }), { timeoutMs: 0 });
    await sbx.files.write('/tmp/watched/new.txt', 'x');
    await until('a create event', () => events.find((e) => e.name === 'new.txt' && e.type === 'create'));
    await sbx.commands.run('sleep 1.1; echo more >> /tmp/watched/new.txt');
    await until('a write event', () => events.find((e) => e.name === 'new.txt' && e.type === 'write'));
    await sbx.files.remove('/tmp/watched/new.txt');
    await until('a remove event', () => events.find((e) => e.name === 'new.txt' && e.type === 'remove'));
    await handle.stop();
  });

  it('pty.create, sendInput, resize', async (t) => {
    if (guard(t)) return;
    const dec = new TextDecoder();
    let out = '';
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => void (out += dec.decode(d, { stream: true })), timeoutMs: 0 });
    const enc = new TextEncoder();
    await sbx.pty.sendInput(pty.pid, enc.encode('echo $((6*7))\n'));
    await until('the answer on the terminal', () => /\b42\b/.test(out) || undefined);
    await sbx.pty.resize(pty.pid, { cols: 100, rows: 30 });
    await sbx.pty.sendInput(pty.pid, enc.encode('stty size\n'));
    await until('the new size', () => out.includes('30 100') || undefined);
    await sbx.pty.sendInput(pty.pid, enc.encode('exit 3\n'));
    await assert.rejects(pty.wait(), (err: unknown) => err instanceof CommandExitError && err.exitCode === 3);
  });

  it('setTimeout moves the deadline; a sandbox past it is destroyed by the reconciler', async (t) => {
    if (guard(t)) return;
    await sbx.setTimeout(600_000);
    const info = await sbx.getInfo();
    assert.ok(Math.abs(info.endAt.getTime() - Date.now() - 600_000) < 30_000, `endAt ${info.endAt.toISOString()}`);

    const short = await Sandbox.create({ timeoutMs: 1000, metadata: { suite: 'e2b-sdk', role: 'short' } });
    await new Promise((r) => setTimeout(r, 1500));
    const summary = await cp!.service.reconciler.reconcileOnce();
    assert.equal(summary.stuck_tasks_failed, 1, JSON.stringify(summary));
    await assert.rejects(Sandbox.getInfo(short.sandboxId), SandboxNotFoundError);
    const events = await cp!.service.store.readStream(`vm-${short.sandboxId}`);
    const failed = events.find((e) => e.type === 'VmFailed');
    assert.deepEqual(
      failed && { reason: (failed.data as { reason: string }).reason, code: (failed.data as { error_code: string }).error_code },
      { reason: 'timeout', code: 'MAX_RUNTIME_EXCEEDED' },
    );
    assert.equal((await sbx.getInfo()).state, 'running', 'the long-lived sandbox is untouched');
  });

  it('Sandbox.list filters by metadata and pages with nextToken', async (t) => {
    if (guard(t)) return;
    const more = [
      await Sandbox.create({ metadata: { suite: 'e2b-sdk', role: 'extra' } }),
      await Sandbox.create({ metadata: { suite: 'other' } }),
    ];
    const pager = Sandbox.list({ query: { metadata: { suite: 'e2b-sdk' } }, limit: 1 });
    const seen: string[] = [];
    while (pager.hasNext) {
      const page = await pager.nextItems();
      assert.ok(page.length <= 1);
      seen.push(...page.map((s) => s.sandboxId));
    }
    assert.deepEqual(seen.sort(), [sbx.sandboxId, more[0]!.sandboxId].sort());
    const byRole = await Sandbox.list({ query: { metadata: { role: 'extra' } } }).nextItems();
    assert.deepEqual(
      byRole.map((s) => s.sandboxId),
      [more[0]!.sandboxId],
    );
    assert.deepEqual(await Sandbox.list({ query: { state: ['paused'] } }).nextItems(), []);
    for (const s of more) assert.equal(await s.kill(), true);
  });

  it('errors: a wrong key is AuthenticationError, another tenant sees no sandbox, envd needs the sandbox own token', async (t) => {
    if (guard(t)) return;
    await assert.rejects(Sandbox.create({ apiKey: 'not-a-key-of-this-control-plane' }), AuthenticationError);
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId, { apiKey: TENANT_KEYS.globex }), SandboxNotFoundError);
    assert.equal(await Sandbox.kill(sbx.sandboxId, { apiKey: TENANT_KEYS.globex }), false);
    await assert.rejects(Sandbox.connect(sbx.sandboxId, { apiKey: TENANT_KEYS.globex }), SandboxNotFoundError);
    await assert.rejects(Sandbox.getInfo('no-such-sandbox'), SandboxNotFoundError);

    // The envd relay, attacked directly on the ingress and on the API's own relay: no token, a wrong one, another sandbox's.
    const other = await Sandbox.create();
    const otherToken = (await Sandbox.connect(other.sandboxId)) as unknown as { envdAccessToken: string };
    const mine = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
    for (const envdUrl of [ingress!.url, `${base}/e2b/envd`]) {
      const health = (headers: Record<string, string>): Promise<Response> =>
        fetch(`${envdUrl}/health`, { headers: { 'e2b-sandbox-id': sbx.sandboxId, 'e2b-sandbox-port': '49983', ...headers } });
      assert.equal((await health({})).status, 401, envdUrl);
      assert.equal((await health({ 'x-access-token': 'guess' })).status, 401, envdUrl);
      assert.equal((await health({ 'x-access-token': otherToken.envdAccessToken })).status, 401, envdUrl);
      assert.equal((await health({ 'x-access-token': mine })).status, 204, envdUrl);
      const rpc = await fetch(`${envdUrl}/process.Process/List`, {
        method: 'POST',
        headers: {
          'e2b-sandbox-id': sbx.sandboxId,
          'e2b-sandbox-port': '49983',
          'x-access-token': otherToken.envdAccessToken,
          'content-type': 'application/json',
        },
        body: '{}',
      });
      assert.equal(rpc.status, 401, envdUrl);
    }
    // The API's relay (for a control plane running no ingress in its process) serves the SDK too.
    const viaApi = await Sandbox.connect(sbx.sandboxId, { sandboxUrl: `${base}/e2b/envd` });
    assert.equal((await viaApi.commands.run('echo relayed')).stdout, 'relayed\n');
    await other.kill();
    // Internet access and allow/deny lists become the VM's egress policy; what has no counterpart is refused, not dropped.
    const egressOf = async (id: string): Promise<{ allow: boolean; egress: unknown }> => {
      const e2b = (await (await fetch(`${base}/e2b/sandboxes/${id}`, { headers: { 'x-api-key': TENANT_KEYS.acme } })).json()) as {
        allowInternetAccess: boolean;
      };
      // The /v1 read model follows the VM's stream a moment behind (read-your-writes is opt-in, `?after=`): wait for it.
      return eventually(
        async () => {
          const r = await fetch(`${base}/v1/vms/${id}`, { headers: { authorization: `Bearer ${TENANT_KEYS.acme}` } });
          if (r.status === 404) return undefined;
          assert.equal(r.status, 200, `GET /v1/vms/${id}`);
          return { allow: e2b.allowInternetAccess, egress: ((await r.json()) as { spec: { egress?: unknown } }).spec.egress };
        },
        10_000,
        `VM ${id} in the /v1 read model`,
      );
    };
    const offline = await Sandbox.create({ allowInternetAccess: false });
    const listed = await Sandbox.create({ network: { allowOut: ['198.51.100.1'], denyOut: ['0.0.0.0/0'] } });
    try {
      const off = await egressOf(offline.sandboxId);
      assert.equal(off.allow, false);
      assert.deepEqual(off.egress, { mode: 'none' });
      const on = await egressOf(listed.sandboxId);
      assert.equal(on.allow, true);
      assert.deepEqual(on.egress, { mode: 'direct', allow_out: ['198.51.100.1'], deny_out: ['0.0.0.0/0'] });
    } finally {
      await offline.kill();
      await listed.kill();
    }
    await assert.rejects(
      Sandbox.create({ network: { allowOut: ['example.com'] } }),
      (err: unknown) => err instanceof SandboxError && /400/.test(err.message),
    );
    await assert.rejects(
      Sandbox.create({ network: { maskRequestHost: 'x' } } as never),
      (err: unknown) => err instanceof SandboxError && /400/.test(err.message),
    );
    const globexList = await Sandbox.list({ query: { metadata: { suite: 'e2b-sdk' } }, apiKey: TENANT_KEYS.globex }).nextItems();
    assert.deepEqual(globexList, [], 'another tenant lists none of them');
    // A user other than root is refused, not ignored.
    await assert.rejects(sbx.commands.run('id', { user: 'nobody' }), AuthenticationError);
  });

  it('kill: the sandbox is gone for every verb', async (t) => {
    if (guard(t)) return;
    assert.equal(await sbx.kill(), true);
    await assert.rejects(sbx.getInfo(), SandboxNotFoundError);
    assert.equal(await Sandbox.kill(sbx.sandboxId), false);
    assert.equal(await sbx.isRunning(), false);
    // On the ingress too: a gone sandbox is envd's 502 to its token holder, and a 401 to anyone else.
    const health = (headers: Record<string, string>): Promise<Response> =>
      fetch(`${ingress!.url}/health`, { headers: { 'e2b-sandbox-id': sbx.sandboxId, 'e2b-sandbox-port': '49983', ...headers } });
    assert.equal((await health({})).status, 401);
    assert.equal((await health({ 'x-access-token': (sbx as unknown as { envdAccessToken: string }).envdAccessToken })).status, 502);
    await assert.rejects(sbx.commands.run('true'), (err: unknown) => err instanceof SandboxNotFoundError || err instanceof TimeoutError);
  });

  // Pause/connect-resume, fork, snapshots, metrics and network: e2b-sdk-memory.test.ts (a host with CRIU).

  it('the Python SDK smoke (create, run, files, kill)', async (t) => {
    if (guard(t)) return;
    const probe = await run('python3', ['-c', 'import e2b; print(e2b.__name__)']).catch((err: unknown) => err as Error);
    if (probe instanceof Error) {
      t.skip(
        'the Python e2b SDK is not installed: PyPI is unreachable from these machines and from CI, so nothing installs it; this smoke runs wherever `python3 -c "import e2b"` works',
      );
      return;
    }
    const script = [
      'from e2b import Sandbox',
      "s = Sandbox.create(metadata={'suite': 'python'})",
      "r = s.commands.run('echo hi from python')",
      "assert r.stdout == 'hi from python\\n', r.stdout",
      "s.files.write('/tmp/py.txt', 'py')",
      "assert s.files.read('/tmp/py.txt') == 'py'",
      'assert s.kill()',
      "print('ok')",
    ].join('\n');
    const r = await run('python3', ['-c', script], { env: { ...process.env }, timeout: 120_000 });
    assert.equal(r.stdout.trim(), 'ok');
  });
});
