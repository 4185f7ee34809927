import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { after, before, describe, it, type TestContext } from 'node:test';
import WebSocket from 'ws';
import type { RunningAgent } from '../agent/harness.js';
import {
  handshake,
  keyOf,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  withTimeout,
  type AgentFleet,
  type ControlPlane,
} from '../support/control-plane.js';

/**
 * Streams through the control plane stay bounded whatever the client does,
 * measured on the processes themselves (real agent process, real sandbox,
 * the control plane in this process): a 100 GiB sparse file is refused before
 * a byte moves; a 1 GiB file streams through without the control plane
 * holding it; a websocket client that reads nothing of `cat /dev/zero`, or
 * floods stdin to a process that reads none, leaves both processes' memory
 * flat; an attach nobody uses is closed; sessions per VM are capped.
 */

const MiB = 1024 * 1024;
const GiB = 1024 * MiB;
/** The most either process may grow while a stream is held back. */
const BOUND = 64 * MiB;

async function agentRss(agent: RunningAgent): Promise<number> {
  const status = await readFile(`/proc/${agent.proc.pid}/status`, 'utf8');
  return Number(/VmRSS:\s+(\d+) kB/.exec(status)![1]) * 1024;
}

// Buffers that passed through are garbage V8 frees only after ~64 MiB of them pile up (its external
// memory heuristic): collecting before each sample measures what the control plane holds, not that lag.
setFlagsFromString('--expose-gc');
const gc = runInNewContext('gc') as () => void;

/** The control plane's RSS (this process) after a collection. */
function cpRss(): number {
  gc();
  return process.memoryUsage().rss;
}

/** Samples both processes every 200 ms; `grew()` is the largest growth over the baseline taken at start. */
async function rssWatch(agent: RunningAgent): Promise<{ stop(): { cp: number; agent: number }; over(): boolean }> {
  const base = { cp: cpRss(), agent: await agentRss(agent) };
  const peak = { ...base };
  const timer = setInterval(() => {
    peak.cp = Math.max(peak.cp, cpRss());
    void agentRss(agent).then(
      (v) => (peak.agent = Math.max(peak.agent, v)),
      () => undefined,
    );
  }, 200);
  const grew = () => ({ cp: peak.cp - base.cp, agent: peak.agent - base.agent });
  return {
    over: () => grew().cp > 4 * BOUND || grew().agent > 4 * BOUND,
    stop: () => {
      clearInterval(timer);
      return grew();
    },
  };
}

interface Frame {
  type: string;
  data?: string;
  code?: number | string;
}

class Session {
  readonly frames: Frame[] = [];
  outputBytes = 0;
  output = '';
  closed: { code: number; reason: string } | undefined;
  constructor(readonly ws: WebSocket) {
    ws.on('message', (raw) => {
      const f = JSON.parse((raw as Buffer).toString()) as Frame;
      if ((f.type === 'stdout' || f.type === 'stderr') && f.data) {
        const b = Buffer.from(f.data, 'base64');
        this.outputBytes += b.length;
        if (this.output.length < 4096) this.output += b.toString();
      } else this.frames.push(f);
    });
    ws.on('close', (code, reason) => (this.closed = { code, reason: reason.toString() }));
  }
  send(frame: object): void {
    this.ws.send(JSON.stringify(frame));
  }
  async until(pred: () => boolean, what: string, ms = 15_000): Promise<void> {
    const deadline = Date.now() + ms;
    while (!pred()) {
      if (Date.now() > deadline)
        throw new Error(
          `${what} not reached in ${ms} ms; frames ${JSON.stringify(this.frames).slice(0, 300)}; closed ${JSON.stringify(this.closed)}`,
        );
      await new Promise((r) => setTimeout(r, 20));
    }
  }
}

/** A download client: GETs argv[1] with bearer argv[2], counts and drops the bytes, prints {status, length, seen}. */
const READ_AND_COUNT = `
const [url, key] = process.argv.slice(1);
fetch(url, { headers: { authorization: 'Bearer ' + key } }).then(async (res) => {
  let seen = 0;
  const reader = res.body.getReader();
  for (;;) { const r = await reader.read(); if (r.done) break; seen += r.value.byteLength; }
  process.stdout.write(JSON.stringify({ status: res.status, length: res.headers.get('content-length'), seen }));
});`;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

