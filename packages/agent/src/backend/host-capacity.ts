import { statfs } from 'node:fs/promises';
import { availableParallelism, totalmem } from 'node:os';
import type { GpuDevice, HostCapacity, MigInstance } from '@fleet/agent-protocol';
import { runTool } from './process/exec-util.js';

/** Node's process.arch in GOARCH vocabulary. */
export function goArch(nodeArch: string = process.arch): string {
  const map: Record<string, string> = {
    x64: 'amd64',
    ia32: '386',
    arm64: 'arm64',
    arm: 'arm',
    ppc64: 'ppc64le',
    s390x: 's390x',
    riscv64: 'riscv64',
    loong64: 'loong64',
    mips: 'mips',
    mipsel: 'mipsle',
  };
  return map[nodeArch] ?? nodeArch;
}

const GPU_QUERY = 'uuid,name,pci.bus_id,memory.total,driver_version,compute_cap,mig.mode.current';

/** Parses `nvidia-smi --query-gpu=<GPU_QUERY> --format=csv,noheader,nounits`. */
export function parseGpuCsv(csv: string): GpuDevice[] {
  const out: GpuDevice[] = [];
  for (const line of csv.split('\n')) {
    if (!line.trim()) continue;
    const [uuid, model, bus, mem, driver, cap, mig] = line.split(',').map((f) => f.trim());
    if (!uuid) continue;
    const known = (v: string | undefined): v is string => !!v && !/^\[?(N\/A|Not Supported)\]?$/i.test(v);
    const dev: GpuDevice = { uuid };
    if (known(model)) dev.model = model;
    if (known(bus)) dev.pci_bus_id = bus;
    if (known(mem) && Number.isFinite(Number(mem))) dev.memory_mb = Math.round(Number(mem));
    if (known(driver)) dev.driver_version = driver;
    if (known(cap)) dev.compute_cap = cap;
    if (known(mig)) {
      dev.mig_capable = true;
      dev.mig_mode = mig;
    }
    out.push(dev);
  }
  return out;
}

/** Parses `nvidia-smi -L`: MIG lines are indented under their GPU line. */
export function parseMigList(text: string): MigInstance[] {
  const out: MigInstance[] = [];
  let parent: string | undefined;
  for (const line of text.split('\n')) {
    const gpu = /^GPU \d+:.*\(UUID: ([^)]+)\)/.exec(line);
    if (gpu) {
      parent = gpu[1];
      continue;
    }
    const mig = /^\s+MIG\s+(\S+)\s+Device\s+\d+:\s+\(UUID: ([^)]+)\)/.exec(line);
    const [, profile, uuid] = mig ?? [];
    if (profile && uuid) out.push({ uuid, profile, kind: 'mig', ...(parent ? { parent_gpu_uuid: parent } : {}) });
  }
  return out;
}

/** A short GPU kind from a model name: "NVIDIA A100-SXM4-40GB" → "a100". */
export function gpuKind(model: string | undefined): string | undefined {
  if (!model) return undefined;
  const m = /\b([A-Z]{1,3}\d{2,4}[A-Za-z]*)\b/.exec(model.replace(/^NVIDIA\s+/i, '').replace(/GeForce|Tesla|RTX|Quadro/gi, ' '));
  return (m?.[1] ?? model).toLowerCase();
}

export async function probeCapacity(opts: { dataDir: string; maxSandboxes: number }): Promise<HostCapacity> {
  const fs = await statfs(opts.dataDir);
  const cap: HostCapacity = {
    cpus: availableParallelism(),
    ram_mb: Math.floor(totalmem() / (1024 * 1024)),
    storage_gb: Math.floor((fs.bavail * fs.bsize) / 1024 ** 3),
    vm_count: opts.maxSandboxes,
    arch: goArch(),
  };
  const q = await runTool('nvidia-smi', [`--query-gpu=${GPU_QUERY}`, '--format=csv,noheader,nounits'], { timeoutMs: 10_000 }).catch(
    () => null,
  );
  if (!q || q.code !== 0) return cap;
  const devices = parseGpuCsv(q.stdout);
  const list = await runTool('nvidia-smi', ['-L'], { timeoutMs: 10_000 }).catch(() => null);
  const migs = list && list.code === 0 ? parseMigList(list.stdout) : [];
  // A GPU in MIG mode is never part of the whole-device pool.
  const migParents = new Set(migs.map((m) => m.parent_gpu_uuid));
  const whole = devices.filter((d) => !migParents.has(d.uuid) && d.mig_mode?.toLowerCase() !== 'enabled');
  const [first] = whole;
  if (first) {
    cap.gpus = whole.length;
    const kind = gpuKind(first.model);
    if (kind) cap.gpu_kind = kind;
    cap.gpu_devices = whole;
  }
  if (migs.length > 0) {
    cap.mig_instances = migs;
    const profiles: Record<string, number> = {};
    for (const m of migs) profiles[m.profile] = (profiles[m.profile] ?? 0) + 1;
    cap.mig_profiles = profiles;
  }
  return cap;
}

/**
 * What a backend that cannot pass devices through (process) may offer: the
 * probe without GPUs and MIG instances, and what was left out, to say so.
 * Offering them would make the control plane refuse the whole host
 * (HOST_GPU_REQUIRES_QEMU), which is how `npm start` failed on a machine
 * where nvidia-smi answers.
 */
export function withoutDevices(cap: HostCapacity): { capacity: HostCapacity; leftOut: string[] } {
  const { gpus, gpu_kind, gpu_devices, mig_instances, mig_profiles, ...rest } = cap;
  const leftOut: string[] = [];
  const whole = gpu_devices?.length ?? gpus ?? 0;
  if (whole > 0) leftOut.push(`${whole} GPU${whole === 1 ? '' : 's'}${gpu_kind ? ` (${gpu_kind})` : ''}`);
  const migs = mig_instances?.length ?? Object.values(mig_profiles ?? {}).reduce((a, b) => a + b, 0);
  if (migs > 0) leftOut.push(`${migs} MIG instance${migs === 1 ? '' : 's'}`);
  return { capacity: rest, leftOut };
}
