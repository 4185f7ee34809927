import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { FastifyInstance } from 'fastify';
import type { Backend } from '../../packages/agent/src/backend.js';
import { mintGrant, verifyGrant } from '../../packages/agent/src/grants.js';
import { buildAgentApp } from '../../packages/agent/src/server.js';
import { AgentConfigError, parseAgentEnv } from '../../packages/agent/src/config.js';

/**
 * The HTTP edge in-process (app.inject): authentication and input
 * validation happen before any backend call, so the backend here refuses
 * to be reached at all — a request that gets past validation by mistake
 * shows up as a 500 and fails the test. The real backend is exercised in
 * host-agent.test.ts.
 */

const TOKEN = 'test-token-0123456789abcdef';
const SECRET = Buffer.from('s'.repeat(32));

const unreachableBackend = new Proxy({} as Backend, {
  get(_t, prop) {
    if (prop === 'kind') return 'process';
    if (prop === 'then') return undefined;
    return () => {
      throw new Error(`backend.${String(prop)} must not be reached by invalid input`);
    };
  },
});

describe('host agent HTTP edge', { timeout: 30_000 }, () => {
  let app: FastifyInstance;
  let dataDir: string;
  const auth = { authorization: `Bearer ${TOKEN}` };

  before(async () => {
    dataDir = await mkdtemp(join(tmpdir(), 'agent-app-'));
    app = await buildAgentApp({
      backend: unreachableBackend,
      config: {
        token: TOKEN,
        grantSecret: SECRET,
        dataDir,
        execDefaultTimeoutMs: 1000,
        execMaxTimeoutMs: 2000,
        outputCapBytes: 1024,
        maxUploadBytes: 1024,
        pullTimeoutMs: 5000,
      },
    });
  });
  after(async () => {
    await app?.close();
    await rm(dataDir, { recursive: true, force: true });
  });

  const routes: Array<[string, string]> = [
    ['GET', '/v1/capacity'],
    ['GET', '/v1/vms'],
    ['POST', '/v1/vms'],
    ['GET', '/v1/vms/a'],
    ['GET', '/v1/vms/a/console'],
    ['DELETE', '/v1/vms/a'],
    ['POST', '/v1/vms/a/exec'],
    ['GET', '/v1/vms/a/exec'],
    ['GET', '/v1/vms/a/attach'],
    ['PUT', '/v1/vms/a/files?path=/x'],
    ['GET', '/v1/vms/a/files?path=/x'],
    ['POST', '/v1/vms/a/agent'],
    ['POST', '/v1/vms/a/checkpoints'],
    ['GET', '/v1/checkpoints'],
    ['DELETE', '/v1/checkpoints/c1'],
    ['POST', '/v1/artifacts/grants'],
    ['POST', '/v1/artifacts/pull'],
    ['POST', '/v1/prune'],
    ['GET', '/v1/vms/a/envd/health'],
    ['POST', '/v1/vms/a/envd/process.Process/Start'],
    ['POST', '/v1/vms/a/envd/files?path=/x'],
    ['GET', '/v1/nonexistent'],
  ];

  it('refuses every route without the right bearer token (401, before any backend call)', async () => {
    const wrong = [
      {},
      { authorization: 'Bearer wrong' },
      { authorization: `Bearer ${TOKEN}x` },
      { authorization: `Bearer ${TOKEN.slice(0, -1)}` },
      { authorization: `Basic ${TOKEN}` },
      { authorization: TOKEN },
    ];
    for (const [method, url] of routes) {
      for (const headers of wrong) {
        const res = await app.inject({ method: method as 'GET', url, headers });
        assert.equal(res.statusCode, 401, `${method} ${url} with ${JSON.stringify(Object.keys(headers))}`);
        const body = res.json<{ code: string; message: string }>();
        assert.equal(body.code, 'UNAUTHORIZED');
        assert.ok(!res.body.includes(TOKEN), 'the token never appears in an answer');
      }
    }
  });

  it('answers /healthz without a token', async () => {
    const res = await app.inject({ method: 'GET', url: '/healthz' });
    assert.equal(res.statusCode, 200);
    assert.equal(res.json().ok, true);
  });

  it('answers an unknown route with 404 NOT_FOUND', async () => {
    const res = await app.inject({ method: 'GET', url: '/v1/nonexistent', headers: auth });
    assert.equal(res.statusCode, 404);
    assert.equal(res.json().code, 'NOT_FOUND');
  });

  const bad: Array<{ method: string; url: string; body?: unknown; raw?: string; type?: string; status?: number; code?: string }> = [
    { method: 'POST', url: '/v1/vms', body: {} },
    { method: 'POST', url: '/v1/vms', body: { name: 'Bad Name' } },
    { method: 'POST', url: '/v1/vms', body: { name: 'ok', image: 'base', checkpoint_id: 'c1' } },
    { method: 'POST', url: '/v1/vms', body: { name: 'ok', cpus: 0 } },
    { method: 'POST', url: '/v1/vms', body: { name: 'ok', expose: [{ port: 70000, as: 'x' }] } },
    { method: 'POST', url: '/v1/vms', raw: '{not json', type: 'application/json' },
    { method: 'POST', url: '/v1/vms', raw: '<vm/>', type: 'application/xml', status: 415, code: 'UNSUPPORTED_MEDIA_TYPE' },
    { method: 'GET', url: `/v1/vms?prefix=${'a'.repeat(80)}` },
    { method: 'GET', url: '/v1/vms/BAD!' },
    { method: 'GET', url: '/v1/vms/ok/console?tail_bytes=0' },
    { method: 'GET', url: '/v1/vms/ok/console?tail_bytes=abc' },
    { method: 'GET', url: `/v1/vms/${'a'.repeat(64)}` },
    { method: 'DELETE', url: '/v1/vms/a..b' },
    { method: 'DELETE', url: '/v1/vms/ok?force=maybe' },
    { method: 'POST', url: '/v1/vms/ok/exec', body: {} },
    { method: 'POST', url: '/v1/vms/ok/exec', body: { argv: [] } },
    { method: 'POST', url: '/v1/vms/ok/exec', body: { argv: ['true'], timeout_ms: -1 } },
    { method: 'POST', url: '/v1/vms/ok/exec', body: { argv: ['true'], cwd: 'relative' } },
    { method: 'POST', url: '/v1/vms/ok/exec', body: { argv: ['true'], stdin: '!!not base64!!' } },
    { method: 'POST', url: '/v1/vms/BAD/exec', body: { argv: ['true'] } },
    { method: 'GET', url: '/v1/vms/ok/exec', code: 'WEBSOCKET_REQUIRED' },
    { method: 'GET', url: '/v1/vms/ok/attach', code: 'WEBSOCKET_REQUIRED' },
    { method: 'PUT', url: '/v1/vms/ok/files', raw: 'x', type: 'application/octet-stream' },
    { method: 'PUT', url: '/v1/vms/ok/files?path=relative', raw: 'x', type: 'application/octet-stream' },
    { method: 'PUT', url: '/v1/vms/ok/files?path=/x&mode=999', raw: 'x', type: 'application/octet-stream' },
    { method: 'GET', url: '/v1/vms/ok/files?path=relative' },
    { method: 'GET', url: '/v1/vms/ok/files' },
    { method: 'POST', url: '/v1/vms/ok/agent', body: {} },
    { method: 'POST', url: '/v1/vms/ok/agent', body: { command: 'x', files: { relative: 'eA==' } } },
    { method: 'POST', url: '/v1/vms/ok/agent', body: { command: 'x', expose: [{ port: 0, as: 'x' }] } },
    { method: 'POST', url: '/v1/vms/ok/checkpoints', body: { live: 'yes' } },
    { method: 'POST', url: '/v1/vms/ok/checkpoints', body: { id: '../x' } },
    { method: 'DELETE', url: '/v1/checkpoints/-x' },
    { method: 'GET', url: '/v1/checkpoints/a%2Fb' },
    { method: 'POST', url: '/v1/artifacts/grants', body: {} },
    { method: 'POST', url: '/v1/artifacts/grants', body: { snapshot_id: 'c1', ttl_s: 999_999 } },
    { method: 'POST', url: '/v1/artifacts/pull', body: {} },
    {
      method: 'POST',
      url: '/v1/artifacts/pull',
      body: { snapshot_id: 'c1', digest: 'abc', from: { url: 'http://127.0.0.1:1', grant: 'g' } },
    },
    {
      method: 'POST',
      url: '/v1/artifacts/pull',
      body: { snapshot_id: 'c1', digest: 'a'.repeat(64), from: { url: 'not a url', grant: 'g' } },
    },
    {
      method: 'POST',
      url: '/v1/artifacts/pull',
      body: { snapshot_id: 'c1', digest: 'a'.repeat(64), from: { url: 'file:///etc/passwd', grant: 'g' } },
    },
    {
      method: 'POST',
      url: '/v1/artifacts/pull',
      body: {
        snapshot_id: 'c1',
        digest: 'a'.repeat(64),
        from: { url: 'http://127.0.0.1:1', grant: 'g' },
        files: { '../etc': 'a'.repeat(64) },
      },
    },
  ];

  it('answers bad input on every route with a 4xx and a stable code, never a 500', async () => {
    for (const c of bad) {
      const res = await app.inject({
        method: c.method as 'GET',
        url: c.url,
        headers: { ...auth, ...(c.type ? { 'content-type': c.type } : {}) },
        ...(c.raw !== undefined ? { payload: c.raw } : c.body !== undefined ? { payload: c.body as object } : {}),
      });
      const label = `${c.method} ${c.url} ${JSON.stringify(c.body ?? c.raw ?? '')}`;
      assert.equal(res.statusCode, c.status ?? 400, `${label} → ${res.statusCode} ${res.body}`);
      const body = res.json<{ code: string; message: string }>();
      assert.equal(body.code, c.code ?? 'VALIDATION_FAILED', label);
      assert.ok(body.message.length > 0, label);
    }
  });

  it('refuses artifact reads without a valid, unexpired grant for that snapshot', async () => {
    const url = '/v1/artifacts/snap1/manifest';
    const none = await app.inject({ method: 'GET', url });
    assert.equal(none.statusCode, 401);
    assert.equal(none.json().code, 'GRANT_INVALID');

    // The host token is not a grant.
    const hostToken = await app.inject({ method: 'GET', url, headers: auth });
    assert.equal(hostToken.statusCode, 403);
    assert.equal(hostToken.json().code, 'GRANT_INVALID');

    const expired = mintGrant(SECRET, 'snap1', Date.now() - 1);
    const r1 = await app.inject({ method: 'GET', url, headers: { authorization: `Bearer ${expired}` } });
    assert.equal(r1.statusCode, 403);
    assert.equal(r1.json().code, 'GRANT_EXPIRED');

    const other = mintGrant(SECRET, 'snap2', Date.now() + 60_000);
    const r2 = await app.inject({
      method: 'GET',
      url: '/v1/artifacts/snap1/files/rootfs.tar',
      headers: { authorization: `Bearer ${other}` },
    });
    assert.equal(r2.statusCode, 403);
    assert.equal(r2.json().code, 'GRANT_INVALID');

    const forged = mintGrant(Buffer.from('x'.repeat(32)), 'snap1', Date.now() + 60_000);
    const r3 = await app.inject({ method: 'GET', url, headers: { authorization: `Bearer ${forged}` } });
    assert.equal(r3.statusCode, 403);
  });
});

