import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { join } from 'node:path';
import { request as httpRequest } from 'node:http';
import { after, before, describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import WebSocket from 'ws';
import { startIngress, type RunningIngress } from '../../src/adapters/ingress/ingress.js';
import { getIngressTarget } from '../../src/projections/ingress/ingress.queries.js';
import { freePort } from '../../src/adapters/postgres/embedded.js';
import { REPO_ROOT, type RunningAgent } from '../agent/harness.js';
import {
  handshake,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * The ingress with real agents and sandboxes: busybox httpd, a CGI that
 * prints what the sandbox was sent, and a websocket echo (busybox nc + sh)
 * inside a VM on one host, reached through the proxy by Host and by the
 * E2B headers; private and public ports; the same URL after a cold
 * migration to the other agent; a fork's own token; a destroyed VM's route.
 */

const DOMAIN = 'sbx.test';

// A websocket echo in busybox sh: the handshake, then each masked client text frame (< 126 bytes) back unmasked.
const WS_ECHO = `#!/bin/sh
key=''
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf '%s' "\${line#*:}" | tr -d ' ');; esac
done
accept=$(printf '%s' "\${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1 | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\nSec-WebSocket-Accept: %s\\r\\n\\r\\n' "$accept"
while :; do
  h=$(dd bs=1 count=2 2>/dev/null | xxd -p)
  [ \${#h} -eq 4 ] || exit 0
  op=$(( 0x\${h%??} & 15 ))
  len=$(( 0x\${h#??} & 127 ))
  [ "$op" -eq 8 ] && exit 0
  mask=$(dd bs=1 count=4 2>/dev/null | xxd -p)
  data=$(dd bs=1 count=$len 2>/dev/null | xxd -p | tr -d '\\n')
  out=$(awk -v m="$mask" -v d="$data" 'function h(s){return index("0123456789abcdef",substr(s,1,1))*16+index("0123456789abcdef",substr(s,2,1))-17}
    BEGIN{for(i=0;i<length(d)/2;i++){printf "%02x", xor(h(substr(d,2*i+1,2)), h(substr(m,2*(i%4)+1,2)))}}')
  printf '81%02x%s' "$len" "$out" | xxd -r -p
done
`;
const CGI_ENV = `#!/bin/sh
printf 'Content-Type: text/plain\\r\\n\\r\\n'
env
`;
const SERVE = 'httpd -p 8080 -h /www && httpd -p 8081 -h /www && (setsid nc -ll -p 8082 -e /srv/ws.sh </dev/null >/dev/null 2>&1 &)';

const b64 = (s: string): string => Buffer.from(s).toString('base64');

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

interface Hit {
  status: number;
  body: string;
  json: any;
}

describe('ingress: stable URLs in front of real sandboxes (two agents)', { timeout: 600_000 }, () => {
  let skip: string | undefined;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let ingress: RunningIngress | undefined;
  let replica: RunningIngress | undefined;
  let stale: RunningIngress | undefined;
  const agents: RunningAgent[] = [];
  let vmId = '';
  let token = '';

  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const hit = (opts: { host: string; path?: string; headers?: Record<string, string>; via?: RunningIngress }): Promise<Hit> =>
    new Promise((resolve, reject) => {
      const url = new URL((opts.via ?? ingress!).url);
      const req = httpRequest(
        { host: url.hostname, port: url.port, path: opts.path ?? '/', headers: { host: opts.host, ...opts.headers }, agent: false },
        (res) => {
          let body = '';
          res.setEncoding('utf8');
          res.on('data', (c: string) => (body += c));
          res.on('end', () => {
            let json: unknown;
            try {
              json = JSON.parse(body);
            } catch {
              json = undefined;
            }
            resolve({ status: res.statusCode ?? 0, body, json });
          });
        },
      );
      req.setTimeout(15_000, () => req.destroy(new Error('ingress request timed out')));
      req.on('error', reject);
      req.end();
    });
  const hostOf = (vm: string, port: number): string => `${port}-${vm}.${DOMAIN}`;
  const exec = async (vm: string, cmd: string): Promise<{ exit_code: number; stdout: string; stderr: string }> =>
    ok(await cp!.request('POST', `/v1/vms/${vm}/exec`, { as: 'acme', body: { argv: ['/bin/sh', '-c', cmd] } }));
  const caughtUp = async (position: string | null): Promise<void> => {
    if (position) ok(await cp!.request('GET', `/v1/vms?after=${position}&limit=1`, { as: 'admin' }));
  };
  const wsEcho = async (host: string, headers: Record<string, string>, text: string): Promise<string> => {
    const ws = new WebSocket(`${ingress!.url.replace('http', 'ws')}/echo`, { headers: { host, ...headers } });
    try {
      await handshake(ws);
      const got = new Promise<string>((resolve) => ws.once('message', (m: Buffer) => resolve(m.toString())));
      ws.send(text);
      return await got;
    } finally {
      ws.terminate();
    }
  };

  before(async () => {
    const started = await startCheckedFleet(2);
    ({ fleet, skip } = started);
    agents.push(...started.agents);
    if (skip) {
      process.stderr.write(`ingress tests skipped: ${skip}\n`);
      return;
    }
    cp = await startControlPlane({
      env: {
        INGRESS_DOMAIN: DOMAIN,
        ARTIFACT_PULL_TIMEOUT_MS: '60000',
        RECONCILER_ENABLED: 'false',
        EXEC_DEFAULT_TIMEOUT_MS: '20000',
      },
    });
    ok(await registerHost(cp, 'h1', agents[0]!), 201);
    ok(await registerHost(cp, 'h2', agents[1]!), 201);
    const common = {
      pool: cp.service.pool,
      domain: DOMAIN,
      host: '127.0.0.1',
      port: 0,
      routeCacheMs: 1000,
      // Flushed by the test itself when it looks at activity.
      activityFlushMs: 3_600_000,
      recordActivity: cp.service.recordIngressActivity,
      handlers: cp.service.ingressHandlers,
      logger: pino({ level: 'silent' }),
    };
    ingress = await startIngress(common);
    // A second replica over the same read model: replicas agree because the table is the only state.
    replica = await startIngress({ ...common, routeCacheMs: 0 });
    // One that keeps routes for ten minutes: after a move it must notice the old host refusing and re-read.
    stale = await startIngress({ ...common, routeCacheMs: 600_000 });
  });

  after(async () => {
    await stale?.close();
    await replica?.close();
    await ingress?.close();
    await cp?.close();
    await fleet?.close();
  });

  it('a VM exposing ports gets stable ingress URLs and a traffic token; its server answers by host and by headers', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(
      await c.request('POST', '/v1/vms', {
        as: 'acme',
        body: {
          host_id: 'h1',
          cpus: 1,
          ram_mb: 256,
          expose: [
            { port: 8080, as: 'web' },
            { port: 8081, as: 'open', public: true },
            { port: 8082, as: 'ws' },
          ],
          files: { '/www/index.html': b64('hello from the sandbox\n'), '/www/cgi-bin/env': b64(CGI_ENV), '/srv/ws.sh': b64(WS_ECHO) },
          startup_script: `chmod 755 /www/cgi-bin/env /srv/ws.sh && ${SERVE}`,
        },
      }),
      201,
    );
    vmId = vm.id;
    assert.deepEqual(
      vm.endpoints.map((e: any) => [e.as, e.port, e.url]),
      [
        ['web', 8080, `http://${hostOf(vmId, 8080)}`],
        ['open', 8081, `http://${hostOf(vmId, 8081)}`],
        ['ws', 8082, `http://${hostOf(vmId, 8082)}`],
      ],
    );
    assert.equal(vm.url, `http://${hostOf(vmId, 8080)}`);
    await caughtUp(vm.position);

    const grant = ok(await c.request('GET', `/v1/vms/${vmId}/ingress`, { as: 'acme' }));
    token = grant.traffic_token;
    assert.match(token, /^[A-Za-z0-9_-]{43}$/);
    assert.deepEqual(
      grant.routes.map((r: any) => [r.as, r.port, r.public]),
      [
        ['web', 8080, false],
        ['open', 8081, true],
        ['ws', 8082, false],
      ],
    );
    assert.equal(ok(await c.request('GET', `/v1/vms/${vmId}/ingress`, { as: 'globex' }), 404).code, 'VM_NOT_FOUND');

    const byHost = await hit({ host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
    assert.equal(byHost.status, 200, byHost.body);
    assert.equal(byHost.body, 'hello from the sandbox\n');
    const e2bToken = await hit({ host: hostOf(vmId, 8080), path: '/index.html', headers: { 'e2b-traffic-access-token': token } });
    assert.equal(e2bToken.status, 200);
    const byHeaders = await hit({
      host: 'ingress.internal:443',
      path: '/index.html',
      headers: { 'E2b-Sandbox-Id': vmId, 'E2b-Sandbox-Port': '8080', 'x-traffic-token': token },
    });
    assert.equal(byHeaders.status, 200, byHeaders.body);
    assert.equal(byHeaders.body, 'hello from the sandbox\n');
    const onReplica = await hit({ via: replica!, host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
    assert.equal(onReplica.body, 'hello from the sandbox\n');
  });

  it('runs as its own process (npm run ingress) over the same database, and needs its settings', async (t) => {
    if (guard(t)) return;
    const run = (env: Record<string, string>) =>
      spawn(process.execPath, ['--import', 'tsx', join(REPO_ROOT, 'src/adapters/ingress/main.ts')], {
        cwd: REPO_ROOT,
        env: { PATH: process.env.PATH ?? '/usr/bin:/bin', LOG_LEVEL: 'warn', ...env },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
    const refused = run({ INGRESS_DOMAIN: DOMAIN });
    let said = '';
    refused.stderr.on('data', (d: Buffer) => (said += d.toString()));
    assert.equal(await new Promise((resolve) => refused.once('exit', resolve)), 2);
    assert.match(said, /DATABASE_URL: required/);

    const port = await freePort();
    const proc = run({ DATABASE_URL: cp!.db.url, INGRESS_DOMAIN: DOMAIN, INGRESS_PORT: String(port) });
    let out = '';
    proc.stdout.on('data', (d: Buffer) => (out += d.toString()));
    proc.stderr.on('data', (d: Buffer) => (out += d.toString()));
    try {
      const own = { url: `http://127.0.0.1:${port}` } as RunningIngress;
      const deadline = Date.now() + 60_000;
      let got: Hit | undefined;
      while (!got && Date.now() < deadline) {
        got = await hit({ via: own, host: hostOf(vmId, 8081), path: '/index.html' }).catch(() => undefined);
        if (!got) await new Promise((r) => setTimeout(r, 200));
      }
      assert.equal(got?.status, 200, out);
      assert.equal(got.body, 'hello from the sandbox\n');
      const privateHit = await hit({ via: own, host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
      assert.equal(privateHit.status, 200);
    } finally {
      if (proc.exitCode === null && proc.signalCode === null) {
        const exited = new Promise((resolve) => proc.once('exit', resolve));
        proc.kill('SIGTERM');
        await exited;
      }
    }
  });

  it('private by default: no token is 401, a wrong one 403; the sandbox never sees the token or the routing headers', async (t) => {
    if (guard(t)) return;
    const wrongToken = `${token.slice(0, -1)}${token.endsWith('A') ? 'B' : 'A'}`;
    const none = await hit({ host: hostOf(vmId, 8080), path: '/index.html' });
    assert.equal(none.status, 401);
    assert.equal(none.json.code, 'INGRESS_TOKEN_REQUIRED');
    const wrong = await hit({ host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': wrongToken } });
    assert.equal(wrong.status, 403);
    assert.equal(wrong.json.code, 'INGRESS_TOKEN_INVALID');
    const byHeaders = await hit({ host: 'ingress.internal', headers: { 'E2b-Sandbox-Id': vmId, 'E2b-Sandbox-Port': '8080' } });
    assert.equal(byHeaders.status, 401);

    const env = await hit({
      host: 'ingress.internal',
      path: '/cgi-bin/env',
      headers: { 'E2b-Sandbox-Id': vmId, 'E2b-Sandbox-Port': '8080', 'x-traffic-token': token, 'e2b-traffic-access-token': token },
    });
    assert.equal(env.status, 200, env.body);
    assert.match(env.body, /HTTP_X_FORWARDED_FOR=/, 'the CGI shows the request headers it got');
    assert.ok(!env.body.includes(token), 'the token reached the sandbox');
    assert.doesNotMatch(env.body, /TRAFFIC|E2B_SANDBOX/i);
  });

  it('expose[].public opens one port without a token, and only that one', async (t) => {
    if (guard(t)) return;
    const open = await hit({ host: hostOf(vmId, 8081), path: '/index.html' });
    assert.equal(open.status, 200);
    assert.equal(open.body, 'hello from the sandbox\n');
    assert.equal((await hit({ host: hostOf(vmId, 8080), path: '/index.html' })).status, 401);
  });

  it('a websocket echo passes through, with the token; without it the upgrade is refused', async (t) => {
    if (guard(t)) return;
    assert.equal(await wsEcho(hostOf(vmId, 8082), { 'x-traffic-token': token }, 'hello over ws'), 'hello over ws');
    await assert.rejects(wsEcho(hostOf(vmId, 8082), {}, 'no'), (err: { status?: number }) => err.status === 401);
    assert.equal(
      await wsEcho('ingress.internal', { 'E2b-Sandbox-Id': vmId, 'E2b-Sandbox-Port': '8082', 'x-traffic-token': token }, 'by headers'),
      'by headers',
    );
  });

  it('unknown VMs, unpublished ports and requests naming no sandbox get clear 404 codes', async (t) => {
    if (guard(t)) return;
    const unknown = await hit({ host: hostOf('0123456789abcdef01234567', 8080) });
    assert.equal(unknown.status, 404);
    assert.equal(unknown.json.code, 'INGRESS_VM_NOT_FOUND');
    const port = await hit({ host: hostOf(vmId, 9999), headers: { 'x-traffic-token': token } });
    assert.equal(port.status, 404);
    assert.equal(port.json.code, 'INGRESS_PORT_NOT_PUBLISHED');
    const nothing = await hit({ host: 'ingress.internal' });
    assert.equal(nothing.status, 404);
    assert.equal(nothing.json.code, 'INGRESS_NO_ROUTE');
    const half = await hit({ host: 'ingress.internal', headers: { 'E2b-Sandbox-Id': vmId } });
    assert.equal(half.status, 400);
    assert.equal(half.json.code, 'INGRESS_BAD_ROUTE_HEADERS');
    assert.equal((await hit({ host: `${hostOf(vmId, 8081)}:80`, path: '/index.html' })).status, 200, 'a default port in Host is fine');
    const badLabel = await hit({ host: `x-${vmId}.${DOMAIN}` });
    assert.equal(badLabel.json.code, 'INGRESS_NO_ROUTE');
  });

  it('a registered port handler serves a port no sandbox publishes, behind the token unless it authenticates itself', async (t) => {
    if (guard(t)) return;
    const handlers = cp!.service.ingressHandlers;
    handlers.setPortHandler(49983, {
      request: (target, req, res) => {
        res.setHeader('content-type', 'application/json');
        res.end(JSON.stringify({ ...target, sawToken: req.headers['x-traffic-token'] !== undefined }));
      },
    });
    try {
      const headers = { 'E2b-Sandbox-Id': vmId, 'E2b-Sandbox-Port': '49983' };
      assert.equal((await hit({ host: 'ingress.internal', headers })).status, 401);
      const served = await hit({ host: 'ingress.internal', headers: { ...headers, 'x-traffic-token': token } });
      assert.equal(served.status, 200, served.body);
      assert.deepEqual(
        {
          vmId: served.json.vmId,
          tenant: served.json.tenant,
          hostId: served.json.hostId,
          port: served.json.port,
          saw: served.json.sawToken,
        },
        { vmId, tenant: 'acme', hostId: 'h1', port: 49983, saw: false },
      );
      assert.equal(served.json.hostUrl, agents[0]!.url);
      handlers.setPortHandler(49983, { request: (_t, _req, res) => void res.end('own auth') }, { auth: 'handler' });
      assert.equal((await hit({ host: 'ingress.internal', headers })).body, 'own auth');
      assert.equal((await hit({ host: hostOf('0123456789abcdef01234567', 49983) })).json.code, 'INGRESS_VM_NOT_FOUND');
    } finally {
      handlers.deletePortHandler(49983);
    }
  });

  it('requests and open connections count as activity, one event per VM per flush', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const count = async (): Promise<number> =>
      (await c.service.store.readStream(`vm-${vmId}`)).filter((e) => e.type === 'VmActivityRecorded').length;
    await ingress!.activity.flush();
    const before = await count();
    const stamp = (await c.service.vms.get(vmId, { tenantId: 'acme', admin: false })).last_activity_at;
    for (let i = 0; i < 5; i++) assert.equal((await hit({ host: hostOf(vmId, 8081) })).status, 200);
    assert.deepEqual(ingress!.activity.pending(), [vmId]);
    await ingress!.activity.flush();
    assert.equal(await count(), before + 1, 'five requests, one event');
    const later = (await c.service.vms.get(vmId, { tenantId: 'acme', admin: false })).last_activity_at;
    assert.ok(later > stamp, `${later} after ${stamp}`);

    // An open websocket keeps the VM active across flushes, with no request in between.
    const ws = new WebSocket(`${ingress!.url.replace('http', 'ws')}/`, { headers: { host: hostOf(vmId, 8082), 'x-traffic-token': token } });
    try {
      await handshake(ws);
      await ingress!.activity.flush();
      assert.deepEqual(ingress!.activity.pending(), [vmId], 'still open after a flush');
    } finally {
      ws.terminate();
    }
  });

  it('a fork gets its own token: the source token does not open the fork', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const fork = ok(await c.request('POST', `/v1/vms/${vmId}/fork`, { as: 'acme', body: {} }), 201);
    try {
      assert.equal(fork.endpoints[0].url, `http://${hostOf(fork.id, 8080)}`);
      await caughtUp(fork.position);
      const forkToken = ok(await c.request('GET', `/v1/vms/${fork.id}/ingress`, { as: 'acme' })).traffic_token;
      assert.notEqual(forkToken, token);
      assert.equal((await exec(fork.id, SERVE)).exit_code, 0);
      const withSource = await hit({ host: hostOf(fork.id, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
      assert.equal(withSource.status, 403);
      const withOwn = await hit({ host: hostOf(fork.id, 8080), path: '/index.html', headers: { 'x-traffic-token': forkToken } });
      assert.equal(withOwn.body, 'hello from the sandbox\n');
    } finally {
      ok(await c.request('DELETE', `/v1/vms/${fork.id}`, { as: 'acme' }));
    }
  });

  it('after a cold migrate to the other agent the same URL answers from the new host, with the same token', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const beforeMove = ok(await c.request('GET', `/v1/vms/${vmId}`, { as: 'acme' }));
    const warm = await hit({ via: stale!, host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
    assert.equal(warm.status, 200, 'the long-cache replica holds the route to h1');
    const m = ok(await c.request('POST', `/v1/vms/${vmId}/migrate`, { as: 'acme', body: {} }));
    assert.equal(m.host_id, 'h2');
    const row = ok(await c.request('GET', `/v1/vms/${vmId}?after=${m.position}`, { as: 'acme' }));
    assert.deepEqual(row.endpoints, beforeMove.endpoints, 'the URLs did not change');
    assert.equal(row.url, beforeMove.url);
    assert.equal((await getIngressTarget(c.service.pool, vmId))?.host_id, 'h2');

    // A cold migration restarts nothing in the guest: serve again on the target.
    assert.equal((await exec(vmId, SERVE)).exit_code, 0);
    const moved = await hit({ host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
    assert.equal(moved.status, 200, moved.body);
    assert.equal(moved.body, 'hello from the sandbox\n');
    const viaStale = await hit({ via: stale!, host: hostOf(vmId, 8080), path: '/index.html', headers: { 'x-traffic-token': token } });
    assert.equal(viaStale.status, 200, `a cached route to the old host is re-read: ${viaStale.body}`);
    assert.equal(await wsEcho(hostOf(vmId, 8082), { 'x-traffic-token': token }, 'after the move'), 'after the move');
    const events = (await c.service.store.readStream(`vm-${vmId}`)).map((e) => e.type);
    assert.ok(events.indexOf('IngressAdopted') > events.indexOf('VmMigrated'), events.join(','));
  });

  it("a destroyed VM's routes are gone, on every replica", async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const d = ok(await c.request('DELETE', `/v1/vms/${vmId}`, { as: 'acme' }));
    await caughtUp(d.position);
    assert.equal(await getIngressTarget(c.service.pool, vmId), undefined);
    const gone = await hit({ via: replica!, host: hostOf(vmId, 8081) });
    assert.equal(gone.status, 404);
    assert.equal(gone.json.code, 'INGRESS_VM_NOT_FOUND');
    assert.equal(ok(await c.request('GET', `/v1/vms/${vmId}/ingress`, { as: 'acme' }), 404).code, 'INGRESS_NOT_PUBLISHED');
    const events = (await c.service.store.readStream(`vm-${vmId}`)).map((e) => e.type);
    assert.ok(events.includes('IngressUnpublished'), events.join(','));
  });
});
