import { randomBytes } from 'node:crypto';
import { mkdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { AppError } from '@fleet/agent-protocol';
import {
  type CreateSpec,
  invalidSpec,
  type MigrationSendReport,
  type MigrationTarget,
  sandboxExists,
  sandboxFailed,
  type SandboxInfo,
  sandboxNotFound,
  sandboxNotRunning,
} from '../../backend.js';
import { mustRun, runTool } from '../process/exec-util.js';
import { resolveQemuImage } from './image.js';
import { qmp } from './qmp.js';
import { DISK_FILE, qemuMetaSchema, switchToPostcopy, waitIncoming, waitMigration } from './state.js';
import { createSpecSchema, unsupportedByQemu, type VmRecord } from './vm-state.js';
import { allocate, writeSeed } from './vm-create.js';
import { checkSize, imageBuild, machineMismatch } from './vm-machine.js';
import { launchQemu, thaw } from './vm-boot.js';
import { plugNetwork } from './vm-network.js';
import { teardown } from './vm-teardown.js';
import type { QemuHost } from './vm-host.js';

/** Native live migration (backend.ts sendMigration; agent-protocol migration.ts): offer, incoming, send, complete. */

/** The machine a target must build to receive this VM's stream. */
export async function migrationOffer(qemu: QemuHost, name: string): Promise<Record<string, unknown>> {
  const r = await qemu.running(name);
  return qemu.machineMeta(r.state, await imageBuild(await resolveQemuImage(qemu.opts.imageDir, r.state.image)));
}

/**
 * The target's half: the VM is allocated here (its own address, MAC, tap,
 * seed and token), an empty overlay over the same image build, and a QEMU
 * waiting with `-incoming defer` behind TLS with a fresh pre-shared key;
 * answers where and with which key the source may send.
 */
export async function prepareIncoming(
  qemu: QemuHost,
  input: CreateSpec,
  machine: Record<string, unknown>,
  opts: { ttlMs: number; lazy?: boolean },
): Promise<MigrationTarget> {
  if (qemu.closed) throw sandboxFailed('the qemu backend is closed');
  if (input.egress && input.egress.mode !== 'none')
    throw unsupportedByQemu(`egress mode "${input.egress.mode}" (create with egress {"mode":"none"})`);
  const parsed = createSpecSchema.safeParse(input);
  if (!parsed.success) {
    throw invalidSpec(
      `invalid sandbox spec: ${parsed.error.issues.map((i) => `${i.path.join('.') || '(spec)'}: ${i.message}`).join('; ')}`,
      parsed.error.issues.map((i) => ({ path: i.path.join('.'), message: i.message })),
    );
  }
  const spec = parsed.data;
  if (spec.checkpointId || spec.resume)
    throw invalidSpec('a migrated VM comes from its stream, not a checkpoint', [
      { path: 'checkpoint_id', message: 'not with a migration' },
    ]);
  const m = qemuMetaSchema.safeParse(machine);
  if (!m.success) throw invalidSpec('machine is not a qemu migration offer', [{ path: 'machine', message: 'not a qemu offer' }]);
  const meta = m.data;
  checkSize(qemu, spec, meta, 'the source VM');
  if (meta.image && spec.image && meta.image !== spec.image) {
    throw invalidSpec(`the source VM runs image "${meta.image}", not "${spec.image}"`, [
      { path: 'image', message: 'conflicts with the source' },
    ]);
  }
  return qemu.locks.run(`vm:${spec.name}`, async () => {
    if (qemu.records.has(spec.name) || qemu.creating.has(spec.name)) throw sandboxExists(spec.name);
    const image = await resolveQemuImage(qemu.opts.imageDir, meta.image ?? spec.image ?? qemu.opts.defaultImage);
    const why = await machineMismatch(qemu, meta, image);
    if (why) throw new AppError('MIGRATION_INCOMPATIBLE', 409, `VM "${spec.name}" cannot migrate here: ${why}`, { name: spec.name });
    qemu.creating.add(spec.name);
    let record: VmRecord | undefined;
    try {
      record = await allocate(qemu, spec, image, meta.disk_bytes, '');
      const s = record.state;
      // Persisted before QEMU starts: an agent restarted mid-stream must still ask QEMU (memoryStatus), not answer done.
      if (opts.lazy) s.postcopy_incoming = true;
      const dir = qemu.vmDir(s.name);
      await plugNetwork(qemu, s);
      await qemu.firewall.apply(() => qemu.firewallState());
      // The stream carries the source overlay's blocks (block-incremental) onto an empty overlay over the same base.
      await mustRun('qemu-img', [
        'create',
        '-q',
        '-f',
        'qcow2',
        '-b',
        image.rootfs,
        '-F',
        'qcow2',
        join(dir, DISK_FILE),
        String(s.disk_bytes),
      ]);
      await writeSeed(qemu, s);
      const psk = randomBytes(32).toString('hex');
      const pskDir = await writePsk(dir, 'mig-in', psk);
      record.incoming = { pskDir, timer: setTimeout(() => void expireIncoming(qemu, s.name), opts.ttlMs) };
      record.incoming.timer.unref();
      await launchQemu(qemu, s, image, { incoming: true });
      await qemu.writeState(s);
      await qemu.startConsole(record);
      const q = qemu.qmpPath(s.name);
      await qmp(q, 'object-add', { 'qom-type': 'tls-creds-psk', id: MIG_TLS, endpoint: 'server', dir: pskDir });
      await qmp(q, 'migrate-set-parameters', { 'tls-creds': MIG_TLS });
      if (opts.lazy) {
        await qmp(q, 'migrate-set-capabilities', { capabilities: [{ capability: 'postcopy-ram', state: true }] });
      }
      await qmp(q, 'migrate-incoming', { uri: `tcp:${qemu.opts.publishHost}:0` });
      const st = (await qmp(q, 'query-migrate')) as { 'socket-address'?: Array<{ port?: string | number }> };
      const port = Number(st['socket-address']?.[0]?.port ?? 0);
      if (!port) throw sandboxFailed('QEMU did not say which port it listens on for the migration');
      const host = qemu.opts.advertiseHost ?? (qemu.opts.publishHost === '0.0.0.0' ? '127.0.0.1' : qemu.opts.publishHost);
      qemu.log?.info({ vm: s.name, port }, 'waiting for a live migration');
      return { uri: `tcp:${host}:${port}`, psk, expires_at: new Date(Date.now() + opts.ttlMs).toISOString() };
    } catch (err) {
      if (record) await teardown(qemu, record, { graceMs: 0 }).catch(() => undefined);
      else qemu.records.delete(spec.name);
      qemu.creating.delete(spec.name);
      throw err instanceof AppError
        ? err
        : sandboxFailed(`preparing the migration of "${spec.name}" failed: ${(err as Error).message}`, {}, err);
    }
  });
}

export async function expireIncoming(qemu: QemuHost, name: string): Promise<void> {
  if (await abortIncoming(qemu, name))
    qemu.log?.warn({ vm: name }, 'no live migration landed in time: what was prepared for it is removed');
}

/**
 * The caller gives up a prepared migration (its send failed, or it never
 * came): what was prepared goes now, not at its ttl. A migration that has
 * landed is no longer incoming: destroy that VM instead.
 */
export async function abortIncoming(qemu: QemuHost, name: string): Promise<boolean> {
  return qemu.locks.run(`vm:${name}`, async () => {
    const r = qemu.records.get(name);
    if (!r?.incoming) return false;
    await teardown(qemu, r, { graceMs: 0 }).catch(() => undefined);
    qemu.creating.delete(name);
    return true;
  });
}

/**
 * The source's half: the guest's memory and its overlay's blocks stream to
 * the target in TLS under the key the target minted (a listener without it
 * gets a failed handshake, never a byte of the guest). Completed, the
 * source stays stopped (`paused`): destroy it, or resume it if the target
 * failed. A failed send leaves the source running.
 */
export async function sendMigration(
  qemu: QemuHost,
  name: string,
  to: { uri: string; psk: string },
  opts: { lazy?: boolean } = {},
): Promise<MigrationSendReport> {
  const lazy = opts.lazy === true;
  if (lazy && !qemu.lazyPages)
    throw new AppError('LAZY_MIGRATION_UNSUPPORTED', 409, 'this host has no userfaultfd: post-copy is not possible');
  const r = await qemu.running(name);
  if (!/^tcp:[A-Za-z0-9.-]{1,253}:\d{1,5}$/.test(to.uri) || !/^[0-9a-f]{64}$/.test(to.psk)) {
    throw invalidSpec('to.uri must be tcp:<host>:<port> and to.psk 64 hex digits', [{ path: 'to', message: 'invalid target' }]);
  }
  return qemu.locks.run(`vm:${name}`, async () => {
    const s = r.state;
    if (s.status !== 'running' || !(await qemu.alive(s))) throw sandboxNotRunning(name);
    const q = qemu.qmpPath(name);
    const pskDir = await writePsk(qemu.vmDir(name), 'mig-out', to.psk);
    let st: Awaited<ReturnType<typeof waitMigration>>;
    try {
      await qmp(q, 'object-del', { id: MIG_TLS }).catch(() => undefined);
      await qmp(q, 'object-add', { 'qom-type': 'tls-creds-psk', id: MIG_TLS, endpoint: 'client', dir: pskDir, username: PSK_USER });
      await qmp(q, 'migrate-set-capabilities', {
        capabilities: [
          { capability: 'block', state: true },
          { capability: 'postcopy-ram', state: lazy },
        ],
      });
      await qmp(q, 'migrate-set-parameters', { 'tls-creds': MIG_TLS, 'block-incremental': true, 'max-bandwidth': 8 * 1024 ** 3 });
      const t0 = Date.now();
      await qmp(q, 'migrate', { uri: to.uri });
      if (lazy) {
        st = await switchToPostcopy(q, 600_000, () => qemu.alive(s));
        st = { ...st, downtime: st.downtime ?? Date.now() - t0 };
      } else {
        st = await waitMigration(q, 600_000, () => qemu.alive(s));
      }
    } catch (err) {
      // QEMU resumed the guest itself (it was running): only our settings are undone.
      await qmp(q, 'migrate-set-parameters', { 'tls-creds': '', 'block-incremental': false }).catch(() => undefined);
      await qmp(q, 'object-del', { id: MIG_TLS }).catch(() => undefined);
      throw new AppError('MIGRATION_FAILED', 424, `the live migration of "${name}" failed; it runs on here: ${(err as Error).message}`, {
        name,
      });
    } finally {
      await rm(pskDir, { recursive: true, force: true });
    }
    for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
    s.status = 'paused';
    s.paused_checkpoint = '';
    await qemu.writeState(s);
    if (lazy) {
      // The guest runs on the target now; the rest of its memory still comes from here.
      r.draining = waitMigration(q, 3_600_000, () => qemu.alive(s)).then(
        () => qemu.log?.info({ vm: name }, 'post-copy migration complete: the source is no longer needed'),
        (err: unknown) =>
          qemu.log?.error({ vm: name, err: (err as Error).message }, 'post-copy migration failed: the target guest is lost'),
      );
    }
    const report = {
      downtime_ms: st.downtime ?? 0,
      total_ms: st['total-time'] ?? 0,
      transferred_bytes: (st.ram?.transferred ?? 0) + (st.disk?.transferred ?? 0),
      ...(lazy ? { lazy: true } : {}),
    };
    qemu.log?.info({ vm: name, ...report }, 'live migration sent');
    return report;
  });
}

/** The target's last step: the stream has landed; the guest is told who it is here and runs (or stays frozen: keepPaused). */
export async function completeIncoming(qemu: QemuHost, name: string, opts: { keepPaused: boolean }): Promise<SandboxInfo> {
  return qemu.locks.run(`vm:${name}`, async () => {
    const r = qemu.records.get(name);
    if (!r?.incoming) throw new AppError('MIGRATION_NOT_FOUND', 404, `no live migration of "${name}" is waiting on this host`, { name });
    const s = r.state;
    const incoming = r.incoming;
    try {
      await waitIncoming(qemu.qmpPath(name), 60_000, () => qemu.alive(s));
      clearTimeout(incoming.timer);
      r.incoming = undefined;
      const q = qemu.qmpPath(name);
      await qmp(q, 'migrate-set-parameters', { 'tls-creds': '' }).catch(() => undefined);
      await qmp(q, 'object-del', { id: MIG_TLS }).catch(() => undefined);
      await rm(incoming.pskDir, { recursive: true, force: true });
      await runTool('ip', ['neigh', 'del', s.ip, 'dev', s.bridge]);
      s.status = 'paused';
      if (opts.keepPaused) {
        await qemu.writeState(s);
        return await qemu.info(r);
      }
      return await thaw(qemu, r);
    } catch (err) {
      await teardown(qemu, r, { graceMs: 0 }).catch(() => undefined);
      throw err;
    } finally {
      qemu.creating.delete(name);
    }
  });
}

/**
 * The seed's MemoryStatus of a VM on this host. One that came by post-copy
 * runs before its memory is all here; its QEMU knows whether the rest has
 * arrived (query-migrate on the receiving side: completed) or its stream
 * broke (postcopy-paused, failed: the guest waits for pages that will not
 * come). QEMU does not count the pages it receives, so the memory is one
 * chunk: resident once the stream completed. Any other VM has its memory.
 * Which VMs came by post-copy is in their state.json (postcopy_incoming),
 * never only in this process: a restarted agent asks QEMU just the same.
 */
export async function memoryStatus(
  qemu: QemuHost,
  name: string,
): Promise<{ resident_chunks: number; total_chunks: number; done: boolean; error?: string }> {
  const r = qemu.records.get(name);
  if (!r) throw sandboxNotFound(name);
  if (!r.state.postcopy_incoming) return { resident_chunks: 0, total_chunks: 0, done: true };
  if (!(await qemu.alive(r.state))) return { resident_chunks: 0, total_chunks: 1, done: false, error: 'its QEMU has exited' };
  const st = (await qmp(qemu.qmpPath(name), 'query-migrate')) as { status?: string; 'error-desc'?: string };
  // No status: this QEMU was launched afresh (a resume, a restore), not by the stream; its memory is all its own.
  if (st.status === 'completed' || st.status === undefined || st.status === 'none') {
    await qemu.locks.run(`vm:${name}`, async () => {
      if (qemu.records.get(name) !== r || !r.state.postcopy_incoming) return;
      delete r.state.postcopy_incoming;
      await qemu.writeState(r.state);
    });
    return { resident_chunks: 1, total_chunks: 1, done: true };
  }
  if (st.status === 'failed' || st.status === 'cancelled' || st.status === 'postcopy-paused' || st.status === 'postcopy-recover')
    return {
      resident_chunks: 0,
      total_chunks: 1,
      done: false,
      error: `the post-copy stream from the source broke (QEMU ${st.status}${st['error-desc'] ? `: ${st['error-desc']}` : ''}); the rest of the guest's memory is not coming`,
    };
  return { resident_chunks: 0, total_chunks: 1, done: false };
}

export const MIG_TLS = 'fleet-migration-tls';
export const PSK_USER = 'fleet';

/** QEMU's tls-creds-psk reads `<dir>/keys.psk` ("user:hexkey"): a directory of its own, 0700, removed after use. */
export async function writePsk(vmDir: string, name: string, psk: string): Promise<string> {
  const dir = join(vmDir, name);
  await rm(dir, { recursive: true, force: true });
  await mkdir(dir, { mode: 0o700 });
  await writeFile(join(dir, 'keys.psk'), `${PSK_USER}:${psk}\n`, { mode: 0o600 });
  return dir;
}
