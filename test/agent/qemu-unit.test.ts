import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { createServer, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { chooseAccel, firmwarePosts } from '../../packages/agent/src/backend/qemu/accel.js';
import { buildQemuArgs, type QemuVmConfig } from '../../packages/agent/src/backend/qemu/command.js';
import { encodeExecRequest } from '../../packages/agent/src/backend/qemu/guest-client.js';
import { moduleClosure } from '../../packages/agent/src/backend/qemu/image.js';
import { ConsoleLog } from '../../packages/agent/src/backend/qemu/console.js';
import { identityLine, type GuestIdentity } from '../../packages/agent/src/backend/qemu/control.js';

/**
 * The qemu backend's pure parts: the command line (including the GPU lane,
 * which has no hardware here and is NOT run: only what it builds is checked),
 * the module closure of the guest's initramfs, the in-guest agent's request
 * encoding, and the accelerator probe's fallback.
 */

const base: QemuVmConfig = {
  processName: 'fleet:fb:vm1',
  accel: 'tcg',
  cpus: 2,
  memoryMb: 512,
  kernel: '/img/vmlinuz',
  initrd: '/img/initrd.img',
  diskPath: '/vms/vm1/overlay.qcow2',
  seedPath: '/vms/vm1/seed.tar',
  mac: '02:11:22:33:44:55',
  tap: 'fbvt0',
  serialSocket: '/run/vm1.serial',
  qmpSocket: '/vms/vm1/qmp.sock',
  pidFile: '/vms/vm1/qemu.pid',
};

const after = (args: string[], flag: string): string[] => args.flatMap((a, i) => (a === flag ? [args[i + 1]!] : []));

describe('qemu command line', () => {
  it('boots the kernel directly with virtio disk, read-only seed, tap NIC with the MAC, QMP and a daemonized QEMU', () => {
    const args = buildQemuArgs(base);
    assert.deepEqual(after(args, '-machine'), ['q35,accel=tcg']);
    assert.deepEqual(after(args, '-cpu'), ['max']);
    assert.deepEqual(after(args, '-smp'), ['2']);
    assert.deepEqual(after(args, '-m'), ['512M']);
    assert.deepEqual(after(args, '-drive'), [
      'file=/vms/vm1/overlay.qcow2,if=none,id=root,format=qcow2,discard=unmap',
      'file=/vms/vm1/seed.tar,if=none,id=seed,format=raw,readonly=on',
    ]);
    assert.ok(after(args, '-device').includes('virtio-net-pci,netdev=net0,mac=02:11:22:33:44:55'));
    assert.deepEqual(after(args, '-netdev'), ['tap,id=net0,ifname=fbvt0,script=no,downscript=no']);
    assert.deepEqual(after(args, '-qmp'), ['unix:/vms/vm1/qmp.sock,server=on,wait=off']);
    assert.deepEqual(after(args, '-chardev'), ['socket,id=serial0,path=/run/vm1.serial,server=on,wait=off']);
    assert.deepEqual(after(args, '-serial'), ['chardev:serial0']);
    assert.ok(args.includes('-daemonize') && args.includes('-no-reboot'));
    assert.ok(!after(args, '-device').some((d) => d.startsWith('vfio-pci')));
    assert.deepEqual(after(buildQemuArgs({ ...base, accel: 'kvm' }), '-cpu'), ['host']);
  });

  it('attaches fixtures read-only', () => {
    const args = buildQemuArgs({ ...base, fixturePaths: ['/fx/a.ext4', '/fx/b.ext4'] });
    assert.deepEqual(after(args, '-drive').slice(2), [
      'file=/fx/a.ext4,if=none,id=fixture0,format=raw,readonly=on',
      'file=/fx/b.ext4,if=none,id=fixture1,format=raw,readonly=on',
    ]);
  });

  it('GPU lane (not run here: no VFIO hardware): VFIO devices by PCI address and mdevs by uuid', () => {
    const args = buildQemuArgs({
      ...base,
      gpu: { pciAddresses: ['0000:3b:00.0', '0000:af:00.1'], mdevUuids: ['c0ffee00-1111-4222-8333-444455556666'] },
    });
    assert.deepEqual(
      after(args, '-device').filter((d) => d.startsWith('vfio-pci')),
      [
        'vfio-pci,host=0000:3b:00.0',
        'vfio-pci,host=0000:af:00.1',
        'vfio-pci,sysfsdev=/sys/bus/mdev/devices/c0ffee00-1111-4222-8333-444455556666',
      ],
    );
    assert.throws(() => buildQemuArgs({ ...base, gpu: { pciAddresses: ['3b:00.0,x-evil=on'] } }), /bad PCI address/);
    assert.throws(() => buildQemuArgs({ ...base, gpu: { mdevUuids: ['../../../dev/sda'] } }), /bad mdev uuid/);
  });

  it('refuses option injection through paths, MACs and tap names', () => {
    assert.throws(() => buildQemuArgs({ ...base, diskPath: '/vms/x,readonly=off' }), /free of commas/);
    assert.throws(() => buildQemuArgs({ ...base, seedPath: 'relative.tar' }), /absolute/);
    assert.throws(() => buildQemuArgs({ ...base, mac: '02:11:22:33:44:55,x=1' }), /bad MAC/);
    assert.throws(() => buildQemuArgs({ ...base, tap: 'tap0,script=/tmp/x' }), /bad tap/);
  });
});

describe('memory-state command line and the control channel', () => {
  it('a restorable machine: control serial port and vmgenid in a fixed place; a load waits for its stream, stopped', () => {
    const cfg = { ...base, controlSocket: '/run/vm1.ctl', vmGenId: '0b9f3c1e-2d4a-4c5b-8e6f-7a8b9c0d1e2f' };
    const a = buildQemuArgs(cfg);
    const b = buildQemuArgs({ ...cfg, incoming: true, vmGenId: '1b9f3c1e-2d4a-4c5b-8e6f-7a8b9c0d1e2f' });
    assert.ok(a.join(' ').includes('-chardev socket,id=control0,path=/run/vm1.ctl,server=on,wait=off -serial chardev:control0'));
    assert.ok(a.includes('vmgenid,guid=0b9f3c1e-2d4a-4c5b-8e6f-7a8b9c0d1e2f'));
    assert.ok(!a.includes('-incoming'));
    assert.deepEqual(b.slice(-3), ['-incoming', 'defer', '-S']);
    // The same devices in the same order, whatever the generation id: QEMU loads a state only into the machine it came from.
    const devices = (args: string[]) => args.filter((x, i) => args[i - 1] === '-device' && !x.startsWith('vmgenid'));
    assert.deepEqual(devices(a), devices(b));
    assert.throws(() => buildQemuArgs({ ...cfg, vmGenId: 'x,addr=1' }), /vmgenid/);
    assert.throws(() => buildQemuArgs({ ...cfg, controlSocket: '/run/a,server=off' }), /commas/);
  });

  it('the identity line carries no field the guest could split differently (spaces, newlines, shell)', () => {
    const id: GuestIdentity = {
      ip: '10.1.0.3',
      prefixLen: 24,
      gateway: '10.1.0.1',
      mac: '02:aa:bb:cc:dd:ee',
      hostname: 'vm-2',
      token: 'ab'.repeat(24),
      epochS: 1_700_000_000.7,
    };
    assert.equal(identityLine('n1', id), `identity n1 10.1.0.3 24 10.1.0.1 02:aa:bb:cc:dd:ee vm-2 ${'ab'.repeat(24)} 1700000000\n`);
    for (const bad of [
      { hostname: 'vm 2' },
      { hostname: 'vm\nidentity' },
      { token: 'ab'.repeat(24) + ' x' },
      { token: '$(reboot)' },
      { ip: '10.1.0.3; reboot' },
      { mac: '02:aa:bb:cc:dd:ee\n' },
      { prefixLen: 0 },
    ]) {
      assert.throws(() => identityLine('n1', { ...id, ...bad }), Error, JSON.stringify(bad));
    }
  });
});

describe('guest image module closure', () => {
  const dep = [
    'kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko',
    'kernel/fs/jbd2/jbd2.ko:',
    'kernel/fs/mbcache.ko:',
    'kernel/lib/crc16.ko:',
    'kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko',
    'kernel/drivers/virtio/virtio.ko:',
    'kernel/drivers/virtio/virtio_ring.ko:',
    'kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko',
  ].join('\n');

  it('lists dependencies first, each once, and skips what is built in', () => {
    const order = moduleClosure(dep, ['virtio_blk', 'ext4', 'virtio_rng', 'virtio_pci']);
    assert.deepEqual(order, [
      'kernel/drivers/virtio/virtio_ring.ko',
      'kernel/drivers/virtio/virtio.ko',
      'kernel/drivers/block/virtio_blk.ko',
      'kernel/lib/crc16.ko',
      'kernel/fs/mbcache.ko',
      'kernel/fs/jbd2/jbd2.ko',
      'kernel/fs/ext4/ext4.ko',
      'kernel/drivers/char/hw_random/virtio-rng.ko',
    ]);
  });
});

describe('in-guest agent request encoding', () => {
  it('is NUL-separated fields and refuses NUL inside a field', () => {
    const buf = encodeExecRequest({
      argv: ['sh', '-c', 'echo hi'],
      env: { A: '1' },
      cwd: '/root',
      tty: { rows: 24, cols: 80 },
      stdin: true,
    });
    assert.deepEqual(buf.toString().split('\0'), ['3', 'sh', '-c', 'echo hi', '1', 'A=1', '/root', '1', '24', '80', '1', '']);
    assert.throws(() => encodeExecRequest({ argv: ['a\0b'], env: {}, cwd: '/', stdin: false }), /NUL/);
  });
});

describe('serial console log', () => {
  it('keeps the newer half past its bound, and reconnects while the VM runs', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'fleet-console-'));
    const sockPath = join(dir, 'vm.serial');
    const logPath = join(dir, 'serial.log');
    // Stands in for QEMU's `-chardev socket,server=on`: one client at a time.
    let client: Socket | undefined;
    let connected!: () => void;
    let nextClient = new Promise<void>((r) => (connected = r));
    const server = createServer((c) => {
      client = c;
      connected();
    });
    await new Promise<void>((r) => server.listen(sockPath, r));
    const con = await ConsoleLog.start({ socketPath: sockPath, logPath, maxBytes: 10_000, running: () => Promise.resolve(true) });
    try {
      await nextClient;
      for (let i = 0; i < 50; i++) client!.write(`line ${String(i).padStart(4, '0')} ${'x'.repeat(990)}\n`);
      const until = async (pred: (t: string) => boolean): Promise<string> => {
        for (let i = 0; i < 100; i++) {
          const t = await readFile(logPath, 'utf8').catch(() => '');
          if (pred(t)) return t;
          await new Promise((r) => setTimeout(r, 50));
        }
        throw new Error('console log never got there');
      };
      const text = await until((t) => t.includes('line 0049'));
      assert.ok(text.length <= 10_000, `${text.length} bytes`);
      assert.ok(!text.includes('line 0000'), 'the oldest output is gone');
      // QEMU's socket loses its client (an agent restart looks like this from QEMU's side): the log reconnects.
      nextClient = new Promise<void>((r) => (connected = r));
      client!.destroy();
      await nextClient;
      client!.write('after reconnect\n');
      await until((t) => t.includes('after reconnect'));
    } finally {
      await con.close();
      server.close();
      await rm(dir, { recursive: true, force: true });
    }
  });
});

