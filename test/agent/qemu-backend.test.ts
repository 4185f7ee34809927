import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { createConnection, createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { AppError, type ServerFrame, type VmInfo } from '@fleet/agent-protocol';
import { buildQemuImage } from '../../packages/agent/src/backend/qemu/image.js';
import { generateMac } from '../../packages/agent/src/backend/process/network.js';
import { startAgent, type RunningAgent } from './harness.js';

/**
 * The qemu backend with real QEMU VMs (TCG here: /dev/kvm exists but nested
 * guests hang, and the probe must fall back). ONE boot, shared by every test
 * in order: create, exec, files, an endpoint, the in-guest agent's auth,
 * agent SIGKILL and recovery, destroy (ACPI), prune of leftovers. Under
 * CI=true a missing prerequisite fails the file instead of skipping it.
 * Needs: root, /dev/net/tun, qemu-system-x86 qemu-utils linux-image-amd64
 * busybox-static gcc libc6-dev e2fsprogs cpio nftables.
 */

const PREFIX = 'qmt';
const SUBNET = '10.232.0.0/24';
const CONSOLE_MAX = 64 * 1024;

function missing(): string | undefined {
  if (process.getuid?.() !== 0) return 'root';
  if (!existsSync('/dev/net/tun')) return '/dev/net/tun';
  for (const tool of ['qemu-system-x86_64', 'qemu-img', 'gcc', 'mke2fs', 'cpio', 'nft']) {
    if (spawnSync('sh', ['-c', `command -v ${tool}`]).status !== 0) return tool;
  }
  if (!existsSync('/bin/busybox')) return 'busybox-static';
  if (!spawnSync('sh', ['-c', 'ls /boot/vmlinuz-*']).stdout.length) return 'linux-image-amd64';
  return undefined;
}

const lack = missing();
if (lack && process.env.CI === 'true') {
  throw new Error(`qemu backend tests need ${lack} under CI (apt-get install qemu-system-x86 qemu-utils linux-image-amd64 …)`);
}

const linkExists = (name: string): boolean => spawnSync('ip', ['link', 'show', 'dev', name], { stdio: 'ignore' }).status === 0;
/** A zombie (QEMU daemonizes, so pid 1 reaps it, maybe late) counts as gone. */
const alive = (pid: number): boolean => {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return !/^[ZX]/.test(stat.slice(stat.lastIndexOf(')') + 2));
  } catch {
    return false;
  }
};

