import { rm } from 'node:fs/promises';
import type { DestroyOptions } from '../../backend.js';
import { runTool, sleep } from '../process/exec-util.js';
import { guestRun } from './guest-client.js';
import { qmp } from './qmp.js';
import { nameRe } from '../spec-rules.js';
import type { VmRecord, VmState } from './vm-state.js';
import type { QemuHost } from './vm-host.js';

/** Stop (ACPI, then SIGKILL) and destroy: everything a VM made is removed. */

export async function destroyVm(qemu: QemuHost, name: string, opts: DestroyOptions = {}): Promise<void> {
  if (!nameRe.test(name)) return;
  await qemu.locks.run(`vm:${name}`, async () => {
    const r = qemu.records.get(name) ?? (await qemu.readRecord(name));
    if (!r) {
      await rm(qemu.vmDir(name), { recursive: true, force: true });
      return;
    }
    if (opts.drainCommand && (await qemu.alive(r.state))) {
      await guestRun(qemu.target(r.state), ['sh', '-c', opts.drainCommand], {
        timeoutMs: opts.graceMs ?? 5_000,
        connectTimeoutMs: 2_000,
      }).catch((err: unknown) => qemu.log?.warn({ vm: name, err: (err as Error).message }, 'drain command failed'));
    }
    await teardown(qemu, r, opts);
    qemu.log?.info({ vm: name }, 'VM destroyed');
  });
}

/**
 * backend.go.txt Stop: ACPI power button (the guest's acpid powers off), then
 * SIGKILL once `graceMs` has passed. Resolves when QEMU is gone.
 */
export async function stopVm(qemu: QemuHost, s: VmState, graceMs: number): Promise<'acpi' | 'killed' | 'gone'> {
  if (!(await qemu.alive(s))) return 'gone';
  if (graceMs > 0) {
    const asked = await qmp(qemu.qmpPath(s.name), 'system_powerdown').then(
      () => true,
      () => false,
    );
    const until = Date.now() + graceMs;
    while (asked && Date.now() < until) {
      if (!(await qemu.alive(s))) return 'acpi';
      await sleep(100);
    }
  }
  if (await qemu.alive(s)) {
    try {
      process.kill(s.pid, 'SIGKILL');
    } catch {
      // gone between the check and the kill
    }
  }
  for (let i = 0; i < 100 && (await qemu.alive(s)); i++) await sleep(50);
  return 'killed';
}

export async function teardown(qemu: QemuHost, r: VmRecord, opts: DestroyOptions): Promise<void> {
  const s = r.state;
  // A post-copy source still feeds its guest on the target: it goes once the last page has.
  if (r.draining) await r.draining;
  for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
  // A stopped guest (paused, or frozen after a migration) cannot answer the power button.
  await stopVm(qemu, s, s.status === 'paused' ? 0 : (opts.graceMs ?? 5_000));
  await r.console?.close().catch(() => undefined);
  if (r.incoming) clearTimeout(r.incoming.timer);
  r.console = undefined;
  await rm(qemu.qmpPath(s.name), { force: true });
  await rm(qemu.serialPath(s.name), { force: true });
  await rm(qemu.controlPath(s.name), { force: true });
  if (s.paused_checkpoint) await qemu.store.delete(s.paused_checkpoint).catch(() => undefined);
  await runTool('ip', ['route', 'del', `${s.ip}/32`, 'dev', s.bridge]);
  await runTool('ip', ['link', 'del', s.tap]);
  qemu.records.delete(s.name);
  await qemu.firewall.apply(() => qemu.firewallState());
  if (![...qemu.records.values()].some((o) => o.state.bridge === s.bridge)) await runTool('ip', ['link', 'del', s.bridge]);
  await rm(qemu.vmDir(s.name), { recursive: true, force: true });
}
