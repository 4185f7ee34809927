import assert from 'node:assert/strict';
import { after, before, describe, it, type TestContext } from 'node:test';
import WebSocket from 'ws';
import type { RunningAgent } from '../agent/harness.js';
import {
  handshake,
  keyOf,
  registerHost,
  startControlPlane,
  withTimeout,
  type AgentFleet,
  type ControlPlane,
  startCheckedFleet,
  type KeyName,
} from '../support/control-plane.js';

/**
 * The API through a real HTTP client: the service listens on a port, fetch
 * makes the calls and `ws` opens the websockets for streaming exec and
 * attach (TTY and resize frames), against a real agent and sandbox.
 */

interface Frame {
  type: string;
  data?: string;
  code?: number | string;
  message?: string;
  timed_out?: boolean;
}

/** A websocket session as a test reads it: frames in order, text decoded, waits bounded. */
class Session {
  readonly frames: Frame[] = [];
  output = '';
  closed: { code: number } | undefined;
  private wake: (() => void) | undefined;

  constructor(readonly ws: WebSocket) {
    ws.on('message', (raw) => {
      const f = JSON.parse((raw as Buffer).toString()) as Frame;
      this.frames.push(f);
      if ((f.type === 'stdout' || f.type === 'stderr') && f.data) this.output += Buffer.from(f.data, 'base64').toString();
      this.wake?.();
    });
    ws.on('close', (code) => {
      this.closed = { code };
      this.wake?.();
    });
  }

  send(frame: object): void {
    this.ws.send(JSON.stringify(frame));
  }

  stdin(text: string): void {
    this.send({ type: 'stdin', data: Buffer.from(text).toString('base64') });
  }

  async until(pred: () => boolean, what: string, ms = 15_000): Promise<void> {
    await withTimeout(
      (async () => {
        while (!pred()) {
          if (this.closed && !pred())
            throw new Error(`socket closed (${this.closed.code}) before ${what}; frames ${JSON.stringify(this.frames).slice(0, 500)}`);
          await new Promise<void>((r) => (this.wake = r));
        }
      })(),
      ms,
      `${what} (output so far ${JSON.stringify(this.output)})`,
    );
  }

  exit(): Frame | undefined {
    return this.frames.find((f) => f.type === 'exit');
  }
}

