import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';
import { AppError } from '@fleet/agent-protocol';
import { type Checkpoint, invalidSpec } from '../../backend.js';
import { mustRun } from '../process/exec-util.js';
import type { QemuImage } from './image.js';
import type { QemuMeta } from './state.js';
import { createSpecSchema } from './vm-state.js';
import type { QemuHost } from './vm-host.js';

/** Whether a captured state fits this machine: accelerator, QEMU build, image build, size. */

/** A state loads only into the machine it came from: same accelerator, QEMU build and base image build. */
export async function checkMachine(qemu: QemuHost, cp: Checkpoint, meta: QemuMeta, image: QemuImage): Promise<void> {
  const why = await machineMismatch(qemu, meta, image);
  if (why) throw new AppError('CHECKPOINT_INCOMPATIBLE', 409, `checkpoint "${cp.id}" cannot be resumed here: ${why}`, { id: cp.id });
}

export async function machineMismatch(qemu: QemuHost, meta: QemuMeta, image: QemuImage): Promise<string> {
  return meta.accel !== qemu.accel.accel
    ? `it was captured under ${meta.accel}, this host runs ${qemu.accel.accel}`
    : meta.qemu_version !== qemu.qemuVersion
      ? `it was written by "${meta.qemu_version}", this host runs "${qemu.qemuVersion}"`
      : meta.image_build !== (await imageBuild(image))
        ? `its disk is a delta over another build of image "${image.name}"`
        : '';
}

/** A state loads only into a machine of its size. */
export function checkSize(qemu: QemuHost, spec: z.infer<typeof createSpecSchema>, meta: QemuMeta, what: string): void {
  const fields: { path: string; message: string }[] = [];
  if (Math.max(1, Math.ceil(spec.cpus)) !== meta.cpus) fields.push({ path: 'cpus', message: `the state was captured with ${meta.cpus}` });
  if (spec.ram_mb !== meta.ram_mb) fields.push({ path: 'ram_mb', message: `the state was captured with ${meta.ram_mb}` });
  if ((spec.storage_gb ?? 0) * 1024 ** 3 > meta.disk_bytes) fields.push({ path: 'storage_gb', message: 'larger than the captured disk' });
  if (fields.length > 0) {
    throw invalidSpec(
      `${what} holds the memory of a VM of another size: a resumed VM keeps its machine (${fields.map((f) => f.path).join(', ')})`,
      fields,
    );
  }
}

/** Identifies one build of an image (image.json carries its build time): a qcow2 delta is valid only over that build. */
export async function imageBuild(image: QemuImage): Promise<string> {
  return createHash('sha256')
    .update(await readFile(join(image.dir, 'image.json')))
    .digest('hex');
}

export async function virtualSize(path: string): Promise<number> {
  const out = await mustRun('qemu-img', ['info', '--output=json', '-U', path]);
  return (JSON.parse(out) as { 'virtual-size': number })['virtual-size'];
}
