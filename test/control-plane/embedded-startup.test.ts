import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { pino } from 'pino';
import { startLocalAgent } from '../../src/adapters/local-agent.js';
import { freePort, LEGACY_PASSWORD } from '../../src/adapters/postgres/embedded.js';
import { loadOrCreateSecrets } from '../../src/adapters/secrets.js';
import { prepareImages, REPO_ROOT, uniquePrefix, uniqueSubnet } from '../agent/harness.js';

/**
 * The embedded default's own start-up: the generated secrets (the Postgres
 * password among them), keys printed only on the start that makes them, the
 * `keys` command, and a local agent that gets none of the control plane's
 * secrets in its environment.
 */

async function runUntil(
  args: string[],
  env: Record<string, string>,
  ready: (out: string) => boolean,
  timeoutMs: number,
): Promise<{ out: string; code: number | null }> {
  const child = spawn(process.execPath, ['--import', 'tsx', ...args], {
    cwd: REPO_ROOT,
    env: { PATH: process.env.PATH ?? '/usr/bin:/bin', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (out += d.toString()));
  const exited = new Promise<number | null>((r) => child.once('exit', (c) => r(c)));
  const deadline = Date.now() + timeoutMs;
  let done = false;
  void exited.then(() => (done = true));
  while (!done && !ready(out) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 200));
  if (!done) child.kill('SIGTERM');
  const t = setTimeout(() => child.kill('SIGKILL'), 30_000);
  const code = await exited;
  clearTimeout(t);
  return { out, code };
}

describe('embedded default start-up', { timeout: 300_000 }, () => {
  let root: string;
  before(async () => {
    await fs.mkdir(path.resolve('.tmp'), { recursive: true });
    root = await fs.mkdtemp(path.resolve('.tmp', 'startup-test-'));
  });
  after(async () => {
    await fs.rm(root, { recursive: true, force: true });
  });

  it('secrets.json written before the Postgres password existed gets one added, the other keys kept', async () => {
    const dir = path.join(root, 'old-secrets');
    await fs.mkdir(dir);
    const old = {
      token_encryption_key: randomBytes(32).toString('base64'),
      admin_api_key: 'adm_old',
      demo_api_key: 'demo_old',
      local_agent_token: 'tok_old',
    };
    await fs.writeFile(path.join(dir, 'secrets.json'), JSON.stringify(old), { mode: 0o600 });
    const loaded = await loadOrCreateSecrets(dir);
    assert.equal(loaded.created, false);
    assert.deepEqual({ ...loaded.secrets, embedded_pg_password: undefined }, { ...old, embedded_pg_password: undefined });
    assert.ok(loaded.secrets.embedded_pg_password.length >= 24);
    assert.deepEqual((await loadOrCreateSecrets(dir)).secrets, loaded.secrets, 'kept, not regenerated');
    assert.equal((await fs.stat(path.join(dir, 'secrets.json'))).mode & 0o777, 0o600);
  });

  it(
    'prints the keys on the first start only; the Postgres password is generated, and `fleet keys` shows the keys',
    { timeout: 240_000 },
    async () => {
      const dataDir = path.join(root, 'data');
      const env = {
        DATA_DIR: dataDir,
        PORT: String(await freePort()),
        EMBEDDED_PG_PORT: String(await freePort()),
        START_LOCAL_AGENT: 'false',
        LOG_LEVEL: 'info',
        NODE_ENV: 'production',
      };
      const first = await runUntil(
        ['src/main.ts'],
        env,
        (o) => /export E2B_API_KEY=\S+\n/.test(o) || /"ready|start-up failed/.test(o),
        120_000,
      );
      const secrets = JSON.parse(await fs.readFile(path.join(dataDir, 'secrets.json'), 'utf8')) as Record<string, string>;
      assert.ok(first.out.includes(secrets.admin_api_key!), `first start prints the admin key:\n${first.out.slice(-2000)}`);
      assert.ok(first.out.includes(secrets.demo_api_key!));
      assert.equal(first.code, 0, first.out.slice(-2000));
      // What points the stock e2b SDK here (docs/e2b-compatibility.md), the key with the demo key.
      assert.match(first.out, /^export E2B_API_URL=http:\/\/127\.0\.0\.1:\d+\/e2b$/m);
      // envd through the in-process ingress (PORT+1 by default), routed by the SDK's E2b-Sandbox-Id header.
      assert.match(first.out, new RegExp(`^export E2B_SANDBOX_URL=http://127\\.0\\.0\\.1:${Number(env.PORT) + 1}$`, 'm'));
      assert.ok(first.out.includes(`export E2B_API_KEY=${secrets.demo_api_key!}\n`));

      const second = await runUntil(
        ['src/main.ts'],
        env,
        (o) => /export E2B_SANDBOX_URL=\S+\n/.test(o) || /start-up failed/.test(o),
        120_000,
      );
      assert.match(second.out, /generated keys are shown by: npm run fleet -- keys/, second.out.slice(-2000));
      assert.ok(!second.out.includes(secrets.admin_api_key!), 'a later start does not print the admin key');
      assert.ok(!second.out.includes(secrets.demo_api_key!), 'nor the demo key');
      assert.match(second.out, /^export E2B_API_URL=\S+\/e2b$/m, 'the E2B lines are printed on every start');
      assert.equal(second.code, 0);

      // Postgres was initialised with the generated password, not the constant one.
      assert.ok(secrets.embedded_pg_password && secrets.embedded_pg_password !== LEGACY_PASSWORD);
      const keys = await runUntil(['src/cli/fleet.ts', 'keys'], { DATA_DIR: dataDir }, () => false, 60_000);
      assert.equal(keys.code, 0, keys.out);
      assert.ok(keys.out.includes(secrets.admin_api_key!) && keys.out.includes(secrets.demo_api_key!), keys.out);
      assert.ok(!keys.out.includes(secrets.token_encryption_key!), 'keys shows API keys, not the encryption key');

      // The server is down now; start it as the CLI would and try the constant password.
      const audit = await runUntil(
        ['src/cli/fleet.ts', 'audit', 'host-local'],
        { DATA_DIR: dataDir, EMBEDDED_PG_PORT: env.EMBEDDED_PG_PORT },
        () => false,
        90_000,
      );
      assert.match(audit.out, /host-local has no events|event\(s\)/, audit.out);
      const probe = await runUntil(
        [
          '--input-type=module',
          '-e',
          `
        import { startEmbeddedPostgres } from ${JSON.stringify(path.join(REPO_ROOT, 'src/adapters/postgres/embedded.ts'))};
        import pg from 'pg';
        const s = await startEmbeddedPostgres({ dataDir: ${JSON.stringify(path.join(dataDir, 'pg'))}, port: ${env.EMBEDDED_PG_PORT}, password: ${JSON.stringify(secrets.embedded_pg_password)} });
        const c = new pg.Client({ host: '127.0.0.1', port: ${env.EMBEDDED_PG_PORT}, user: 'postgres', password: ${JSON.stringify(LEGACY_PASSWORD)}, database: 'postgres' });
        c.on('error', () => {});
        const code = await c.connect().then(() => 'connected', (e) => e.code);
        await c.end().catch(() => {});
        await s.stop();
        process.stdout.write('constant password: ' + code + '\\n');
      `,
        ],
        {},
        (o) => /constant password:/.test(o),
        90_000,
      );
      assert.match(probe.out, /constant password: 28P01/, probe.out);
    },
  );

  it(
    'starts the local agent with its own settings only: no admin key, encryption key or database URL in its environment',
    { timeout: 120_000 },
    async (t) => {
      if (process.getuid?.() !== 0) {
        t.skip('the host agent needs root');
        return;
      }
      const images = await prepareImages();
      if ('skip' in images) {
        t.skip(images.skip);
        return;
      }
      const dataDir = path.join(root, 'local');
      await fs.mkdir(path.join(dataDir, 'agent', 'images'), { recursive: true });
      // The base image is already built for the test run: no second build here.
      await fs.symlink(path.join(images.imageDir, 'base'), path.join(dataDir, 'agent', 'images', 'base'));
      const prefix = uniquePrefix();
      const controlPlaneEnv = {
        ...process.env,
        ADMIN_API_KEY: `adm_${randomBytes(16).toString('hex')}`,
        TOKEN_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
        DATABASE_URL: 'postgres://fleet:dbsecret@127.0.0.1:1/fleet',
        API_KEYS: `acme:${randomBytes(16).toString('hex')}`,
        AGENT_BRIDGE_PREFIX: prefix,
        AGENT_SUBNET: uniqueSubnet(),
        AGENT_LOG_LEVEL: 'warn',
        // The README's `CRIU_PATH=… npm start`: the agent's CRIU reaches it ('off' keeps this start free of criu check).
        CRIU_PATH: 'off',
      };
      const agent = await startLocalAgent({
        dataDir,
        port: await freePort(),
        token: randomBytes(24).toString('base64url'),
        logger: pino({ level: 'silent' }),
        env: controlPlaneEnv,
      });
      try {
        const environ = (await fs.readFile(`/proc/${agent.pid}/environ`, 'utf8')).split('\0').filter(Boolean);
        const names = environ.map((e) => e.slice(0, e.indexOf('=')));
        for (const secret of ['ADMIN_API_KEY', 'TOKEN_ENCRYPTION_KEY', 'DATABASE_URL', 'API_KEYS'])
          assert.ok(!names.includes(secret), `${secret} is not in the agent's environment`);
        assert.ok(!environ.some((e) => e.includes(controlPlaneEnv.TOKEN_ENCRYPTION_KEY) || e.includes(controlPlaneEnv.ADMIN_API_KEY)));
        assert.ok(names.includes('AGENT_TOKEN') && names.includes('AGENT_DATA_DIR'), names.join(' '));
        assert.ok(environ.includes(`AGENT_BRIDGE_PREFIX=${prefix}`), 'its own AGENT_* settings pass through');
        assert.ok(environ.includes('CRIU_PATH=off'), 'and CRIU_PATH');
        const r = await fetch(`${agent.url}/healthz`);
        assert.equal(r.status, 200);
      } finally {
        await agent.stop();
        const cg = '/sys/fs/cgroup';
        for (const c of await fs.readdir(cg).catch(() => [] as string[]))
          await fs.rmdir(path.join(cg, c, `fleet-${prefix}`)).catch(() => undefined);
        await fs.rmdir(path.join(cg, `fleet-${prefix}`)).catch(() => undefined);
      }
    },
  );
  it(
    '/readyz is 503 naming the local host until the local agent is registered; at the first 200 a create finds it',
    { timeout: 180_000 },
    async (t) => {
      if (process.getuid?.() !== 0) {
        t.skip('the host agent needs root');
        return;
      }
      const images = await prepareImages();
      if ('skip' in images) {
        t.skip(images.skip);
        return;
      }
      const dataDir = path.join(root, 'ready');
      await fs.mkdir(path.join(dataDir, 'agent', 'images'), { recursive: true });
      await fs.symlink(path.join(images.imageDir, 'base'), path.join(dataDir, 'agent', 'images', 'base'));
      const prefix = uniquePrefix();
      const port = await freePort();
      const admin = `adm_${randomBytes(16).toString('hex')}`;
      const child = spawn(process.execPath, ['--import', 'tsx', 'src/main.ts'], {
        cwd: REPO_ROOT,
        env: {
          PATH: process.env.PATH ?? '/usr/bin:/bin',
          DATA_DIR: dataDir,
          PORT: String(port),
          EMBEDDED_PG_PORT: String(await freePort()),
          LOCAL_AGENT_PORT: String(await freePort()),
          ADMIN_API_KEY: admin,
          AGENT_BRIDGE_PREFIX: prefix,
          AGENT_SUBNET: uniqueSubnet(),
          LOG_LEVEL: 'warn',
        },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      child.stdout.on('data', (d: Buffer) => (out += d.toString()));
      child.stderr.on('data', (d: Buffer) => (out += d.toString()));
      const exited = new Promise<void>((r) => child.once('exit', () => r()));
      try {
        const seen: string[] = [];
        const deadline = Date.now() + 150_000;
        for (;;) {
          assert.ok(Date.now() < deadline && child.exitCode === null, `never ready:\n${out.slice(-2000)}`);
          const r = await fetch(`http://127.0.0.1:${port}/readyz`, { headers: { authorization: `Bearer ${admin}` } }).catch(
            () => undefined,
          );
          if (r?.status === 503) {
            const body = (await r.json()) as { checks: Record<string, string> };
            if (body.checks.local_host !== 'ok') seen.push(body.checks.local_host ?? '');
          } else if (r?.status === 200) break;
          await new Promise((res) => setTimeout(res, 50));
        }
        const hosts = (await (
          await fetch(`http://127.0.0.1:${port}/v1/hosts`, { headers: { authorization: `Bearer ${admin}` } })
        ).json()) as {
          hosts: { id: string }[];
        };
        assert.deepEqual(
          hosts.hosts.map((h) => h.id),
          ['local'],
          'ready means the local host can take a create',
        );
        assert.ok(seen.length > 0 && seen.every((s) => /local host agent is starting/.test(s)), `503s seen: ${seen.join(' | ')}`);
      } finally {
        child.kill('SIGTERM');
        const kill = setTimeout(() => child.kill('SIGKILL'), 30_000);
        await exited;
        clearTimeout(kill);
        const cg = '/sys/fs/cgroup';
        for (const c of await fs.readdir(cg).catch(() => [] as string[]))
          await fs.rmdir(path.join(cg, c, `fleet-${prefix}`)).catch(() => undefined);
        await fs.rmdir(path.join(cg, `fleet-${prefix}`)).catch(() => undefined);
      }
    },
  );
});
