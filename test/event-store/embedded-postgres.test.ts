import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { freePort, LEGACY_PASSWORD, startEmbeddedPostgres } from '../../src/adapters/postgres/embedded.js';

/** The embedded default on its own data directories (not the shared test server). */

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

async function query(url: string, sql: string): Promise<pg.QueryResult> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return await client.query(sql);
  } finally {
    await client.end();
  }
}

describe('embedded Postgres', { timeout: 180_000 }, () => {
  let root: string;
  before(async () => {
    await fs.mkdir(path.resolve('.tmp'), { recursive: true });
    // Under the project, not /tmp: the postgres user must be able to reach it when we run as root.
    root = await fs.mkdtemp(path.resolve('.tmp', 'embedded-test-'));
  });
  after(async () => {
    await fs.rm(root, { recursive: true, force: true });
  });

  it('initialises once, keeps data between runs, creates the database, and stop leaves nothing running', { timeout: 60_000 }, async () => {
    const dataDir = path.join(root, 'keep');
    const first = await startEmbeddedPostgres({ dataDir, port: await freePort(), database: 'app_db' });
    try {
      assert.match(first.url, /\/app_db$/);
      await query(first.url, 'CREATE TABLE kept (v text); INSERT INTO kept VALUES ($$still here$$)');
    } finally {
      await first.stop();
    }
    assert.equal(alive(first.pid), false, 'postmaster gone after stop()');
    const versionBefore = await fs.stat(path.join(dataDir, 'PG_VERSION'));
    const second = await startEmbeddedPostgres({ dataDir, port: await freePort(), database: 'app_db' });
    try {
      const { rows } = await query(second.url, 'SELECT v FROM kept');
      assert.deepEqual(rows, [{ v: 'still here' }]);
      const versionAfter = await fs.stat(path.join(dataDir, 'PG_VERSION'));
      assert.equal(versionAfter.mtimeMs, versionBefore.mtimeMs, 'not initialised a second time');
    } finally {
      await second.stop();
    }
    assert.equal(alive(second.pid), false);
    await second.stop(); // idempotent
  });

  it('recovers from a run killed with SIGKILL (orphaned server, stale postmaster.pid)', { timeout: 90_000 }, async () => {
    const dataDir = path.join(root, 'killed');
    const port = await freePort();
    const script = `
      import { startEmbeddedPostgres } from ${JSON.stringify(path.resolve('src/adapters/postgres/embedded.ts'))};
      const s = await startEmbeddedPostgres({ dataDir: ${JSON.stringify(dataDir)}, port: ${port} });
      process.stdout.write(String(s.pid) + '\\n');
      process.kill(process.pid, 'SIGKILL');
    `;
    const child = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    let out = '';
    child.stdout.on('data', (d: Buffer) => (out += d.toString()));
    await new Promise((resolve) => child.on('exit', resolve));
    const orphan = Number.parseInt(out.trim(), 10);
    assert.ok(Number.isInteger(orphan), `child printed the postmaster pid, got ${JSON.stringify(out)}`);
    try {
      assert.ok(alive(orphan), 'the killed run left its server behind');
      await fs.access(path.join(dataDir, 'postmaster.pid'));
      const again = await startEmbeddedPostgres({ dataDir, port });
      try {
        const { rows } = await query(again.url, 'SELECT 1 AS ok');
        assert.deepEqual(rows, [{ ok: 1 }]);
        assert.equal(alive(orphan), false, 'the orphan was stopped');
      } finally {
        await again.stop();
      }
    } finally {
      if (alive(orphan)) process.kill(orphan, 'SIGKILL');
    }
  });

  it('a stale postmaster.pid naming a dead process does not stop the start', { timeout: 60_000 }, async () => {
    const dataDir = path.join(root, 'stale');
    const s1 = await startEmbeddedPostgres({ dataDir, port: await freePort() });
    await s1.stop();
    // the pid of a process that has exited
    const dead = spawn(process.execPath, ['-e', '0']);
    await new Promise((r) => dead.on('exit', r));
    await fs.writeFile(path.join(dataDir, 'postmaster.pid'), `${dead.pid}\n${dataDir}\n`);
    const s2 = await startEmbeddedPostgres({ dataDir, port: await freePort() });
    await s2.stop();
  });

  it('a data directory in use by a running instance is refused, and that instance is left alone', { timeout: 60_000 }, async () => {
    const dataDir = path.join(root, 'busy');
    const running = await startEmbeddedPostgres({ dataDir, port: await freePort() });
    try {
      await assert.rejects(
        startEmbeddedPostgres({ dataDir, port: await freePort() }),
        (err: Error & { code?: string }) => err.code === 'EMBEDDED_PG_IN_USE',
      );
      const { rows } = await query(running.url, 'SELECT 1 AS ok');
      assert.deepEqual(rows, [{ ok: 1 }]);
    } finally {
      await running.stop();
    }
  });

  it('a taken port is a clear error', { timeout: 30_000 }, async () => {
    const blocker = net.createServer();
    await new Promise<void>((r) => blocker.listen(0, '127.0.0.1', () => r()));
    const port = (blocker.address() as net.AddressInfo).port;
    try {
      await assert.rejects(startEmbeddedPostgres({ dataDir: path.join(root, 'port'), port }), (err: Error & { code?: string }) => {
        assert.equal(err.code, 'EMBEDDED_PG_PORT_IN_USE');
        assert.match(err.message, new RegExp(`port ${port}`));
        return true;
      });
    } finally {
      blocker.close();
    }
  });

  it('a data directory holding something else is refused, untouched', { timeout: 30_000 }, async () => {
    const dataDir = path.join(root, 'other');
    await fs.mkdir(dataDir, { recursive: true });
    await fs.writeFile(path.join(dataDir, 'notes.txt'), 'mine');
    await assert.rejects(
      startEmbeddedPostgres({ dataDir, port: await freePort() }),
      (err: Error & { code?: string }) => err.code === 'EMBEDDED_PG_DATA_DIR',
    );
    assert.equal(await fs.readFile(path.join(dataDir, 'notes.txt'), 'utf8'), 'mine');
  });

  it('runs as the postgres user when we are root', { timeout: 30_000 }, async (t) => {
    if (typeof process.getuid !== 'function' || process.getuid() !== 0) {
      t.skip('not running as root');
      return;
    }
    const dataDir = path.join(root, 'root');
    const s = await startEmbeddedPostgres({ dataDir, port: await freePort() });
    try {
      const status = await fs.readFile(`/proc/${s.pid}/status`, 'utf8');
      const uid = Number(/^Uid:\s+(\d+)/m.exec(status)?.[1]);
      assert.notEqual(uid, 0, 'postgres does not run as root');
      assert.equal(os.userInfo().uid, 0);
    } finally {
      await s.stop();
    }
  });

  const refused = async (url: string): Promise<string | undefined> => {
    const client = new pg.Client({ connectionString: url });
    client.on('error', () => undefined);
    try {
      await client.connect();
      return undefined;
    } catch (err) {
      return (err as { code?: string }).code;
    } finally {
      await client.end().catch(() => undefined);
    }
  };
  const withPassword = (url: string, password: string): string => {
    const u = new URL(url);
    u.password = password;
    return u.toString();
  };

  it(
    'has a random superuser password: the given one works, the old constant does not; without one it is kept beside the data dir (0600)',
    { timeout: 60_000 },
    async () => {
      const given = `pw-${randomBytes(12).toString('hex')}`;
      const s = await startEmbeddedPostgres({ dataDir: path.join(root, 'pw'), port: await freePort(), password: given });
      try {
        assert.equal(new URL(s.url).password, given);
        await query(s.url, 'SELECT 1');
        assert.equal(await refused(withPassword(s.adminUrl, LEGACY_PASSWORD)), '28P01', "the constant password 'postgres' is refused");
      } finally {
        await s.stop();
      }
      const dataDir = path.join(root, 'pw-default');
      const d = await startEmbeddedPostgres({ dataDir, port: await freePort() });
      try {
        const kept = (await fs.readFile(`${dataDir}.password`, 'utf8')).trim();
        assert.equal((await fs.stat(`${dataDir}.password`)).mode & 0o777, 0o600);
        assert.ok(kept.length >= 24 && kept !== LEGACY_PASSWORD);
        assert.equal(new URL(d.url).password, kept);
        assert.equal(await refused(withPassword(d.adminUrl, LEGACY_PASSWORD)), '28P01');
      } finally {
        await d.stop();
      }
    },
  );

  it(
    'moves a data directory made with the old constant password to the generated one on start, data kept',
    { timeout: 90_000 },
    async () => {
      const dataDir = path.join(root, 'legacy');
      // What every data directory made before this change has: initdb with the constant password.
      const old = await startEmbeddedPostgres({ dataDir, port: await freePort(), database: 'app_db', password: LEGACY_PASSWORD });
      try {
        await query(old.url, 'CREATE TABLE kept (v text); INSERT INTO kept VALUES ($$from before$$)');
      } finally {
        await old.stop();
      }
      const fresh = `pw-${randomBytes(12).toString('hex')}`;
      const s = await startEmbeddedPostgres({ dataDir, port: await freePort(), database: 'app_db', password: fresh });
      try {
        assert.deepEqual((await query(s.url, 'SELECT v FROM kept')).rows, [{ v: 'from before' }]);
        assert.equal(await refused(withPassword(s.adminUrl, LEGACY_PASSWORD)), '28P01', 'the constant password no longer works');
      } finally {
        await s.stop();
      }
      // A password that is neither is a clear error, not a hang.
      await assert.rejects(
        startEmbeddedPostgres({ dataDir, port: await freePort(), password: 'not-the-one-for-this-dir' }),
        (err: Error & { code?: string }) => err.code === 'EMBEDDED_PG_AUTH',
      );
    },
  );

  it(
    'as root, reaches a data dir under a 0700 directory without changing the mode of any ancestor, and gives the server none of our environment',
    { timeout: 60_000 },
    async (t) => {
      if (typeof process.getuid !== 'function' || process.getuid() !== 0) {
        t.skip('not running as root');
        return;
      }
      const closed = path.join(root, 'private');
      await fs.mkdir(closed, { mode: 0o700 });
      await fs.chmod(closed, 0o700);
      const dataDir = path.join(closed, 'nested', 'pg');
      await fs.mkdir(path.dirname(dataDir), { mode: 0o700 });
      const ancestors: string[] = [];
      for (let d = path.dirname(dataDir); d !== path.dirname(d); d = path.dirname(d)) ancestors.push(d);
      const before = new Map(await Promise.all(ancestors.map(async (d) => [d, (await fs.stat(d)).mode] as const)));
      process.env.TOKEN_ENCRYPTION_KEY_PROBE = 'must-not-reach-postgres';
      let s;
      try {
        s = await startEmbeddedPostgres({ dataDir, port: await freePort() });
      } finally {
        delete process.env.TOKEN_ENCRYPTION_KEY_PROBE;
      }
      try {
        await query(s.url, 'SELECT 1');
        for (const d of ancestors) assert.equal((await fs.stat(d)).mode, before.get(d), `mode of ${d} unchanged`);
        const environ = (await fs.readFile(`/proc/${s.pid}/environ`, 'utf8')).split('\0');
        assert.ok(!environ.some((e) => e.startsWith('TOKEN_ENCRYPTION_KEY_PROBE=')), 'the server does not inherit our environment');
      } finally {
        await s.stop();
      }
    },
  );
});