describe('bounded streams through the control plane (real agent, real sandbox)', { timeout: 600_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let agent: RunningAgent;
  // Two control planes on the one agent: a high FILE_MAX_BYTES for the file tests, short idle and session limits for the others.
  let files: ControlPlane | undefined;
  let tight: ControlPlane | undefined;
  let filesBase = '';
  let tightBase = '';
  let vm = '';
  let tightVm = '';
  const sockets: WebSocket[] = [];

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const exec = async (cp: ControlPlane, id: string, script: string): Promise<{ stdout: string; exit_code: number }> => {
    const r = await cp.request('POST', `/v1/vms/${id}/exec`, { as: 'acme', body: { argv: ['sh', '-c', script] } });
    assert.equal(r.status, 200, JSON.stringify(r.body));
    return r.body;
  };
  const open = async (base: string, path: string): Promise<Session> => {
    const ws = new WebSocket(`${base.replace('http', 'ws')}${path}`, { headers: { authorization: `Bearer ${keyOf('acme')}` } });
    sockets.push(ws);
    const s = new Session(ws);
    await handshake(ws);
    return s;
  };

  before(async () => {
    const started = await startCheckedFleet();
    ({ fleet, skip } = started);
    if (skip) {
      process.stderr.write(`bounded stream tests skipped: ${skip}\n`);
      return;
    }
    agent = started.agents[0]!;
    files = await startControlPlane({ env: { FILE_MAX_BYTES: String(64 * GiB) } });
    tight = await startControlPlane({ env: { ATTACH_IDLE_TIMEOUT_MS: '1500', WS_MAX_SESSIONS_PER_VM: '2', FILE_MAX_BYTES: String(MiB) } });
    for (const cp of [files, tight]) {
      const r = await registerHost(cp, 'h1', agent, { capacity_overrides: { cpus: 8 } });
      assert.equal(r.status, 201, JSON.stringify(r.body));
      await cp.service.runner.waitFor(r.body.position, 20_000);
    }
    filesBase = await files.listen();
    tightBase = await tight.listen();
    const a = await files.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', ram_mb: 256 } });
    assert.equal(a.status, 201, JSON.stringify(a.body));
    vm = a.body.id;
    const b = await tight.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', ram_mb: 256 } });
    assert.equal(b.status, 201, JSON.stringify(b.body));
    tightVm = b.body.id;
  });

  after(async () => {
    for (const ws of sockets) ws.terminate();
    await files?.close();
    await tight?.close();
    await fleet?.close();
  });

  it('a sparse 100 GiB file over FILE_MAX_BYTES is refused with 413 FILE_TOO_LARGE before any byte moves', async (t) => {
    if (guard(t)) return;
    await exec(files!, vm, 'truncate -s 100G /big');
    const watch = await rssWatch(agent);
    const t0 = Date.now();
    const res = await fetch(`${filesBase}/v1/vms/${vm}/files?path=/big`, {
      headers: { authorization: `Bearer ${keyOf('acme')}` },
      signal: AbortSignal.timeout(60_000),
    });
    const took = Date.now() - t0;
    const grew = watch.stop();
    t.diagnostic(`refused in ${took} ms; grew cp ${Math.round(grew.cp / MiB)} MiB, agent ${Math.round(grew.agent / MiB)} MiB`);
    assert.equal(res.status, 413);
    const body = (await res.json()) as { code: string; detail: string };
    assert.equal(body.code, 'FILE_TOO_LARGE');
    assert.match(body.detail, /107374182400 bytes/);
    assert.ok(took < 10_000, `refused in ${took} ms`);
    assert.ok(grew.cp < BOUND && grew.agent < BOUND, `grew ${JSON.stringify(grew)}`);
    // Nothing is left reading it inside the sandbox.
    const ps = await exec(files!, vm, 'ps -o args | grep "[c]at /big" || echo none');
    assert.equal(ps.stdout.trim(), 'none');
  });

  it('a 1 GiB file streams through: Content-Length first, every byte, the control plane never holding it', async (t) => {
    if (guard(t)) return;
    await exec(files!, vm, 'truncate -s 1G /medium');
    const watch = await rssWatch(agent);
    // The client is a process of its own, so what is measured here is the control plane alone.
    const client = spawn(process.execPath, ['-e', READ_AND_COUNT, `${filesBase}/v1/vms/${vm}/files?path=/medium`, keyOf('acme')], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    let out = '';
    client.stdout.on('data', (d: Buffer) => (out += d.toString()));
    const exited = new Promise<void>((resolve) => client.once('exit', () => resolve()));
    const stopIfRunaway = setInterval(() => {
      if (watch.over()) client.kill('SIGKILL');
    }, 100);
    await withTimeout(exited, 240_000, 'the download').finally(() => clearInterval(stopIfRunaway));
    const grew = watch.stop();
    t.diagnostic(`out ${out}; grew cp ${Math.round(grew.cp / MiB)} MiB, agent ${Math.round(grew.agent / MiB)} MiB`);
    assert.ok(grew.cp < BOUND, `the control plane grew by ${Math.round(grew.cp / MiB)} MiB`);
    const result = JSON.parse(out) as { status: number; length: string; seen: number };
    assert.deepEqual(result, { status: 200, length: String(GiB), seen: GiB });
  });

  it('an upload over FILE_MAX_BYTES is refused with 413 FILE_TOO_LARGE, declared or streamed; one under it is written whole', async (t) => {
    if (guard(t)) return;
    const auth = { authorization: `Bearer ${keyOf('acme')}`, 'content-type': 'application/octet-stream' };
    const body = Buffer.alloc(3 * MiB, 7);
    // Declared by Content-Length: refused before the body is read.
    const declared = await fetch(`${tightBase}/v1/vms/${tightVm}/files?path=/tmp/three`, { method: 'PUT', headers: auth, body });
    assert.equal(declared.status, 413);
    assert.equal(((await declared.json()) as { code: string }).code, 'FILE_TOO_LARGE');
    // Chunked, no length: counted as it streams, cut off at the cap, nothing left in the sandbox.
    // eslint-disable-next-line @typescript-eslint/require-await -- the upload takes an async iterable, as a streamed body is
    const chunks = async function* (): AsyncGenerator<Uint8Array> {
      for (let i = 0; i < 12; i++) yield Buffer.alloc(256 * 1024, 7);
    };
    const streamed = await fetch(`${tightBase}/v1/vms/${tightVm}/files?path=/tmp/three`, {
      method: 'PUT',
      headers: auth,
      body: ReadableStream.from(chunks()),
      duplex: 'half',
    });
    assert.equal(streamed.status, 413);
    assert.equal(((await streamed.json()) as { code: string }).code, 'FILE_TOO_LARGE');
    // The agent removes its partial file once it sees the transfer cut (which may be just after the answer).
    const deadline = Date.now() + 15_000;
    let left = '';
    do {
      left = (await exec(tight!, tightVm, 'ls /tmp/three* 2>/dev/null || echo none')).stdout.trim();
      if (left !== 'none') await sleep(200);
    } while (left !== 'none' && Date.now() < deadline);
    assert.equal(left, 'none');
    // Under the cap (the other control plane's): streamed to the agent and written whole.
    const up = await fetch(`${filesBase}/v1/vms/${vm}/files?path=/tmp/three`, {
      method: 'PUT',
      headers: auth,
      body: ReadableStream.from(chunks()),
      duplex: 'half',
    });
    assert.equal(up.status, 200, await up.clone().text());
    assert.equal(((await up.json()) as { size_bytes: number }).size_bytes, 3 * MiB);
    const wc = await exec(files!, vm, 'wc -c < /tmp/three');
    assert.equal(wc.stdout.trim(), String(3 * MiB));
  });

  for (const [mode, start] of [
    ['exec', { type: 'start', argv: ['cat', '/dev/zero'], timeout_ms: 120_000 }],
    ['attach', { type: 'start', cmd: ['cat', '/dev/zero'], tty: true }],
  ] as const) {
    it(`a ${mode} client that reads nothing of cat /dev/zero leaves both processes' memory bounded, and the stream resumes`, async (t) => {
      if (guard(t)) return;
      const s = await open(filesBase, `/v1/vms/${vm}/${mode}`);
      s.send(start);
      await s.until(() => s.outputBytes > 0, 'the first output');
      // From now on the client reads nothing (its socket is not read: TCP fills up towards the control plane).
      s.ws.pause();
      await sleep(500);
      const watch = await rssWatch(agent);
      for (let i = 0; i < 60 && !watch.over(); i++) await sleep(100);
      const grew = watch.stop();
      t.diagnostic(
        `output before the pause ${Math.round(s.outputBytes / MiB)} MiB; grew cp ${Math.round(grew.cp / MiB)} MiB, agent ${Math.round(grew.agent / MiB)} MiB`,
      );
      if (watch.over()) s.ws.terminate();
      assert.ok(grew.cp < BOUND, `the control plane grew by ${Math.round(grew.cp / MiB)} MiB`);
      assert.ok(grew.agent < BOUND, `the agent grew by ${Math.round(grew.agent / MiB)} MiB`);
      // Held back, not cut off: reading again brings more output.
      const before = s.outputBytes;
      s.ws.resume();
      await s.until(() => s.outputBytes > before + MiB, 'output after resuming');
      assert.equal(s.closed, undefined);
      s.ws.close();
    });
  }

  it('stdin to a process that reads none is pushed back to the client, not buffered', async (t) => {
    if (guard(t)) return;
    const s = await open(filesBase, `/v1/vms/${vm}/exec`);
    s.send({ type: 'start', argv: ['sleep', '120'], timeout_ms: 120_000 });
    await s.until(() => s.frames.some((f) => f.type === 'started'), 'started');
    const chunk = JSON.stringify({ type: 'stdin', data: Buffer.alloc(512 * 1024).toString('base64') });
    const watch = await rssWatch(agent);
    let sent = 0;
    const deadline = Date.now() + 6_000;
    while (Date.now() < deadline && !watch.over() && sent < 1024 * MiB) {
      // Sends only what the client's own socket has taken: the client's memory is not what is measured.
      if (s.ws.bufferedAmount < MiB) {
        s.ws.send(chunk);
        sent += 512 * 1024;
      } else await sleep(5);
    }
    const grew = watch.stop();
    t.diagnostic(
      `stdin accepted ${Math.round(sent / MiB)} MiB; grew cp ${Math.round(grew.cp / MiB)} MiB, agent ${Math.round(grew.agent / MiB)} MiB`,
    );
    s.ws.terminate();
    assert.ok(sent < BOUND, `the client pushed ${Math.round(sent / MiB)} MiB of stdin into a process that reads none`);
    assert.ok(grew.cp < BOUND && grew.agent < BOUND, `grew ${JSON.stringify(grew)}`);
  });

  it('an attach with no frame either way for ATTACH_IDLE_TIMEOUT_MS is closed (4408 ATTACH_IDLE_TIMEOUT); activity keeps one open', async (t) => {
    if (guard(t)) return;
    const busy = await open(tightBase, `/v1/vms/${tightVm}/attach`);
    busy.send({ type: 'start', cmd: ['cat'], tty: false });
    const idle = await open(tightBase, `/v1/vms/${tightVm}/attach`);
    idle.send({ type: 'start', cmd: ['cat'], tty: false });
    await busy.until(() => busy.frames.some((f) => f.type === 'started'), 'busy started');
    for (let i = 0; i < 8; i++) {
      busy.send({ type: 'stdin', data: Buffer.from(`line ${i}\n`).toString('base64') });
      await sleep(400);
    }
    await idle.until(() => idle.closed !== undefined, 'the idle close', 10_000);
    assert.equal(idle.closed!.code, 4408);
    assert.ok(
      idle.frames.some((f) => f.type === 'error' && f.code === 'ATTACH_IDLE_TIMEOUT'),
      JSON.stringify(idle.frames),
    );
    assert.equal(busy.closed, undefined, 'the busy session is still open');
    assert.match(busy.output, /line 7/);
    busy.ws.close();
    await busy.until(() => busy.closed !== undefined, 'the busy close');
    await sleep(300);
  });

  it('a third session on one VM is refused at the handshake with 429 (WS_MAX_SESSIONS_PER_VM=2)', async (t) => {
    if (guard(t)) return;
    const a = await open(tightBase, `/v1/vms/${tightVm}/exec`);
    a.send({ type: 'start', argv: ['cat'] });
    const b = await open(tightBase, `/v1/vms/${tightVm}/attach`);
    b.send({ type: 'start', cmd: ['cat'] });
    await a.until(() => a.frames.some((f) => f.type === 'started'), 'a started');
    await b.until(() => b.frames.some((f) => f.type === 'started'), 'b started');
    await assert.rejects(open(tightBase, `/v1/vms/${tightVm}/exec`), (err: { status?: number }) => err.status === 429);
    a.ws.close();
    b.ws.close();
  });
});
