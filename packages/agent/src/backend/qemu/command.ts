import type { Accel } from './accel.js';

/**
 * The QEMU command line for one VM (backend.go.txt `Config`), kept a pure
 * function so the parts that cannot run on this machine (VFIO devices,
 * mdevs) are tested by what they build.
 */

export interface GpuPassthrough {
  /** A whole device bound to vfio-pci, by PCI address ("0000:3b:00.0"). */
  readonly pciAddresses?: readonly string[];
  /** Mediated devices (e.g. MIG-backed vGPU instances) by uuid, under /sys/bus/mdev/devices. */
  readonly mdevUuids?: readonly string[];
}

export interface QemuVmConfig {
  /** Names the process: `fleet:<prefix>:<vm>` (prune finds QEMUs by it). */
  readonly processName: string;
  readonly accel: Accel;
  readonly cpus: number;
  readonly memoryMb: number;
  readonly kernel: string;
  readonly initrd: string;
  readonly diskPath: string;
  readonly seedPath: string;
  /** Read-only ext4 images the guest mounts by label (vdc, vdd, …). */
  readonly fixturePaths?: readonly string[];
  readonly mac: string;
  readonly tap: string;
  /** The serial console is served here; the agent writes it to the log (console.ts). */
  readonly serialSocket: string;
  readonly qmpSocket: string;
  /** The host's control channel (second serial port, ttyS1 in the guest): re-addressing after a memory restore. */
  readonly controlSocket?: string;
  /** VM generation id: a restored copy gets a new one, so the guest kernel reseeds its RNG (Linux vmgenid). */
  readonly vmGenId?: string;
  /** Wait for a migration stream (`migrate-incoming`) and stay stopped (-S) until `cont`. */
  readonly incoming?: boolean;
  readonly pidFile: string;
  readonly gpu?: GpuPassthrough;
}

const pciRe = /^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$/;
const uuidRe = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const macRe = /^[0-9a-f]{2}(:[0-9a-f]{2}){5}$/;
const ifnameRe = /^[a-z0-9]{1,15}$/;

/** QEMU's -drive/-device option syntax splits on commas: a path holding one would inject options. */
function optPath(p: string): string {
  if (!p.startsWith('/') || /[,\n]/.test(p)) throw new Error(`path "${p}" must be absolute and free of commas for a QEMU option`);
  return p;
}

export function buildQemuArgs(c: QemuVmConfig): string[] {
  if (!macRe.test(c.mac)) throw new Error(`bad MAC "${c.mac}"`);
  if (!ifnameRe.test(c.tap)) throw new Error(`bad tap name "${c.tap}"`);
  if (!/^[A-Za-z0-9:_-]+$/.test(c.processName)) throw new Error(`bad process name "${c.processName}"`);
  const args = [
    '-name',
    `${c.processName},debug-threads=off`,
    '-machine',
    `q35,accel=${c.accel}`,
    '-cpu',
    c.accel === 'kvm' ? 'host' : 'max',
    '-smp',
    String(c.cpus),
    '-m',
    `${c.memoryMb}M`,
    '-nodefaults',
    '-no-user-config',
    '-display',
    'none',
    '-vga',
    'none',
    // A guest reboot or panic ends the VM rather than looping.
    '-no-reboot',
    '-kernel',
    optPath(c.kernel),
    '-initrd',
    optPath(c.initrd),
    '-append',
    'console=ttyS0 panic=-1 quiet',
    '-drive',
    `file=${optPath(c.diskPath)},if=none,id=root,format=qcow2,discard=unmap`,
    '-device',
    'virtio-blk-pci,drive=root',
    '-drive',
    `file=${optPath(c.seedPath)},if=none,id=seed,format=raw,readonly=on`,
    '-device',
    'virtio-blk-pci,drive=seed',
  ];
  (c.fixturePaths ?? []).forEach((p, i) => {
    args.push('-drive', `file=${optPath(p)},if=none,id=fixture${i},format=raw,readonly=on`, '-device', `virtio-blk-pci,drive=fixture${i}`);
  });
  args.push(
    '-netdev',
    `tap,id=net0,ifname=${c.tap},script=no,downscript=no`,
    '-device',
    `virtio-net-pci,netdev=net0,mac=${c.mac}`,
    '-chardev',
    `socket,id=serial0,path=${optPath(c.serialSocket)},server=on,wait=off`,
    '-serial',
    'chardev:serial0',
  );
  // Both before -pidfile, in a fixed order: a restore's command line must build the very machine the state came from.
  if (c.controlSocket)
    args.push('-chardev', `socket,id=control0,path=${optPath(c.controlSocket)},server=on,wait=off`, '-serial', 'chardev:control0');
  if (c.vmGenId !== undefined) {
    if (!uuidRe.test(c.vmGenId)) throw new Error(`bad vmgenid "${c.vmGenId}"`);
    args.push('-device', `vmgenid,guid=${c.vmGenId}`);
  }
  args.push(
    '-qmp',
    `unix:${optPath(c.qmpSocket)},server=on,wait=off`,
    '-pidfile',
    optPath(c.pidFile),
    // QEMU forks into its own session: it is no child of the agent and outlives it.
    '-daemonize',
  );
  if (c.incoming) args.push('-incoming', 'defer', '-S');
  for (const addr of c.gpu?.pciAddresses ?? []) {
    if (!pciRe.test(addr)) throw new Error(`bad PCI address "${addr}": use the full form 0000:3b:00.0`);
    args.push('-device', `vfio-pci,host=${addr}`);
  }
  for (const uuid of c.gpu?.mdevUuids ?? []) {
    if (!uuidRe.test(uuid)) throw new Error(`bad mdev uuid "${uuid}"`);
    args.push('-device', `vfio-pci,sysfsdev=/sys/bus/mdev/devices/${uuid}`);
  }
  return args;
}