const haveQemu = spawnSync('sh', ['-c', 'command -v qemu-system-x86_64']).status === 0;
if (!haveQemu && process.env.CI === 'true') throw new Error('qemu-system-x86_64 is required under CI (apt-get install qemu-system-x86)');

describe('accelerator probe', { skip: haveQemu ? false : 'qemu-system-x86_64 missing' }, () => {
  it('TCG finishes firmware POST; a probe that cannot finish in time reports why', async () => {
    const ok = await firmwarePosts('tcg', { timeoutMs: 20_000 });
    assert.equal(ok.ok, true, ok.reason);
    const slow = await firmwarePosts('tcg', { timeoutMs: 1 });
    assert.equal(slow.ok, false);
    assert.match(slow.reason, /did not finish POST within 1 ms/);
  });

  it('falls back to TCG when KVM does not work, and refuses when KVM is insisted on', async () => {
    const report = await chooseAccel('auto', { qemu: '/nonexistent/qemu', timeoutMs: 2_000 });
    assert.equal(report.accel, 'tcg');
    assert.equal(report.nestedVirtSupported, false);
    assert.match(report.reason, /falling back to TCG/);
    await assert.rejects(chooseAccel('kvm', { qemu: '/nonexistent/qemu', timeoutMs: 2_000 }), /KVM does not work here/);
    assert.equal((await chooseAccel('tcg')).accel, 'tcg');
  });
});
