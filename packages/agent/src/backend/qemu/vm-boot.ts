import { randomBytes, randomUUID } from 'node:crypto';
import { mkdir, readFile, rename, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { AppError } from '@fleet/agent-protocol';
import { type Checkpoint, sandboxFailed, type SandboxInfo, sandboxNotRunning } from '../../backend.js';
import { mustRun, processStartTime, runTool, sleep } from '../process/exec-util.js';
import { type Proxy, startProxy } from '../process/proxy.js';
import { buildQemuArgs, type QemuVmConfig } from './command.js';
import { guestRun } from './guest-client.js';
import type { QemuImage } from './image.js';
import { qmp } from './qmp.js';
import { sendIdentity } from './control.js';
import { DISK_FILE, loadState, verifyState } from './state.js';
import type { VmRecord, VmState } from './vm-state.js';
import type { QemuHost } from './vm-host.js';

/** Starting QEMU and bringing a guest up: launch, wait for the in-guest agent, load a state, thaw, publish endpoints. */

export async function launchQemu(qemu: QemuHost, s: VmState, image: QemuImage, opts: { incoming?: boolean } = {}): Promise<void> {
  const dir = qemu.vmDir(s.name);
  // An old state file (before memory restores) has none; a VM's generation id is fixed at its launch.
  if (!s.vmgenid) s.vmgenid = randomUUID();
  const args = buildQemuArgs(vmMachineConfig(qemu, s, image, opts));
  // -daemonize: the parent exits once the VM is set up (errors come back on stderr first).
  const res = await runTool(qemu.opts.qemuBinary, args, { timeoutMs: 60_000 });
  if (res.code !== 0) throw sandboxFailed(`qemu did not start (exit ${res.code}): ${res.stderr.trim().slice(0, 500)}`, { vm: s.name });
  const pid = Number((await readFile(join(dir, 'qemu.pid'), 'utf8')).trim());
  const startTime = await processStartTime(pid);
  if (!startTime) throw sandboxFailed(`qemu exited right after start: ${await qemu.serialTail(s.name)}`, { vm: s.name });
  s.pid = pid;
  s.pid_start = startTime;
}

/** The machine a VM's state describes (its devices included), as command.ts takes it: every launch of the VM builds it here. */
export function vmMachineConfig(qemu: QemuHost, s: VmState, image: QemuImage, opts: { incoming?: boolean } = {}): QemuVmConfig {
  const dir = qemu.vmDir(s.name);
  return {
    processName: qemu.processName(s.name),
    accel: s.accel,
    cpus: Math.max(1, Math.ceil(s.cpus)),
    memoryMb: s.ram_mb,
    kernel: image.kernel,
    initrd: image.initrd,
    diskPath: join(dir, DISK_FILE),
    seedPath: join(dir, 'seed.tar'),
    mac: s.mac,
    tap: s.tap,
    serialSocket: qemu.serialPath(s.name),
    qmpSocket: qemu.qmpPath(s.name),
    controlSocket: qemu.controlPath(s.name),
    vmGenId: s.vmgenid,
    incoming: opts.incoming === true,
    pidFile: join(dir, 'qemu.pid'),
    ...(s.gpu ? { gpu: { pciAddresses: s.gpu.pci_addresses, mdevUuids: s.gpu.mdev_uuids } } : {}),
  };
}

/** backend.go.txt WaitForIP: the address is static; wait until the guest answers on it (the in-guest agent runs a command). */
export async function waitForGuest(qemu: QemuHost, s: VmState, started: number): Promise<void> {
  const target = qemu.target(s);
  for (;;) {
    if (!(await qemu.alive(s)))
      throw sandboxFailed(`VM "${s.name}" stopped while booting: ${await qemu.serialTail(s.name)}`, { vm: s.name });
    const r = await guestRun(target, ['true'], { timeoutMs: 10_000, connectTimeoutMs: 2_000 }).catch(() => null);
    if (r?.code === 0) return;
    if (Date.now() - started > qemu.opts.bootTimeoutMs) {
      throw sandboxFailed(`VM "${s.name}" did not answer within ${qemu.opts.bootTimeoutMs} ms: ${await qemu.serialTail(s.name)}`, {
        vm: s.name,
      });
    }
    await sleep(250);
  }
}

export async function publish(qemu: QemuHost, record: VmRecord): Promise<void> {
  const s = record.state;
  const endpoints: VmState['endpoints'] = [];
  for (const e of s.expose) {
    const protocol = e.protocol ?? 'tcp';
    const prior = s.endpoints.find((p) => p.port === e.port && p.protocol === protocol);
    let proxy: Proxy;
    try {
      proxy = await startProxy({
        protocol,
        listenHost: qemu.opts.publishHost,
        listenPort: prior?.host_port ?? 0,
        targetHost: s.ip,
        targetPort: e.port,
      });
    } catch (err) {
      throw new AppError('EXPOSE_PORT_UNAVAILABLE', 500, `could not publish ${protocol}/${e.port}: ${(err as Error).message}`, {
        port: e.port,
      });
    }
    record.proxies.push(proxy);
    endpoints.push({ as: e.as, port: e.port, protocol, host_port: proxy.hostPort });
  }
  s.endpoints = endpoints;
}

/** The checkpoint's overlay (digest checked while extracted) becomes the VM's disk, over this host's copy of its image. */
export async function diskFromCheckpoint(qemu: QemuHost, s: VmState, cp: Checkpoint, image: QemuImage): Promise<void> {
  const dir = qemu.vmDir(s.name);
  const tmp = join(dir, `.restore-${randomBytes(4).toString('hex')}`);
  await mkdir(tmp, { mode: 0o700 });
  try {
    await qemu.store.extract(cp.id, tmp);
    // The overlay names its base by the capturing host's path: point it at ours (same build, checkMachine saw to it).
    await mustRun('qemu-img', ['rebase', '-u', '-q', '-f', 'qcow2', '-b', image.rootfs, '-F', 'qcow2', join(tmp, DISK_FILE)]);
    await rename(join(tmp, DISK_FILE), join(dir, DISK_FILE));
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

/**
 * QEMU with `-incoming defer -S`, the checkpoint's state loaded into it
 * (its sha256 checked first), run; then the guest is told who it is now
 * over its control channel and must answer on its address.
 */
export async function loadInto(qemu: QemuHost, r: VmRecord, cp: Checkpoint, image: QemuImage, started: number): Promise<void> {
  const s = r.state;
  const file = await verifyState(qemu.store, cp);
  await launchQemu(qemu, s, image, { incoming: true });
  await qemu.writeState(s);
  await qemu.startConsole(r);
  await loadState(qemu.qmpPath(s.name), file, 120_000, () => qemu.alive(s));
  // The host may remember another MAC for this address (a VM that had it before).
  await runTool('ip', ['neigh', 'del', s.ip, 'dev', s.bridge]);
  await qmp(qemu.qmpPath(s.name), 'cont');
  await sendIdentity(qemu.controlPath(s.name), {
    ip: s.ip,
    prefixLen: qemu.subnet.prefixLen,
    gateway: qemu.subnet.gateway,
    mac: s.mac,
    hostname: s.name,
    token: s.token,
    epochS: Date.now() / 1000,
  });
  await waitForGuest(qemu, s, started);
  qemu.log?.info({ vm: s.name, checkpoint: cp.id, restore_ms: Date.now() - started }, 'VM state loaded');
}

/** A frozen VM (QEMU alive, stopped: after keep_paused, or a source whose migration the caller rolls back) runs on. */
export async function thaw(qemu: QemuHost, r: VmRecord): Promise<SandboxInfo> {
  const s = r.state;
  if (!(await qemu.alive(s))) throw sandboxNotRunning(s.name);
  const started = Date.now();
  await qmp(qemu.qmpPath(s.name), 'cont');
  if (!r.console) await qemu.startConsole(r).catch(() => undefined);
  await sendIdentity(qemu.controlPath(s.name), qemu.identity(s));
  await waitForGuest(qemu, s, started);
  await publish(qemu, r);
  s.status = 'running';
  await qemu.writeState(s);
  return qemu.info(r);
}
