import { mkdir, symlink, writeFile } from 'node:fs/promises';
import { dirname, join, relative } from 'node:path';

/**
 * A fake sysfs and /dev, laid out as the kernel does (relative links into
 * /sys/devices), for the GPU probe (packages/agent/src/backend/qemu/gpu-probe.ts).
 * No VFIO hardware exists on the test machines: this is what the probe reads
 * on a host that has it.
 *
 *   0000:3b:00.0  10de:20b0 (A100) on vfio-pci, IOMMU group 40, /dev/vfio/40     → offered
 *   0000:af:00.0  10de:20b0 (A100) on vfio-pci, IOMMU group 41, no /dev/vfio/41  → not offered
 *   0000:d8:00.0  10de:20b0 (A100) on vfio-pci, group 42 shared with 0000:d8:00.1 on snd_hda_intel → not offered
 *   0000:86:00.0  8086:1572 (a NIC, class 0x020000) on vfio-pci → not a GPU
 *   0000:5e:00.0  10de:20b0 on nvidia in MIG mode, two mdevs of type "GRID A100-1-5C"
 *                 (groups 50, 51) and one of the time-sliced "GRID A100-4C" (group 52) → two MIG instances
 */

export const OFFERED_PCI = '0000:3b:00.0';
export const MIG_PARENT_PCI = '0000:5e:00.0';
export const MDEV_A = '3b5c4f2e-6a1d-4c8e-9f0a-111111111111';
export const MDEV_B = '3b5c4f2e-6a1d-4c8e-9f0a-222222222222';
export const MDEV_TIMESLICED = '3b5c4f2e-6a1d-4c8e-9f0a-333333333333';

async function link(target: string, at: string): Promise<void> {
  await mkdir(dirname(at), { recursive: true });
  await symlink(relative(dirname(at), target), at);
}

async function pciDevice(
  sys: string,
  addr: string,
  ids: { vendor: string; device: string; class: string },
  driver: string,
  group?: string,
): Promise<string> {
  const dir = join(sys, 'devices', 'pci0000:00', addr);
  await mkdir(dir, { recursive: true });
  await writeFile(join(dir, 'vendor'), `0x${ids.vendor}\n`);
  await writeFile(join(dir, 'device'), `0x${ids.device}\n`);
  await writeFile(join(dir, 'class'), `0x${ids.class}\n`);
  await mkdir(join(sys, 'bus', 'pci', 'drivers', driver), { recursive: true });
  await link(join(sys, 'bus', 'pci', 'drivers', driver), join(dir, 'driver'));
  await link(dir, join(sys, 'bus', 'pci', 'drivers', driver, addr));
  await link(dir, join(sys, 'bus', 'pci', 'devices', addr));
  if (group !== undefined) await joinGroup(sys, dir, addr, group);
  return dir;
}

async function joinGroup(sys: string, devDir: string, id: string, group: string): Promise<void> {
  const g = join(sys, 'kernel', 'iommu_groups', group);
  await mkdir(join(g, 'devices'), { recursive: true });
  await link(g, join(devDir, 'iommu_group'));
  await link(devDir, join(g, 'devices', id));
}

async function mdev(sys: string, parentDir: string, uuid: string, type: string, typeName: string, group: string): Promise<void> {
  const typeDir = join(parentDir, 'mdev_supported_types', type);
  await mkdir(typeDir, { recursive: true });
  await writeFile(join(typeDir, 'name'), `${typeName}\n`);
  const dir = join(parentDir, uuid);
  await mkdir(dir, { recursive: true });
  await link(typeDir, join(dir, 'mdev_type'));
  await link(dir, join(sys, 'bus', 'mdev', 'devices', uuid));
  await joinGroup(sys, dir, uuid, group);
}

const A100 = { vendor: '10de', device: '20b0', class: '030200' };

/** Builds the tree above under `root` (sys/ and dev/); returns the two roots. */
export async function makeGpuFixture(root: string): Promise<{ sysfsRoot: string; devRoot: string }> {
  const sys = join(root, 'sys');
  const dev = join(root, 'dev');
  await mkdir(join(dev, 'vfio'), { recursive: true });
  for (const g of ['40', '42', '50', '51', '52']) await writeFile(join(dev, 'vfio', g), '');
  await pciDevice(sys, OFFERED_PCI, A100, 'vfio-pci', '40');
  await pciDevice(sys, '0000:af:00.0', A100, 'vfio-pci', '41');
  await pciDevice(sys, '0000:d8:00.0', A100, 'vfio-pci', '42');
  const audio = await pciDevice(sys, '0000:d8:00.1', { vendor: '10de', device: '1aef', class: '040300' }, 'snd_hda_intel');
  await joinGroup(sys, audio, '0000:d8:00.1', '42');
  await pciDevice(sys, '0000:86:00.0', { vendor: '8086', device: '1572', class: '020000' }, 'vfio-pci', '43');
  await writeFile(join(dev, 'vfio', '43'), '');
  const parent = await pciDevice(sys, MIG_PARENT_PCI, A100, 'nvidia');
  await mdev(sys, parent, MDEV_A, 'nvidia-699', 'GRID A100-1-5C', '50');
  await mdev(sys, parent, MDEV_B, 'nvidia-699', 'GRID A100-1-5C', '51');
  await mdev(sys, parent, MDEV_TIMESLICED, 'nvidia-472', 'GRID A100-4C', '52');
  return { sysfsRoot: sys, devRoot: dev };
}