describe('qemu backend: a real VM', { skip: lack ? `missing ${lack}` : false, timeout: 600_000 }, () => {
  let root: string;
  let dataDir: string;
  let imageDir: string;
  let agent: RunningAgent;
  let qemuPid = 0;
  const vm = 'qmt-a';
  const other = 'qmt-b';
  let bootB: Promise<VmInfo> | undefined;

  const agentOpts = () => ({
    dataDir,
    imageDir,
    subnet: SUBNET,
    bridgePrefix: PREFIX,
    env: { AGENT_BACKEND: 'qemu', AGENT_LOG_LEVEL: 'warn', AGENT_CONSOLE_LOG_MAX_BYTES: String(CONSOLE_MAX) },
  });

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'fleet-qemu-test-'));
    dataDir = join(root, 'data');
    imageDir = join(root, 'images');
    await buildQemuImage(imageDir, 'base');
    agent = await startAgent(agentOpts(), 60_000);
  });

  after(async () => {
    const last = agent as RunningAgent | undefined; // unset when before() failed
    await last?.client.destroyVm(vm, { force: true }).catch(() => undefined);
    await last?.client.destroyVm(other, { force: true }).catch(() => undefined);
    await last?.client.prune().catch(() => undefined);
    await last?.stop();
    // A failed run must still leave no QEMU, tap or bridge behind.
    if (qemuPid && alive(qemuPid)) process.kill(qemuPid, 'SIGKILL');
    for (const l of ['qmtvt0', 'qmtvt1', 'qmtvt9', 'qmtvb0', 'qmtvb1', 'qmtvb7']) spawnSync('ip', ['link', 'del', l], { stdio: 'ignore' });
    spawnSync('nft', ['delete', 'table', 'inet', 'fleet_qmtv'], { stdio: 'ignore' });
    spawnSync('nft', ['delete', 'table', 'bridge', 'fleet_qmtv'], { stdio: 'ignore' });
    await rm(root, { recursive: true, force: true });
  });

  it('reports the accelerator it probed and NestedVirtSupported', async () => {
    const cap = await agent.client.capacity();
    assert.equal(cap.backend, 'qemu');
    assert.ok(cap.accel === 'kvm' || cap.accel === 'tcg');
    assert.equal(typeof cap.nested_virt_supported, 'boolean');
    if (cap.accel === 'tcg') assert.equal(cap.nested_virt_supported, false);
  });

  it('boots a VM with its reserved address, name-derived MAC and sized disk', async () => {
    const started = Date.now();
    const info = await agent.client.createVm(
      {
        name: vm,
        cpus: 1,
        ram_mb: 256,
        storage_gb: 2,
        tenant: 't1',
        env: { GREETING: 'from-the-seed' },
        expose: [{ port: 8080, as: 'http', protocol: 'tcp' }],
        net_raw: false,
      },
      { timeoutMs: 300_000 },
    );
    console.log(`# boot to first exec: ${Date.now() - started} ms`);
    // The second boot (another tenant) runs while the next tests use the first VM: it serves the isolation and hard-stop tests.
    bootB = agent.client.createVm({ name: other, cpus: 1, ram_mb: 192, tenant: 't2' }, { timeoutMs: 300_000 });
    bootB.catch(() => undefined);
    assert.equal(info.state, 'running');
    assert.equal(info.ip, '10.232.0.2');
    assert.equal(info.mac, generateMac(vm));
    const pidText = await readFile(join(dataDir, 'qemu/vms', vm, 'qemu.pid'), 'utf8');
    qemuPid = Number(pidText.trim());
    assert.ok(alive(qemuPid));
    // QEMU is not the agent's child and not in its session or process group: it survives the agent.
    const fields = (pid: number) => readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
    const [q, a] = [fields(qemuPid), fields(agent.proc.pid!)];
    assert.notEqual(q[1], String(agent.proc.pid));
    assert.notEqual(q[2], a[2], 'another process group');
    assert.notEqual(q[3], a[3], 'another session');

    const r = await agent.client.exec(vm, {
      argv: ['sh', '-c', 'hostname; ip -o -4 addr show dev eth0; cat /sys/class/net/eth0/address; df -k / | tail -1'],
    });
    assert.equal(r.exit_code, 0, r.stderr);
    const [hostname, addr, mac, df] = r.stdout.trim().split('\n');
    assert.equal(hostname, vm);
    assert.match(addr!, /inet 10\.232\.0\.2\/24/);
    assert.equal(mac, generateMac(vm));
    // The serial console is the VM's console log.
    assert.match(await agent.client.consoleLog(vm), /fleet: guest up at 10\.232\.0\.2/);
    const sizeKb = Number(df!.trim().split(/\s+/)[1]);
    assert.ok(sizeKb > 1.8 * 1024 * 1024, `root should be grown to storage_gb=2, is ${sizeKb} KiB`);
  });

  it('execs with exit code, separate streams, env and a timeout', async () => {
    const r = await agent.client.exec(vm, { argv: ['sh', '-c', 'echo "$GREETING $EXTRA"; echo oops >&2; exit 7'], env: { EXTRA: 'x' } });
    assert.equal(r.exit_code, 7);
    assert.equal(r.stdout, 'from-the-seed x\n');
    assert.equal(r.stderr, 'oops\n');
    const t = await agent.client.exec(vm, { argv: ['sleep', '30'], timeout_ms: 1000 });
    assert.equal(t.timed_out, true);
    const s = await agent.client.exec(vm, { argv: ['cat'], stdin: Buffer.from('piped in').toString('base64') });
    assert.equal(s.stdout, 'piped in');
    // An echoing child fills its stdout pipe long before it has read its stdin: the guest agent must keep both moving.
    const big = randomBytes(4 * 1024 * 1024);
    const echo = await agent.client.exec(
      vm,
      { argv: ['sh', '-c', 'cat; echo done >&2'], stdin: big.toString('base64'), timeout_ms: 60_000, encoding: 'base64' },
      { timeoutMs: 180_000 },
    );
    assert.equal(echo.timed_out, false);
    assert.equal(echo.exit_code, 0);
    assert.equal(Buffer.from(echo.stderr, 'base64').toString(), 'done\n');
    assert.ok(Buffer.from(big).subarray(0, 1024).equals(Buffer.from(echo.stdout, 'base64').subarray(0, 1024)));
  });

  it('uploads and downloads files inside the guest', async () => {
    const data = randomBytes(300_000);
    const up = await agent.client.upload(vm, '/root/blob.bin', data, { mode: '600' });
    assert.equal(up.size_bytes, data.length);
    const back = await agent.client.download(vm, '/root/blob.bin');
    assert.ok(Buffer.from(back).equals(data));
    const mode = await agent.client.exec(vm, { argv: ['stat', '-c', '%a', '/root/blob.bin'] });
    assert.equal(mode.stdout.trim(), '600');
    await assert.rejects(agent.client.download(vm, '/root/nope'), (e: AppError) => e.code === 'GUEST_PATH_NOT_FOUND');
    await assert.rejects(agent.client.download(vm, '/root'), (e: AppError) => e.code === 'GUEST_PATH_NOT_A_FILE');
    await assert.rejects(agent.client.upload(vm, '/no/such/dir/f', Buffer.from('x')), (e: AppError) => e.code === 'GUEST_PATH_NOT_FOUND');
    const left = await agent.client.exec(vm, { argv: ['sh', '-c', 'ls -a /root | grep -c fleet-upload || true'] });
    assert.equal(left.stdout.trim(), '0');
  });

  it('publishes an exposed guest port on its endpoint', async () => {
    await agent.client.exec(vm, { argv: ['sh', '-c', 'mkdir -p /www && echo hello-from-vm > /www/index.html && httpd -p 8080 -h /www'] });
    const info = await agent.client.getVm(vm);
    const ep = info.endpoints.find((e) => e.as === 'http');
    assert.ok(ep, 'an http endpoint');
    const body = await (await fetch(`${ep.url}/index.html`)).text();
    assert.equal(body, 'hello-from-vm\n');
  });

  it('starts a guest daemon with its files through the agent route, detached from the request', async () => {
    const script = '#!/bin/sh\necho "daemon $ROLE" > /root/daemon.out\nexec sleep 1000\n';
    const res = await agent.client.startAgent(vm, {
      files: { '/opt/fleet-test/run.sh': Buffer.from(script).toString('base64') },
      command: '/opt/fleet-test/run.sh',
      env: { ROLE: 'worker' },
      expose: [{ port: 8080, as: 'http' }],
    });
    assert.equal(res.started, true);
    assert.equal(res.endpoints[0]?.port, 8080);
    let out = '';
    for (let i = 0; i < 50 && !out.includes('daemon'); i++) {
      out = (await agent.client.exec(vm, { argv: ['sh', '-c', 'cat /root/daemon.out 2>/dev/null; true'] })).stdout;
      if (!out) await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(out, 'daemon worker\n');
    const ps = await agent.client.exec(vm, { argv: ['sh', '-c', `ps | grep -c '[s]leep 1000'`] });
    assert.equal(ps.stdout.trim(), '1');
    await assert.rejects(
      agent.client.startAgent(vm, { command: 'true', expose: [{ port: 9999, as: 'x' }] }),
      (e: AppError) => e.code === 'EXPOSE_NOT_PUBLISHED',
    );
  });

  it('the in-guest agent refuses a connection without the VM token', async () => {
    const frame = (type: string, payload: string): Buffer => {
      const b = Buffer.from(payload);
      const h = Buffer.alloc(5);
      h.write(type, 0, 'latin1');
      h.writeUInt32BE(b.length, 1);
      return Buffer.concat([h, b]);
    };
    const req = ['3', 'sh', '-c', 'touch /root/pwned', '0', '/', '0', '0', '0', '0'].map((f) => `${f}\0`).join('');
    const answer = await new Promise<Buffer>((resolve, reject) => {
      const s = createConnection({ host: '10.232.0.2', port: 7071 });
      const got: Buffer[] = [];
      s.on('data', (d: Buffer) => got.push(d));
      // The guest agent hangs up at once, unread request bytes and all: a reset is a refusal too.
      s.on('error', (err: NodeJS.ErrnoException) => (err.code === 'ECONNRESET' ? undefined : reject(err)));
      s.on('close', () => resolve(Buffer.concat(got)));
      s.on('connect', () => s.write(Buffer.concat([frame('A', 'not-the-token-at-all'), frame('X', req)])));
    });
    assert.equal(answer.length, 0, 'no frame at all for a wrong token');
    const check = await agent.client.exec(vm, { argv: ['sh', '-c', 'test -e /root/pwned && echo yes || echo no'] });
    assert.equal(check.stdout.trim(), 'no');
  });

  it('attaches on a TTY of the requested size, and resizes it', async () => {
    const s = await agent.client.attach(vm, { type: 'start', cmd: ['/bin/sh'], tty: true, rows: 30, cols: 100 });
    const frames = s.frames[Symbol.asyncIterator]();
    let acc = '';
    const until = async (re: RegExp): Promise<void> => {
      const deadline = Date.now() + 20_000;
      while (!re.test(acc)) {
        if (Date.now() > deadline) throw new Error(`waiting for ${re}; got ${JSON.stringify(acc)}`);
        const r = await frames.next();
        if (r.done) throw new Error(`stream ended before ${re}`);
        const f: ServerFrame = r.value;
        if (f.type === 'stdout' || f.type === 'stderr') acc += Buffer.from(f.data, 'base64').toString();
        if (f.type === 'exit') acc += `<exit ${f.code}>`;
      }
    };
    s.write('stty size; tty\n');
    await until(/30 100\s+\/dev\/pts\/\d+/);
    s.send({ type: 'resize', rows: 40, cols: 120 });
    s.write('stty size\n');
    await until(/40 120/);
    s.write('exit 7\n');
    await until(/<exit 7>/);
  });

  it('keeps tenants apart: a VM of another tenant cannot reach the first VM, and no VM reaches a host service', async () => {
    assert.ok(bootB);
    const b = await bootB;
    assert.equal(b.state, 'running');
    assert.notEqual(b.ip, '10.232.0.2');
    // A host service on every address: a VM must not reach it through its gateway.
    let hostHits = 0;
    const server = createServer((c) => {
      hostHits++;
      c.end('host-secret\n');
    });
    await new Promise<void>((resolve) => server.listen(0, '0.0.0.0', resolve));
    const hostPort = (server.address() as AddressInfo).port;
    try {
      const get = (from: string) =>
        agent.client.exec(from, {
          argv: [
            'sh',
            '-c',
            // nc, not wget: Debian's busybox 1.35 wget segfaults with -T (on the host too), and without it waits long.
            `printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 3 10.232.0.2 8080; echo "vm:$?"; nc -w 2 10.232.0.1 ${hostPort} </dev/null; echo "gw:$?"`,
          ],
          timeout_ms: 30_000,
        });
      // The same probe from a itself reaches its own httpd: the probe can succeed.
      assert.match((await get(vm)).stdout, /hello-from-vm/);
      const probe = await get(other);
      assert.doesNotMatch(probe.stdout, /hello-from-vm/);
      assert.doesNotMatch(probe.stdout, /host-secret/);
    } finally {
      server.close();
    }
    assert.equal(hostHits, 0, 'a VM opened a connection to a host service');
    const ownBridge = spawnSync('ip', ['-j', 'link', 'show', 'dev', 'qmtvt1']).stdout.toString();
    assert.match(ownBridge, /"master":"qmtvb1"/, 'another tenant, another bridge');
  });

  it('hard-stops a VM when the grace period is too short for ACPI (force destroy)', async () => {
    const pid = Number((await readFile(join(dataDir, 'qemu/vms', other, 'qemu.pid'), 'utf8')).trim());
    const started = Date.now();
    const res = await agent.client.destroyVm(other, { force: true, timeoutMs: 60_000 });
    assert.equal(res.destroyed, true);
    assert.ok(!alive(pid));
    assert.ok(Date.now() - started < 10_000);
    assert.ok(!linkExists('qmtvt1') && !linkExists('qmtvb1'));
  });

  it('bounds the serial console log however much the guest writes to its serial port', async () => {
    const r = await agent.client.exec(
      vm,
      { argv: ['sh', '-c', "head -c 300000 /dev/zero | tr '\\0' x > /dev/ttyS0; echo end-of-flood > /dev/ttyS0"], timeout_ms: 240_000 },
      { timeoutMs: 300_000 },
    );
    assert.equal(r.exit_code, 0, r.stderr);
    const log = join(dataDir, 'qemu/vms', vm, 'serial.log');
    let text = '';
    for (let i = 0; i < 50 && !text.includes('end-of-flood'); i++) {
      text = await readFile(log, 'utf8');
      if (!text.includes('end-of-flood')) await new Promise((res) => setTimeout(res, 200));
    }
    assert.match(text, /xxxx[\s\S]*end-of-flood/);
    assert.ok(text.length <= CONSOLE_MAX, `serial.log is ${text.length} bytes, over ${CONSOLE_MAX}`);
  });

  it('keeps the VM across an agent SIGKILL and finds it again', async () => {
    const before = await agent.client.getVm(vm);
    await agent.kill();
    assert.ok(alive(qemuPid), 'QEMU outlives its agent');
    agent = await startAgent(agentOpts(), 60_000);
    const info = await agent.client.getVm(vm);
    assert.equal(info.state, 'running');
    assert.equal(info.ip, before.ip);
    assert.deepEqual(info.endpoints, before.endpoints);
    const r = await agent.client.exec(vm, { argv: ['cat', '/root/blob.bin'], encoding: 'base64' });
    assert.equal(Buffer.from(r.stdout, 'base64').length, 300_000);
    const body = await (await fetch(`${info.endpoints[0]!.url}/index.html`)).text();
    assert.equal(body, 'hello-from-vm\n');
    // The new agent reads the serial console again.
    await agent.client.exec(vm, { argv: ['sh', '-c', 'echo console-after-restart > /dev/ttyS0'] });
    let con = '';
    for (let i = 0; i < 50 && !con.includes('console-after-restart'); i++) {
      con = await agent.client.consoleLog(vm);
      if (!con.includes('console-after-restart')) await new Promise((res) => setTimeout(res, 200));
    }
    assert.match(con, /console-after-restart/);
  });

  it('prunes orphaned taps, bridges, VM directories and QEMU processes, and nothing live', async () => {
    spawnSync('ip', ['tuntap', 'add', 'dev', 'qmtvt9', 'mode', 'tap']);
    spawnSync('ip', ['link', 'add', 'qmtvb7', 'type', 'bridge']);
    const ghost = join(dataDir, 'qemu/vms/ghost');
    await mkdir(ghost, { recursive: true });
    await writeFile(join(ghost, 'overlay.qcow2'), 'left over');
    // A real QEMU (firmware only) whose pidfile says it is ours but which no VM owns.
    const q = spawnSync('qemu-system-x86_64', [
      '-machine',
      'q35,accel=tcg',
      '-nodefaults',
      '-display',
      'none',
      '-m',
      '16',
      '-pidfile',
      join(ghost, 'qemu.pid'),
      '-daemonize',
    ]);
    assert.equal(q.status, 0, q.stderr.toString());
    const ghostPid = Number((await readFile(join(ghost, 'qemu.pid'), 'utf8')).trim());
    assert.ok(alive(ghostPid));

    const res = await agent.client.prune();
    assert.ok(res.reclaimed.includes('veth qmtvt9'), JSON.stringify(res));
    assert.ok(res.reclaimed.includes('bridge qmtvb7'), JSON.stringify(res));
    assert.ok(res.reclaimed.includes(`process ${ghostPid}`), JSON.stringify(res));
    assert.ok(
      res.reclaimed.some((r) => r.endsWith('/qemu/vms/ghost')),
      JSON.stringify(res),
    );
    for (let i = 0; i < 50 && alive(ghostPid); i++) await new Promise((r) => setTimeout(r, 100));
    assert.ok(!alive(ghostPid));
    assert.ok(!linkExists('qmtvt9') && !linkExists('qmtvb7'));
    // The live VM is untouched.
    assert.ok(alive(qemuPid));
    assert.ok(linkExists('qmtvt0') && linkExists('qmtvb0'));
    assert.equal((await agent.client.exec(vm, { argv: ['true'] })).exit_code, 0);
  });

  it('destroys: ACPI power-off, then tap, bridge and overlay are gone', async () => {
    const res = await agent.client.destroyVm(vm, { timeoutMs: 60_000 });
    assert.equal(res.destroyed, true);
    assert.ok(!alive(qemuPid));
    assert.ok(!linkExists('qmtvt0') && !linkExists('qmtvb0'));
    assert.deepEqual(await readdir(join(dataDir, 'qemu/vms')), []);
    await assert.rejects(agent.client.getVm(vm), (e: AppError) => e.code === 'SANDBOX_NOT_FOUND');
    const again = await agent.client.destroyVm(vm);
    assert.equal(again.destroyed, false);
  });
});
