import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import WebSocket from 'ws';
import { ConfigError, loadConfig } from '../../src/adapters/config.js';
import { ApiKeys } from '../../src/adapters/http/auth.js';
import { ADMIN_KEY, keyOf, startControlPlane, withTimeout, type ControlPlane, type KeyName } from '../support/control-plane.js';
import { startStubAgents, type StubAgents } from './stub-agent.js';

/**
 * The edge's own limits and checks, attacked from outside: admin routes
 * refuse a tenant before looking at the body, JSON bodies are capped, the
 * open routes say nothing a stranger may not know, /metrics can be closed
 * with a token, a client's request id is kept only when short and plain,
 * event streams and websocket sessions are counted per caller, and the
 * tenant id `admin` cannot be given to a tenant. The one host is the STUB
 * AGENT double (stub-agent.ts): nothing here reaches a sandbox.
 */

const METRICS_TOKEN = `metrics-${'m'.repeat(24)}`;

describe('limits and checks at the edge', { timeout: 120_000 }, () => {
  let cp: ControlPlane | undefined;
  let stub: StubAgents | undefined;
  let base = '';
  const open: Array<{ close(): void }> = [];

  before(async () => {
    stub = await startStubAgents();
    cp = await startControlPlane({
      env: { METRICS_TOKEN, SSE_MAX_PER_TENANT: '2', WS_MAX_SESSIONS_PER_VM: '2', WS_MAX_SESSIONS_PER_TENANT: '3' },
    });
    const h = stub.add('h1', { vm_count: 4 });
    const r = await cp.request('POST', '/v1/hosts', {
      body: { id: 'h1', url: h.url, token: h.token, backend: 'process', region: 'test' },
      headers: { 'x-request-id': 'deploy-42:step.1' },
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    base = await cp.listen();
  });

  after(async () => {
    for (const o of open) o.close();
    await cp?.close();
    await stub?.close();
  });

  it('a tenant key gets 403 on every admin route whatever the body, before validation', async () => {
    const routes: Array<[string, string, string | undefined]> = [
      ['POST', '/v1/hosts', '{}'],
      ['POST', '/v1/hosts', '{"id":'],
      ['POST', '/v1/hosts', '[1,2]'],
      ['GET', '/v1/hosts?limit=0', undefined],
      ['GET', '/v1/hosts/NOT%20AN%20ID', undefined],
      ['DELETE', '/v1/hosts/h1?force=maybe', undefined],
      ['POST', '/v1/hosts/h1/cordon', '{"reason":5,"extra":true}'],
      ['POST', '/v1/hosts/-x-/uncordon', '{'],
      ['POST', '/v1/hosts/h1/probe', '"text"'],
      ['GET', '/v1/dead-letters?limit=-1', undefined],
      ['GET', '/v1/dead-letters/x', undefined],
      ['POST', '/v1/dead-letters/x/retry', '{"bogus":1}'],
      ['POST', '/v1/dead-letters/x/discard', 'not json'],
      ['GET', '/v1/reconciler', undefined],
    ];
    for (const [method, url, body] of routes) {
      const r = await cp!.request(method, url, {
        as: 'acme',
        ...(body !== undefined ? { rawBody: body, contentType: 'application/json' } : {}),
      });
      assert.equal(r.status, 403, `${method} ${url} ${body ?? ''}: ${JSON.stringify(r.body)}`);
      assert.equal(r.body.code, 'FORBIDDEN');
      assert.equal(r.body.errors, undefined, 'no field list reaches a tenant');
    }
    // The admin still gets the validation answer.
    const admin = await cp!.request('POST', '/v1/hosts', { rawBody: '{}', contentType: 'application/json' });
    assert.equal(admin.status, 400);
    assert.equal(admin.body.code, 'VALIDATION_FAILED');
  });

  it('JSON bodies over 1 MiB are refused with 413 PAYLOAD_TOO_LARGE; POST /v1/vms takes more (inline files)', async () => {
    const big = JSON.stringify({ argv: ['true'], stdin: Buffer.alloc(1024 * 1024).toString('base64') });
    const r = await cp!.request('POST', '/v1/vms/nope/exec', { as: 'acme', rawBody: big, contentType: 'application/json' });
    assert.equal(r.status, 413, JSON.stringify(r.body).slice(0, 300));
    assert.equal(r.body.code, 'PAYLOAD_TOO_LARGE');
    const cordon = await cp!.request('POST', '/v1/hosts/h1/cordon', {
      rawBody: JSON.stringify({ reason: 'x'.repeat(1100 * 1024) }),
      contentType: 'application/json',
    });
    assert.equal(cordon.status, 413);
    // 3 MiB of inline files reach validation (and are judged there), not the body limit.
    const files = { '/tmp/a': Buffer.alloc(2 * 1024 * 1024).toString('base64') };
    const create = await cp!.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base', files, cpus: 'two' } });
    assert.equal(create.status, 400, JSON.stringify(create.body).slice(0, 300));
    assert.equal(create.body.code, 'VALIDATION_FAILED');
  });

  it('/readyz tells a stranger only ready or not; the admin key and METRICS_TOKEN see the checks', async () => {
    const anon = await cp!.request('GET', '/readyz', { as: 'none' });
    assert.equal(anon.status, 200);
    assert.deepEqual(anon.body, { status: 'ready' });
    const tenant = await cp!.request('GET', '/readyz', { as: 'acme' });
    assert.deepEqual(tenant.body, { status: 'ready' });
    for (const authorization of [`Bearer ${ADMIN_KEY}`, `Bearer ${METRICS_TOKEN}`]) {
      const r = await cp!.request('GET', '/readyz', { as: { authorization } });
      assert.equal(r.status, 200);
      assert.equal(r.body.checks.database, 'ok', JSON.stringify(r.body));
    }
  });

  it('/metrics needs the METRICS_TOKEN when one is set', async () => {
    for (const as of ['none', 'acme', { authorization: `Bearer ${METRICS_TOKEN}x` }] as const) {
      const r = await cp!.request('GET', '/metrics', { as });
      assert.equal(r.status, 401, JSON.stringify(as));
      assert.equal(r.body.code, 'UNAUTHORIZED');
    }
    const ok = await cp!.request('GET', '/metrics', { as: { authorization: `Bearer ${METRICS_TOKEN}` } });
    assert.equal(ok.status, 200);
    assert.match(String(ok.body), /fleet_http_requests_total/);
  });

  it('an X-Request-Id is kept as the correlation id only when short and plain; otherwise a fresh one is used', async () => {
    const bad = ['x'.repeat(129), 'two words', 'semi;colon', 'ünïcode', '{"json":1}'];
    for (const [i, id] of bad.entries()) {
      const r = await cp!.request('POST', `/v1/hosts/h1/${i % 2 === 0 ? 'cordon' : 'uncordon'}`, { headers: { 'x-request-id': id } });
      assert.equal(r.status, 200, JSON.stringify(r.body));
    }
    const events = await cp!.service.store.readStream('host-h1');
    const ids = events.map((e) => e.metadata?.correlationId);
    assert.equal(ids[0], 'deploy-42:step.1', 'a plain id is kept');
    const later = ids.slice(1);
    assert.equal(later.length, bad.length, JSON.stringify(ids));
    for (const id of later) assert.match(String(id), /^[0-9a-f-]{36}$/, `replaced by a generated id: ${String(id)}`);
  });

  it('event streams per caller are capped: one more gets 429 TOO_MANY_EVENT_STREAMS; another tenant is not affected', async () => {
    const feed = (as: KeyName): Promise<Response> => {
      const ctl = new AbortController();
      open.push({ close: () => ctl.abort() });
      return fetch(`${base}/v1/events`, { headers: { authorization: `Bearer ${keyOf(as)}` }, signal: ctl.signal });
    };
    const a1 = await feed('acme');
    const a2 = await feed('acme');
    assert.equal(a1.status, 200);
    assert.equal(a2.status, 200);
    const a3 = await feed('acme');
    assert.equal(a3.status, 429);
    assert.equal(((await a3.json()) as { code: string }).code, 'TOO_MANY_EVENT_STREAMS');
    const g1 = await feed('globex');
    assert.equal(g1.status, 200);
    // Closing one frees its place.
    await a1.body!.cancel();
    const deadline = Date.now() + 10_000;
    let again: Response;
    for (;;) {
      again = await feed('acme');
      if (again.status === 200 || Date.now() > deadline) break;
      await again.body?.cancel();
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(again.status, 200);
  });

  it('websocket sessions are capped per VM and per caller before the upgrade (429 TOO_MANY_SESSIONS)', async () => {
    const connect = (path: string, as: KeyName): Promise<WebSocket> =>
      withTimeout(
        new Promise<WebSocket>((resolve, reject) => {
          const ws = new WebSocket(`${base.replace('http', 'ws')}${path}`, { headers: { authorization: `Bearer ${keyOf(as)}` } });
          open.push({ close: () => ws.terminate() });
          ws.once('open', () => resolve(ws));
          ws.once('unexpected-response', (_req, res) => {
            const chunks: Buffer[] = [];
            res.on('data', (c: Buffer) => chunks.push(c));
            res.on('end', () =>
              reject(
                Object.assign(new Error(`handshake ${res.statusCode}`), {
                  status: res.statusCode,
                  body: JSON.parse(Buffer.concat(chunks).toString()),
                }),
              ),
            );
          });
          ws.once('error', reject);
        }),
        10_000,
        `websocket ${path}`,
      );
    const refused = async (p: Promise<unknown>, scope: string): Promise<void> => {
      await assert.rejects(p, (err: { status?: number; body?: { code?: string; details?: { scope?: string } } }) => {
        assert.equal(err.status, 429);
        assert.equal(err.body?.code, 'TOO_MANY_SESSIONS');
        assert.equal(err.body?.details?.scope, scope);
        return true;
      });
    };
    const s1 = await connect('/v1/vms/vm-a/exec', 'acme');
    await connect('/v1/vms/vm-a/attach', 'acme');
    await refused(connect('/v1/vms/vm-a/exec', 'acme'), 'vm');
    // Another caller's sessions on the same id count apart: a tenant cannot use up someone else's VM.
    await connect('/v1/vms/vm-a/exec', 'globex');
    await connect('/v1/vms/vm-b/exec', 'acme');
    await refused(connect('/v1/vms/vm-c/exec', 'acme'), 'tenant');
    s1.close();
    const deadline = Date.now() + 10_000;
    for (;;) {
      try {
        await connect('/v1/vms/vm-c/exec', 'acme');
        break;
      } catch (err) {
        if ((err as { status?: number }).status !== 429 || Date.now() > deadline) throw err;
        await new Promise((r) => setTimeout(r, 100));
      }
    }
  });

  it('frames sent before a session starts are capped: the socket closes with 4008 FRAME_QUEUE_FULL', async () => {
    const ws = new WebSocket(`${base.replace('http', 'ws')}/v1/vms/nope/exec`, { headers: { authorization: `Bearer ${keyOf('globex')}` } });
    open.push({ close: () => ws.terminate() });
    const frames: Array<{ type: string; code?: string }> = [];
    ws.on('message', (raw) => frames.push(JSON.parse((raw as Buffer).toString()) as { type: string; code?: string }));
    await withTimeout(
      new Promise<void>((resolve, reject) => {
        ws.once('open', () => resolve());
        ws.once('error', reject);
      }),
      10_000,
      'open',
    );
    const closed = new Promise<number>((resolve) => ws.once('close', (code) => resolve(code)));
    // One burst: the start frame, then far more frames than the relay holds while the session opens.
    const start = JSON.stringify({ type: 'start', argv: ['cat'] });
    const stdin = JSON.stringify({ type: 'stdin', data: Buffer.from('x').toString('base64') });
    const raw = (ws as unknown as { _socket: import('node:net').Socket })._socket;
    raw.cork();
    ws.send(start);
    for (let i = 0; i < 500; i++) ws.send(stdin);
    raw.uncork();
    const code = await withTimeout(closed, 10_000, 'the close');
    assert.equal(code, 4008, JSON.stringify(frames));
    assert.ok(
      frames.some((f) => f.code === 'FRAME_QUEUE_FULL'),
      JSON.stringify(frames),
    );
  });

  it('the tenant id "admin" is reserved: refused in API_KEYS (naming the variable) and by ApiKeys', () => {
    let message = '';
    try {
      loadConfig({ API_KEYS: `acme:${'k'.repeat(20)},admin:${'s'.repeat(20)}` });
    } catch (err) {
      assert.ok(err instanceof ConfigError);
      message = err.message;
    }
    assert.match(message, /API_KEYS: entry "admin": the tenant id "admin" is reserved/);
    assert.doesNotMatch(message, /sssssssssss/);
    assert.throws(() => new ApiKeys([{ key: 'k'.repeat(20), tenant: 'admin', admin: false }]), /reserved|admin key's alone/);
    assert.throws(() => new ApiKeys([{ key: 'k'.repeat(20), tenant: 'root', admin: true }]), /admin key's alone/);
  });
});
