import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { after, before, describe, it, type TestContext } from 'node:test';
import pino from 'pino';
import { startIngress, type RunningIngress } from '../../src/adapters/ingress/ingress.js';
import type { RunningAgent } from '../agent/harness.js';
import {
  eventually,
  registerHost,
  startCheckedFleet,
  startControlPlane,
  type AgentFleet,
  type ControlPlane,
  type Reply,
} from '../support/control-plane.js';

/**
 * The first request to a paused VM resumes it (a real agent with CRIU from
 * CRIU_PATH): held until the VM runs, then answered by the sandbox; three
 * concurrent first requests cause one resume.
 */

const criu = process.env.CRIU_PATH;
const noCriu = !criu || !existsSync(criu) || spawnSync(criu, ['check']).status !== 0 ? 'a working CRIU at CRIU_PATH' : undefined;
if (noCriu && process.env.CI === 'true') it('CRIU is available in CI', () => assert.fail(`missing: ${noCriu}`));

const DOMAIN = 'wake.test';
// busybox httpd forks per connection, so concurrent requests are all answered.
const STARTUP =
  'mkdir -p /www; (i=0; while true; do i=$((i+1)); echo "count $i" > /www/c.tmp; mv /www/c.tmp /www/index.html; sleep 0.05; done) >/dev/null 2>&1 &\n' +
  'httpd -p 8080 -h /www\n';

function ok(r: Reply, status = 200): any {
  assert.equal(r.status, status, JSON.stringify(r.body));
  return r.body;
}

describe('ingress resumes a paused VM on its first request', { timeout: 300_000 }, () => {
  let skip: string | undefined = noCriu;
  let fleet: AgentFleet | undefined;
  let cp: ControlPlane | undefined;
  let ingress: RunningIngress | undefined;
  let bare: RunningIngress | undefined;
  const agents: RunningAgent[] = [];
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };
  const hit = (via: RunningIngress, host: string, token: string): Promise<{ status: number; body: string }> =>
    new Promise((resolve, reject) => {
      const url = new URL(via.url);
      const req = httpRequest(
        { host: url.hostname, port: url.port, path: '/', headers: { host, 'x-traffic-token': token }, agent: false, timeout: 90_000 },
        (res) => {
          let body = '';
          res.setEncoding('utf8');
          res.on('data', (c: string) => (body += c));
          res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
        },
      );
      req.on('error', reject);
      req.end();
    });

  before(async () => {
    if (skip) return;
    const started = await startCheckedFleet(1);
    ({ fleet, skip } = started);
    agents.push(...started.agents);
    if (skip) return;
    cp = await startControlPlane({ env: { INGRESS_DOMAIN: DOMAIN, RECONCILER_ENABLED: 'false', EXEC_DEFAULT_TIMEOUT_MS: '20000' } });
    ok(await registerHost(cp, 'h1', agents[0]!), 201);
    const common = {
      pool: cp.service.pool,
      domain: DOMAIN,
      host: '127.0.0.1',
      port: 0,
      routeCacheMs: 1000,
      activityFlushMs: 3_600_000,
      recordActivity: cp.service.recordIngressActivity,
      logger: pino({ level: 'silent' }),
    };
    ingress = await startIngress({ ...common, wake: cp.service.resumeVm, wakeTimeoutMs: 90_000 });
    // A replica that cannot resume (a separate process without the command side): the paused VM stays paused.
    bare = await startIngress(common);
  });

  after(async () => {
    await bare?.close();
    await ingress?.close();
    await cp?.close();
    await fleet?.close();
  });

  it('pause, then three concurrent requests to the ingress URL: one resume, every request answered by the sandbox', async (t) => {
    if (guard(t)) return;
    const c = cp!;
    const vm = ok(
      await c.request('POST', '/v1/vms', {
        as: 'acme',
        body: { cpus: 1, ram_mb: 256, startup_script: STARTUP, expose: [{ port: 8080, as: 'web' }] },
      }),
      201,
    );
    const host = `8080-${vm.id}.${DOMAIN}`;
    const token = ok(await c.request('GET', `/v1/vms/${vm.id}/ingress`, { as: 'acme' })).traffic_token as string;
    await new Promise((r) => setTimeout(r, 300));
    assert.match((await hit(ingress!, host, token)).body, /^count \d+/);

    const paused = ok(await c.request('POST', `/v1/vms/${vm.id}/pause`, { as: 'acme' }));
    assert.equal(paused.state, 'paused');
    ok(await c.request('GET', `/v1/vms?after=${paused.position}&limit=1`, { as: 'admin' }));
    await new Promise((r) => setTimeout(r, 1100)); // past the route cache: the ingress sees the VM paused

    const noWake = await hit(bare!, host, token);
    assert.notEqual(noWake.status, 200, 'without a waker the paused VM does not answer');
    // A wrong token wakes nothing.
    assert.equal((await hit(ingress!, host, `${token.slice(0, -1)}${token.endsWith('A') ? 'B' : 'A'}`)).status, 403);
    assert.equal(ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' })).state, 'paused');

    const answers = await Promise.all([1, 2, 3].map(() => hit(ingress!, host, token)));
    for (const a of answers) {
      assert.equal(a.status, 200, a.body);
      assert.match(a.body, /^count \d+/);
    }
    // The read model follows the resume's events.
    await eventually(async () => ok(await c.request('GET', `/v1/vms/${vm.id}`, { as: 'acme' })).state === 'running', 10_000, 'running');
    const events = (await c.service.store.readStream(`vm-${vm.id}`)).map((e) => e.type);
    assert.equal(events.filter((e) => e === 'VmResumed').length, 1, 'one resume for three first requests');
    ok(await c.request('DELETE', `/v1/vms/${vm.id}`, { as: 'acme' }));
  });
});
