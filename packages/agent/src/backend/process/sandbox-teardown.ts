import { existsSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { join } from 'node:path';
import { sandboxFailed, type DestroyOptions } from '../../backend.js';
import { sleep } from './exec-util.js';
import { spawnInSandbox } from './guest-exec.js';
import { deleteLink, detachSandbox } from './network.js';
import type { SandboxHost } from './sandbox-host.js';
import type { SandboxRecord } from './sandbox-state.js';
import { DISK_IMAGE, removeDisk } from './storage.js';

export async function teardownSandbox(host: SandboxHost, record: SandboxRecord, opts: DestroyOptions): Promise<void> {
  const s = record.state;
  const graceMs = opts.graceMs ?? 5000;
  const alive = await host.isAlive(s);
  if (alive && opts.drainCommand) {
    try {
      const h = await spawnInSandbox(host, s.name, { argv: ['/bin/sh', '-c', opts.drainCommand], stdin: false }).catch(() => null);
      if (h) {
        h.stdout.resume();
        h.stderr.resume();
        const timer = setTimeout(() => h.kill('SIGKILL'), graceMs);
        await h.wait().finally(() => clearTimeout(timer));
      }
    } catch (err) {
      host.log?.warn({ err, sandbox: s.name }, 'drain command failed');
    }
  }
  // Every step runs even if an earlier one failed, and the record is always dropped: what a failed
  // step leaves behind is prune()'s, and state.json (removed last) lets a second destroy retry.
  const failures: string[] = [];
  const step = async (what: string, fn: () => Promise<unknown>): Promise<void> => {
    try {
      await fn();
    } catch (err) {
      failures.push(`${what}: ${(err as Error).message}`);
    }
  };
  await step('endpoints', () => host.unpublish(record));
  if (alive) {
    await step('init', async () => {
      // Killing a pid namespace's init kills every process in it; its mounts go with it.
      try {
        process.kill(s.init_pid, 'SIGKILL');
      } catch {
        /* gone */
      }
      for (let i = 0; i < 500 && (await host.isAlive(s)); i++) await sleep(5);
      if (await host.isAlive(s)) throw new Error(`init ${s.init_pid} survived SIGKILL for 2.5 s`);
    });
  }
  await step('cgroup', () => host.cgroups.remove(s.name));
  await step('network', () => detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip }));
  if (host.records.get(s.name) === record) host.records.delete(s.name);
  await step('firewall', () => host.firewall.apply(() => host.firewallState()));
  await step('forwarding', () => host.syncBridgeForwarding(s.bridge));
  await step('bridge', () =>
    host.locks.run(`br:${s.bridge}`, async () => {
      if (![...host.records.values()].some((r) => r.state.bridge === s.bridge)) {
        host.bridgesReady.delete(s.bridge);
        await deleteLink(s.bridge);
      }
    }),
  );
  if (s.storage_gb > 0 || existsSync(join(host.sandboxDir(s.name), DISK_IMAGE)))
    await step('disk', () => removeDisk(host.sandboxDir(s.name)));
  await step('logs', () => host.observer.keepLogs(s.name, host.sandboxDir(s.name)));
  if (s.paused_checkpoint) await step('pause checkpoint', () => host.checkpoints.delete(s.paused_checkpoint));
  await step('directory', () => rm(host.sandboxDir(s.name), { recursive: true, force: true }));
  await step('empty directory', () => rm(host.emptyDir(s.name), { recursive: true, force: true }));
  if (failures.length > 0) {
    host.log?.warn({ sandbox: s.name, failures }, 'teardown incomplete');
    throw sandboxFailed(`tearing down sandbox "${s.name}" was incomplete (${failures.join('; ')}); destroy again or prune`, {
      name: s.name,
    });
  }
}