describe('command API over real HTTP: fetch and websockets (real agent)', { timeout: 300_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let agent: RunningAgent;
  let base = '';
  let vmId = '';
  const sockets: WebSocket[] = [];

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const call = async (method: string, path: string, as: KeyName, body?: unknown): Promise<{ status: number; body: any }> => {
    const res = await fetch(`${base}${path}`, {
      method,
      headers: { authorization: `Bearer ${keyOf(as)}`, ...(body !== undefined ? { 'content-type': 'application/json' } : {}) },
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(60_000),
    });
    const text = await res.text();
    return { status: res.status, body: text && /json/.test(res.headers.get('content-type') ?? '') ? JSON.parse(text) : text };
  };
  const open = async (path: string, as: KeyName | undefined): Promise<Session> => {
    const ws = new WebSocket(`${base.replace('http', 'ws')}${path}`, { headers: as ? { authorization: `Bearer ${keyOf(as)}` } : {} });
    sockets.push(ws);
    const s = new Session(ws);
    await handshake(ws);
    return s;
  };

  before(async () => {
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    agent = started.agents[0]!;
    if (skip) {
      process.stderr.write(`control-plane HTTP stream tests skipped: ${skip}\n`);
      return;
    }
    cp = await startControlPlane();
    const r = await registerHost(cp, 'h1', agent, { capacity_overrides: { cpus: 8 } });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    await cp.service.runner.waitFor(r.body.position, 20_000);
    base = await cp.listen();
  });

  after(async () => {
    for (const ws of sockets) ws.terminate();
    await cp?.close();
    await fleet?.close();
  });

  it('creates, reads and execs over HTTP', async (t) => {
    if (guard(t)) return;
    const created = await call('POST', '/v1/vms', 'acme', { image: 'base', ram_mb: 256 });
    assert.equal(created.status, 201, JSON.stringify(created.body));
    assert.equal(created.body.state, 'running');
    vmId = created.body.id;
    const got = await call('GET', `/v1/vms/${vmId}?after=${created.body.position}`, 'acme');
    assert.equal(got.body.state, 'running');
    const ex = await call('POST', `/v1/vms/${vmId}/exec`, 'acme', { argv: ['sh', '-c', 'echo over http; exit 2'] });
    assert.equal(ex.status, 200);
    assert.equal(ex.body.stdout, 'over http\n');
    assert.equal(ex.body.exit_code, 2);
    const health = await fetch(`${base}/healthz`);
    assert.equal(health.status, 200);
    const unauth = await call('GET', '/v1/vms', 'acme').then(() => fetch(`${base}/v1/vms`));
    assert.equal(unauth.status, 401);
    assert.equal(((await unauth.json()) as { code: string }).code, 'UNAUTHORIZED');
  });

  it('streaming exec over a websocket: output as it comes, stdin, eof, the exit code', async (t) => {
    if (guard(t)) return;
    const s = await open(`/v1/vms/${vmId}/exec`, 'acme');
    s.send({ type: 'start', argv: ['sh', '-c', 'echo ready; read line; echo "got $line"; cat; exit 4'] });
    await s.until(() => s.output.includes('ready\n'), 'the first line');
    assert.equal(s.frames[0]?.type, 'started');
    s.stdin('hello\n');
    await s.until(() => s.output.includes('got hello\n'), 'the echoed line');
    s.stdin('rest of input');
    s.send({ type: 'eof' });
    await s.until(() => s.exit() !== undefined, 'the exit frame');
    assert.equal(s.exit()!.code, 4);
    assert.equal(s.output, 'ready\ngot hello\nrest of input');
    await s.until(() => s.closed !== undefined, 'the close');
    assert.equal(s.closed!.code, 1000);
  });

  it('streaming exec honours its timeout', async (t) => {
    if (guard(t)) return;
    const s = await open(`/v1/vms/${vmId}/exec`, 'acme');
    s.send({ type: 'start', argv: ['sleep', '30'], timeout_ms: 500 });
    await s.until(() => s.exit() !== undefined, 'the exit frame', 15_000);
    assert.equal(s.exit()!.timed_out, true);
  });

  it('attach with a TTY: the terminal size, a resize frame, the shell exit code', async (t) => {
    if (guard(t)) return;
    const s = await open(`/v1/vms/${vmId}/attach`, 'acme');
    s.send({ type: 'start', cmd: ['/bin/sh'], tty: true, rows: 24, cols: 80 });
    s.stdin('stty size\n');
    await s.until(() => /24 80/.test(s.output), 'the first size');
    s.send({ type: 'resize', rows: 40, cols: 120 });
    s.stdin('stty size; tty >/dev/null && echo is-a-tty\n');
    await s.until(() => /40 120/.test(s.output) && /is-a-tty/.test(s.output), 'the size after resize');
    s.stdin('exit 3\n');
    await s.until(() => s.exit() !== undefined, 'the exit frame');
    assert.equal(s.exit()!.code, 3);
  });

  it('attach without a TTY runs the command with plain pipes', async (t) => {
    if (guard(t)) return;
    const s = await open(`/v1/vms/${vmId}/attach`, 'acme');
    s.send({ type: 'start', cmd: ['sh', '-c', 'tty >/dev/null || echo no-tty; cat'], tty: false });
    await s.until(() => s.output.includes('no-tty'), 'the no-tty line');
    s.stdin('piped');
    s.send({ type: 'eof' });
    await s.until(() => s.exit() !== undefined, 'the exit frame');
    assert.equal(s.exit()!.code, 0);
    assert.equal(s.output, 'no-tty\npiped');
  });

  it('websockets refuse: no key (401 handshake), another tenant (VM_NOT_FOUND), a bad start frame, a bad later frame', async (t) => {
    if (guard(t)) return;
    await assert.rejects(open(`/v1/vms/${vmId}/exec`, undefined), (err: { status?: number }) => err.status === 401);

    const other = await open(`/v1/vms/${vmId}/exec`, 'globex');
    other.send({ type: 'start', argv: ['true'] });
    await other.until(() => other.closed !== undefined, 'the close');
    assert.deepEqual(
      other.frames.map((f) => [f.type, f.code]),
      [['error', 'VM_NOT_FOUND']],
    );
    assert.equal(other.closed!.code, 1008);

    const bad = await open(`/v1/vms/${vmId}/exec`, 'acme');
    bad.send({ type: 'start', argv: [] });
    await bad.until(() => bad.closed !== undefined, 'the close');
    assert.equal(bad.frames[0]?.type, 'error');
    assert.equal(bad.frames[0]?.code, 'VALIDATION_FAILED');

    // Not JSON at all: the client's mistake (VALIDATION_FAILED), not an internal error.
    const garbled = await open(`/v1/vms/${vmId}/exec`, 'acme');
    garbled.ws.send('not json');
    await garbled.until(() => garbled.closed !== undefined, 'the close');
    assert.deepEqual(
      garbled.frames.map((f) => [f.type, f.code]),
      [['error', 'VALIDATION_FAILED']],
    );
    assert.equal(garbled.closed!.code, 1008);

    const later = await open(`/v1/vms/${vmId}/attach`, 'acme');
    later.send({ type: 'start', cmd: ['cat'] });
    await later.until(() => later.frames.some((f) => f.type === 'started'), 'started');
    later.send({ type: 'resize', rows: 0, cols: 80 });
    await later.until(() => later.closed !== undefined, 'the close');
    assert.ok(
      later.frames.some((f) => f.type === 'error' && f.code === 'VALIDATION_FAILED'),
      JSON.stringify(later.frames),
    );
  });

  it('destroys over HTTP; streams to a destroyed VM are refused', async (t) => {
    if (guard(t)) return;
    const d = await call('DELETE', `/v1/vms/${vmId}`, 'acme');
    assert.equal(d.body.state, 'destroyed');
    const s = await open(`/v1/vms/${vmId}/exec`, 'acme');
    s.send({ type: 'start', argv: ['true'] });
    await s.until(() => s.closed !== undefined, 'the close');
    assert.equal(s.frames[0]?.code, 'VM_NOT_RUNNING');
    assert.deepEqual(await agent.client.listVms(`fl-${vmId}`), []);
  });
});