describe('artifact grants', () => {
  it('verify only for the snapshot and before the expiry they were minted for', () => {
    const g = mintGrant(SECRET, 'a', 2000);
    assert.deepEqual(verifyGrant(SECRET, g, 'a', 1999), { ok: true });
    assert.deepEqual(verifyGrant(SECRET, g, 'a', 2000), { ok: false, reason: 'expired' });
    assert.deepEqual(verifyGrant(SECRET, g, 'b', 1000), { ok: false, reason: 'wrong_snapshot' });
    const [payload, mac] = g.split('.') as [string, string];
    const tampered = `${Buffer.from(JSON.stringify({ s: 'a', e: 9e15 })).toString('base64url')}.${mac}`;
    assert.deepEqual(verifyGrant(SECRET, tampered, 'a', 1000), { ok: false, reason: 'invalid' });
    assert.deepEqual(verifyGrant(SECRET, `${payload}.`, 'a', 1000), { ok: false, reason: 'invalid' });
    assert.deepEqual(verifyGrant(SECRET, 'garbage', 'a', 1000), { ok: false, reason: 'invalid' });
  });
});

describe('fleet-agent bin', { timeout: 30_000 }, () => {
  it('starts the agent program and refuses a bad configuration by name, without echoing the token', () => {
    const bin = join(import.meta.dirname, '..', '..', 'packages', 'agent', 'bin', 'fleet-agent.mjs');
    const help = spawnSync(process.execPath, [bin, '--help'], { encoding: 'utf8', cwd: tmpdir(), timeout: 20_000 });
    assert.equal(help.status, 0);
    assert.match(help.stdout, /usage: fleet-agent/);
    const bad = spawnSync(process.execPath, [bin], {
      encoding: 'utf8',
      cwd: tmpdir(),
      timeout: 20_000,
      env: { ...process.env, AGENT_TOKEN: 'shorttoken', AGENT_PORT: 'x' },
    });
    assert.equal(bad.status, 2);
    assert.match(bad.stderr, /AGENT_TOKEN: must be at least 16 characters/);
    assert.match(bad.stderr, /AGENT_PORT: must be a port number/);
    assert.ok(!bad.stderr.includes('shorttoken'));
  });
});

