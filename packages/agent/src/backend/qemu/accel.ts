import { spawn } from 'node:child_process';
import { access, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { sleep } from '../process/exec-util.js';

export type Accel = 'kvm' | 'tcg';

export interface AccelReport {
  readonly accel: Accel;
  /** backend.go.txt NestedVirtSupported: guests get VMX/SVM only under KVM with the kvm module's `nested` on. */
  readonly nestedVirtSupported: boolean;
  /** Why this accelerator: shown in the agent's start log. */
  readonly reason: string;
}

/**
 * Whether KVM actually runs a guest here. `/dev/kvm` existing proves
 * nothing: in a nested setup it opens fine and guests then crawl or hang. The
 * probe boots QEMU's own firmware (SeaBIOS, no disk) under KVM, with the CPU
 * model real VMs use, and waits for
 * it to finish POST ("No bootable device." on its debug port): TCG gets there
 * in well under a second here, so a KVM that cannot within `timeoutMs` is
 * worse than no KVM.
 */
export async function probeKvm(opts: { qemu?: string; timeoutMs?: number } = {}): Promise<{ ok: boolean; reason: string }> {
  const ok = await access('/dev/kvm').then(
    () => true,
    () => false,
  );
  if (!ok) return { ok: false, reason: '/dev/kvm is absent' };
  return firmwarePosts('kvm', opts);
}

/** Boots SeaBIOS under `accel` and reports whether POST completes in time. Exported for the test of TCG. */
export async function firmwarePosts(
  accel: Accel,
  opts: { qemu?: string; timeoutMs?: number } = {},
): Promise<{ ok: boolean; reason: string }> {
  const timeoutMs = opts.timeoutMs ?? 3_000;
  const dir = await mkdtemp(join(tmpdir(), 'fleet-kvm-probe-'));
  const log = join(dir, 'debugcon');
  const child = spawn(
    opts.qemu ?? 'qemu-system-x86_64',
    [
      '-machine',
      `q35,accel=${accel}`,
      // The CPU model real VMs get (command.ts): here KVM boots the default model but aborts on `host` (an MSR it cannot set).
      '-cpu',
      accel === 'kvm' ? 'host' : 'max',
      '-nodefaults',
      '-no-user-config',
      '-display',
      'none',
      '-m',
      '16',
      '-debugcon',
      `file:${log}`,
      '-global',
      'isa-debugcon.iobase=0x402',
      '-no-reboot',
    ],
    { stdio: ['ignore', 'ignore', 'pipe'] },
  );
  // Mutated by the child's callbacks while the loop below polls.
  const state = { stderr: '', exited: false };
  child.stderr.setEncoding('utf8').on('data', (d: string) => (state.stderr += d));
  child.on('exit', () => (state.exited = true));
  child.on('error', (err) => {
    state.exited = true;
    state.stderr += err.message;
  });
  const started = Date.now();
  try {
    while (Date.now() - started < timeoutMs) {
      const text = await readFile(log, 'utf8').catch(() => '');
      if (text.includes('No bootable device')) return { ok: true, reason: `${accel}: firmware POST in ${Date.now() - started} ms` };
      if (state.exited) return { ok: false, reason: `${accel}: qemu exited: ${state.stderr.trim().slice(0, 300)}` };
      await sleep(50);
    }
    return { ok: false, reason: `${accel}: firmware did not finish POST within ${timeoutMs} ms (nested virtualization too slow or hung)` };
  } finally {
    if (!state.exited) child.kill('SIGKILL');
    await rm(dir, { recursive: true, force: true });
  }
}

async function kvmNested(): Promise<boolean> {
  for (const mod of ['kvm_intel', 'kvm_amd']) {
    const v = await readFile(`/sys/module/${mod}/parameters/nested`, 'utf8').catch(() => '');
    if (/^(Y|1)/.test(v.trim())) return true;
  }
  return false;
}

/** `wanted`: auto probes; kvm insists (start-up fails if the probe does); tcg never tries KVM. */
export async function chooseAccel(wanted: 'auto' | Accel, opts: { qemu?: string; timeoutMs?: number } = {}): Promise<AccelReport> {
  if (wanted === 'tcg') return { accel: 'tcg', nestedVirtSupported: false, reason: 'AGENT_QEMU_ACCEL=tcg' };
  const probe = await probeKvm(opts);
  if (probe.ok) return { accel: 'kvm', nestedVirtSupported: await kvmNested(), reason: probe.reason };
  if (wanted === 'kvm') throw new Error(`AGENT_QEMU_ACCEL=kvm but KVM does not work here: ${probe.reason}`);
  return { accel: 'tcg', nestedVirtSupported: false, reason: `falling back to TCG: ${probe.reason}` };
}
