import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, readdir, readFile, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import type { ProcessHandle } from '../../packages/agent/src/backend.js';
import { runTool } from '../../packages/agent/src/backend/process/exec-util.js';
import { spawnViaSpawner } from '../../packages/agent/src/backend/process/guest-process.js';
import { ProcessBackend } from '../../packages/agent/src/backend/process/process-backend.js';
import { buildImage } from '../../packages/agent/src/images.js';

/**
 * The exec spawner (fleet-sandbox serve): execs are forked from one
 * long-lived helper instead of spawned by Node, with the same result as a
 * spawned helper (status, signals, stdio, kill) and a socket only host root
 * can use. Real sandboxes, as in process-backend.test.ts.
 */

function missingFeature(): string | undefined {
  if (process.platform !== 'linux') return 'Linux';
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  if (spawnSync('sh', ['-c', 'command -v gcc']).status !== 0) return 'gcc';
  return undefined;
}
const skip = missingFeature();

async function run(
  h: ProcessHandle,
  input?: Buffer | string,
): Promise<{ exitCode: number | null; signal: string | null; stdout: Buffer; stderr: string }> {
  const out: Buffer[] = [];
  let stderr = '';
  h.stdout.on('data', (d: Buffer) => out.push(d));
  h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
  if (input !== undefined) h.stdin.end(input);
  const timer = setTimeout(() => h.kill('SIGKILL'), 20_000);
  try {
    const st = await h.wait();
    return { ...st, stdout: Buffer.concat(out), stderr };
  } finally {
    clearTimeout(timer);
  }
}

/** Host pids whose command line is exactly `argv`. */
async function hostPids(argv: string[]): Promise<number[]> {
  const want = `${argv.join('\0')}\0`;
  const out: number[] = [];
  for (const e of await readdir('/proc')) {
    if (!/^\d+$/.test(e)) continue;
    if ((await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '')) === want) out.push(Number(e));
  }
  return out;
}

async function ppid(pid: number): Promise<number> {
  const st = await readFile(`/proc/${pid}/stat`, 'utf8');
  return Number(st.slice(st.lastIndexOf(')') + 2).split(' ')[1]);
}

async function findServe(sock: string): Promise<number | undefined> {
  for (const e of await readdir('/proc')) {
    if (!/^\d+$/.test(e)) continue;
    const cmd = (await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '')).split('\0');
    if (cmd[1] === 'serve' && cmd[2] === sock) return Number(e);
  }
  return undefined;
}