describe('agent config', () => {
  it('names each bad variable and never echoes a secret', () => {
    assert.throws(
      () => parseAgentEnv({ AGENT_PORT: 'abc', AGENT_TOKEN: 'short', AGENT_SUBNET: '10.0.0.0', AGENT_ALLOW_CROSS_TENANT: 'perhaps' }),
      (err: unknown) => {
        assert.ok(err instanceof AgentConfigError);
        const text = err.message;
        assert.match(text, /AGENT_PORT: must be/);
        assert.match(text, /AGENT_TOKEN: must be at least 16 characters \(got <redacted>\)/);
        assert.match(text, /AGENT_SUBNET: must be an IPv4 CIDR/);
        assert.match(text, /AGENT_ALLOW_CROSS_TENANT: must be true or false/);
        assert.ok(!text.includes('short'));
        return true;
      },
    );
    assert.throws(() => parseAgentEnv({}), /AGENT_TOKEN: is required/);
    const ok = parseAgentEnv({ AGENT_TOKEN: TOKEN, AGENT_PORT: '0' });
    assert.equal(ok.AGENT_PORT, 0);
    assert.equal(ok.AGENT_HOST, '127.0.0.1');
    assert.equal(ok.AGENT_ALLOW_CROSS_TENANT, false);
    assert.equal(ok.AGENT_LAZY_RESTORE, true, 'restores page memory in after they run unless told not to');
    assert.equal(parseAgentEnv({ AGENT_TOKEN: TOKEN, AGENT_LAZY_RESTORE: 'false' }).AGENT_LAZY_RESTORE, false);
    assert.throws(() => parseAgentEnv({ AGENT_TOKEN: TOKEN, AGENT_LAZY_RESTORE: 'soon' }), /AGENT_LAZY_RESTORE: must be true or false/);
  });
});