describe('exec spawner', { skip, concurrency: false }, () => {
  let root: string;
  let dataDir: string;
  let b: ProcessBackend;
  const prefix = `x${randomBytes(2).toString('hex')}`;
  const ready = (): boolean => (b as unknown as { spawner: { ready: boolean } | null }).spawner?.ready === true;

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'spawner-test-'));
    await buildImage(join(root, 'images'), 'base');
    dataDir = join(root, 'data');
    b = await ProcessBackend.open({
      dataDir,
      imageDir: join(root, 'images'),
      subnet: `10.${250 + (randomBytes(1)[0]! % 5)}.${randomBytes(1)[0]!}.0/24`,
      bridgePrefix: prefix,
      maxSandboxes: 4,
    });
    await b.create({ name: 'sp', cpus: 1, ram_mb: 128, tenant: 't' });
  });

  after(async () => {
    for (const s of await b.list().catch(() => [])) await b.destroy(s.name).catch(() => undefined);
    await b.prune().catch(() => undefined);
    await b.close().catch(() => undefined);
    const links = spawnSync('ip', ['-j', 'link', 'show'], { encoding: 'utf8' }).stdout;
    for (const l of (JSON.parse(links || '[]') as Array<{ ifname: string }>).map((x) => x.ifname.split('@')[0]!)) {
      if (l.startsWith(prefix)) spawnSync('ip', ['link', 'del', l]);
    }
    await rm(root, { recursive: true, force: true });
  });

  test('an exec is forked by the spawner, confined as before, and only host root may use its socket', async () => {
    assert.ok(ready(), 'the spawner is up after open');
    const sock = join(dataDir, 'exec.sock');
    assert.equal((await stat(sock)).mode & 0o777, 0o600);
    const serve = await findServe(sock);
    assert.ok(serve, 'a fleet-sandbox serve process runs');

    const tag = `${1000 + (randomBytes(2).readUInt16BE() % 9000)}`;
    const h = await b.spawn('sp', { argv: ['sleep', tag], stdin: false });
    let guest: number | undefined;
    for (let i = 0; i < 200 && !guest; i++) {
      guest = (await hostPids(['sleep', tag]))[0];
      if (!guest) await new Promise((r) => setTimeout(r, 10));
    }
    assert.ok(guest, 'the guest process is visible on the host');
    const chain: number[] = [];
    for (let p = guest; p > 1 && chain.length < 8; p = await ppid(p)) chain.push(p);
    assert.ok(chain.includes(serve), `the guest descends from the spawner (chain ${chain.join(' <- ')}, spawner ${serve})`);
    assert.ok(!chain.slice(0, chain.indexOf(serve)).includes(process.pid), 'not forked by the agent itself');
    h.kill('SIGKILL');
    assert.equal((await h.wait()).signal, 'SIGKILL');

    const status = await run(await b.spawn('sp', { argv: ['cat', '/proc/self/status'], stdin: false }));
    assert.match(status.stdout.toString(), /NoNewPrivs:\s+1/);
    assert.match(status.stdout.toString(), /Seccomp:\s+2/);
    const env = await run(await b.spawn('sp', { argv: ['env'], env: { ONLY: 'guest' }, stdin: false }));
    assert.deepEqual(env.stdout.toString().trim().split('\n').sort(), [
      'HOME=/root',
      'HOSTNAME=sp',
      'ONLY=guest',
      `PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin`,
    ]);

    // A non-root peer, with the directory and socket opened up for the attempt: refused by the spawner itself.
    const dirMode = (await stat(dataDir)).mode & 0o777;
    await chmod(root, 0o711);
    await chmod(dataDir, 0o711);
    await chmod(sock, 0o666);
    try {
      const probe = spawn(
        process.execPath,
        [
          '-e',
          `const s=require('net').connect(${JSON.stringify(sock)});let n=0;s.on('data',d=>n+=d.length);s.on('error',e=>{if(e.code==='EACCES'||e.code==='ENOENT')console.log('error '+e.code)});s.on('close',()=>{console.log('bytes '+n);process.exit(0)});s.write(Buffer.alloc(4));setTimeout(()=>{console.log('open '+n);process.exit(0)},3000)`,
        ],
        { uid: 65534, gid: 65534, stdio: ['ignore', 'pipe', 'inherit'] },
      );
      let said = '';
      probe.stdout.setEncoding('utf8').on('data', (d: string) => (said += d));
      await new Promise((r) => probe.once('close', r));
      assert.equal(said.trim(), 'bytes 0', 'a non-root peer gets no relay (not even its pid frame)');
    } finally {
      await chmod(sock, 0o600);
      await chmod(dataDir, dirMode);
      await chmod(root, 0o700);
    }
  });

  test('status, signals, stdio and kill are those of a spawned helper', async () => {
    const code = await run(await b.spawn('sp', { argv: ['sh', '-c', 'echo out; echo err >&2; exit 7'], stdin: false }));
    assert.deepEqual([code.exitCode, code.signal, code.stdout.toString(), code.stderr], [7, null, 'out\n', 'err\n']);
    const sig = await run(await b.spawn('sp', { argv: ['sh', '-c', 'kill -TERM $$'], stdin: false }));
    assert.deepEqual([sig.exitCode, sig.signal], [null, 'SIGTERM']);
    const missing = await run(await b.spawn('sp', { argv: ['no-such-program'], stdin: false }));
    assert.equal(missing.exitCode, 127);
    // 3 MiB through cat: stdin and stdout both larger than a pipe, so the relay must not block on either.
    const big = randomBytes(3 << 20);
    const echoed = await run(await b.spawn('sp', { argv: ['cat'], stdin: true }), big);
    assert.equal(echoed.exitCode, 0);
    assert.ok(echoed.stdout.equals(big), `cat returned ${echoed.stdout.length} of ${big.length} bytes intact`);
    // Output written before stdin is read, with stdin pending: no deadlock.
    const first = await run(
      await b.spawn('sp', { argv: ['sh', '-c', 'head -c 200000 /dev/zero; wc -c'], stdin: true }),
      Buffer.alloc(300_000, 1),
    );
    assert.equal(first.stdout.length, 200_000 + '300000\n'.length);
    // No stdin: end of input at once.
    const none = await run(await b.spawn('sp', { argv: ['wc', '-c'], stdin: false }));
    assert.equal(none.stdout.toString().trim(), '0');
    // A signal reaches the guest; a SIGKILL ends it at once.
    const term = await b.spawn('sp', {
      argv: ['sh', '-c', 'trap "echo got-term; exit 3" TERM; while :; do sleep 0.05; done'],
      stdin: false,
    });
    await new Promise((r) => setTimeout(r, 300));
    term.kill('SIGTERM');
    const t = await run(term);
    assert.deepEqual([t.exitCode, t.stdout.toString()], [3, 'got-term\n']);
    const sleeper = await b.spawn('sp', { argv: ['sleep', '60'], stdin: true });
    const t0 = performance.now();
    sleeper.stdin.write('stdin left open\n');
    await new Promise((r) => setTimeout(r, 100));
    sleeper.kill('SIGKILL');
    assert.equal((await sleeper.wait()).signal, 'SIGKILL');
    assert.ok(performance.now() - t0 < 5000);
  });

  test('host tools: the allowed ones run forked by the spawner with a fixed environment; nothing else does', async () => {
    const sock = join(dataDir, 'exec.sock');
    const serve = await findServe(sock);
    assert.ok(serve);
    // runTool (network.ts, firewall.ts, storage.ts) goes through the spawner: ip's parent is a relay of the serve.
    const ip = ['/usr/sbin', '/usr/bin', '/sbin', '/bin'].map((d) => `${d}/ip`).find((p) => existsSync(p))!;
    const ran = await runTool('ip', ['-V']);
    assert.equal(ran.code, 0, ran.stderr);
    assert.match(ran.stdout, /ip/);
    const tree = await run(spawnViaSpawner(sock, ['run', '/bin/busybox', 'sh', '-c', 'true'], {}, false));
    assert.equal(tree.exitCode, null, 'a tool not allowed at the serve start is refused (the relay exits without a status)');
    for (const verb of ['boot', 'serve', 'wait-root', 'start', 'reap', 'mask-ro']) {
      const refused = await run(spawnViaSpawner(sock, [verb, 'x', 'y'], {}, false));
      assert.deepEqual([refused.exitCode, refused.stdout.length], [null, 0], `${verb} is not served`);
    }
    // The tool sees only the fixed PATH (no agent variable), as a spawned one did.
    const env = await run(spawnViaSpawner(sock, ['run', ip, '-V'], { FLEET_E0: '41' }, false));
    assert.equal(env.exitCode, null, 'a run request carrying an environment is refused');
    const parent = await new Promise<number | undefined>((resolve) => {
      const h = spawnViaSpawner(sock, ['run', ip, 'monitor', 'link'], {}, false);
      setTimeout(() => {
        void hostPids([ip, 'monitor', 'link']).then(async (pids) => {
          const p = pids[0] === undefined ? undefined : await ppid(pids[0]);
          const grand = p === undefined ? undefined : await ppid(p);
          const environ = pids[0] === undefined ? '' : await readFile(`/proc/${pids[0]}/environ`, 'utf8');
          assert.equal(environ, 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\0');
          h.kill('SIGKILL');
          resolve(grand);
        });
      }, 300);
    });
    assert.equal(parent, serve, 'the tool is a child of a relay of the spawner');
  });

  test('a dead spawner is restarted; meanwhile execs spawn the helper directly', async () => {
    const sock = join(dataDir, 'exec.sock');
    const before = await findServe(sock);
    assert.ok(before);
    process.kill(before, 'SIGKILL');
    for (let i = 0; i < 100 && ready(); i++) await new Promise((r) => setTimeout(r, 10));
    const during = await run(await b.spawn('sp', { argv: ['echo', 'still'], stdin: false }));
    assert.equal(during.stdout.toString(), 'still\n');
    for (let i = 0; i < 300 && !ready(); i++) await new Promise((r) => setTimeout(r, 20));
    assert.ok(ready(), 'the spawner is back');
    const afterPid = await findServe(sock);
    assert.ok(afterPid && afterPid !== before);
    const again = await run(await b.spawn('sp', { argv: ['echo', 'back'], stdin: false }));
    assert.equal(again.stdout.toString(), 'back\n');
  });
});
