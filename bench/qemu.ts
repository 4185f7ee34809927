import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { buildQemuImage } from '../packages/agent/src/backend/qemu/image.js';
import { missingPrerequisite, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from '../test/agent/harness.js';

/**
 * `npm run bench -- qemu [--runs N] [--execs N]`
 *
 * The qemu backend beside the process backend, one agent each on this
 * machine: VM image build, create → first successful exec (N runs, default
 * 2: a TCG boot takes tens of seconds), exec round trip of `true` (p50 over
 * --execs, default 30), destroy (ACPI power-off for a VM). The accelerator
 * is whatever the agent's probe chose (printed): TCG on a host without
 * working KVM. Then memory state on the first VM, where the backend has it
 * (qemu always; process with CRIU): live snapshot (guest stopped for
 * pause_ms), pause, resume, fork of the snapshot; and for qemu a live
 * migration to a second qemu agent (QEMU's downtime and the whole send)
 * and a lazy (post-copy) one back: time to running on the first agent,
 * and to all of its memory there.
 */
export default async function qemuBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: number) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const runs = opt('runs', 2);
  const execs = opt('execs', 30);
  const log = (s: string) => process.stdout.write(`${s}\n`);
  const missing = await missingPrerequisite();
  if (missing) throw new Error(`cannot run the qemu benchmark: ${missing}`);
  const images = await prepareImages();
  if ('skip' in images) throw new Error(`cannot run the qemu benchmark: ${images.skip}`);
  const dirs: string[] = [];
  const agents: RunningAgent[] = [];
  const p50 = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)] ?? NaN;
  try {
    const t0 = Date.now();
    await buildQemuImage(images.imageDir, 'base', { force: true });
    log(`qemu image build: ${Date.now() - t0} ms`);
    for (const backend of ['process', 'qemu'] as const) {
      const dataDir = await mkdtemp(join(tmpdir(), `bench-${backend}-`));
      dirs.push(dataDir);
      const agent = await startAgent(
        {
          dataDir,
          imageDir: images.imageDir,
          subnet: uniqueSubnet(),
          bridgePrefix: uniquePrefix(),
          env: { AGENT_LOG_LEVEL: 'warn', AGENT_BACKEND: backend },
        },
        60_000,
      );
      agents.push(agent);
      const cap = await agent.client.capacity();
      const boots: number[] = [];
      const rtts: number[] = [];
      const destroys: number[] = [];
      for (let i = 0; i < runs; i++) {
        const name = `bench-${backend}-${i}`;
        const started = Date.now();
        await agent.client.createVm({ name, cpus: 1, ram_mb: 256, tenant: 'bench' }, { timeoutMs: 600_000 });
        const first = await agent.client.exec(name, { argv: ['true'] });
        if (first.exit_code !== 0) throw new Error(`first exec in ${name} failed`);
        boots.push(Date.now() - started);
        if (i === 0) {
          for (let k = 0; k < execs; k++) {
            const s = process.hrtime.bigint();
            await agent.client.exec(name, { argv: ['true'] });
            rtts.push(Number(process.hrtime.bigint() - s) / 1e6);
          }
          if (cap.live_snapshot) log(`${backend}: ${await memoryFigures(agent, name, backend === 'qemu' ? images.imageDir : undefined)}`);
          else log(`${backend}: no memory state on this host (no CRIU)`);
        }
        const d = Date.now();
        await agent.client.destroyVm(name, { timeoutMs: 60_000 });
        destroys.push(Date.now() - d);
      }
      log(
        `${backend}${cap.accel ? ` (${cap.accel})` : ''}: create→first exec p50 ${p50(boots)} ms [${boots.join(', ')}], ` +
          `exec round trip p50 ${p50(rtts).toFixed(1)} ms (${execs}), destroy p50 ${p50(destroys)} ms`,
      );
    }
  } finally {
    for (const a of agents) {
      await a.client.prune().catch(() => undefined);
      await a.stop();
      await a.cleanupHost();
    }
    for (const d of dirs) await rm(d, { recursive: true, force: true });
  }
}

const timed = async <T>(f: () => Promise<T>): Promise<[T, number]> => {
  const t = Date.now();
  const v = await f();
  return [v, Date.now() - t];
};

/** Live snapshot, pause, resume, fork of the snapshot on `name`; with an image dir (qemu), a live migration to a second agent and back. */
async function memoryFigures(agent: RunningAgent, name: string, qemuImageDir?: string): Promise<string> {
  const spec = { cpus: 1, ram_mb: 256, tenant: 'bench' };
  await agent.client.exec(name, {
    argv: ['sh', '-c', "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done' </dev/null >/dev/null 2>&1 &"],
  });
  const [snap, snapMs] = await timed(() => agent.client.checkpoint(name, { live: true }, { timeoutMs: 300_000 }));
  const [paused, pauseMs] = await timed(() => agent.client.pauseVm(name, {}, { timeoutMs: 300_000 }));
  const [, resumeMs] = await timed(() => agent.client.resumeVm(name, { timeoutMs: 300_000 }));
  const [, forkMs] = await timed(() =>
    agent.client.createVm({ name: `${name}-f`, checkpoint_id: snap.id, resume: true, ...spec }, { timeoutMs: 300_000 }),
  );
  await agent.client.destroyVm(`${name}-f`, { force: true, timeoutMs: 60_000 });
  await agent.client.deleteCheckpoint(snap.id);
  let line =
    `live snapshot ${snapMs} ms (guest stopped ${snap.pause_ms} ms), pause ${pauseMs} ms (stopped ${paused.checkpoint.pause_ms} ms), ` +
    `resume ${resumeMs} ms, fork ${forkMs} ms`;
  if (qemuImageDir) {
    const dataDir = await mkdtemp(join(tmpdir(), 'bench-qemu-target-'));
    const target = await startAgent(
      {
        dataDir,
        imageDir: qemuImageDir,
        subnet: uniqueSubnet(),
        bridgePrefix: uniquePrefix(),
        env: { AGENT_LOG_LEVEL: 'warn', AGENT_BACKEND: 'qemu' },
      },
      60_000,
    );
    try {
      const call = async (a: RunningAgent, method: string, path: string, body?: unknown): Promise<Record<string, unknown>> => {
        const res = await fetch(`${a.url}/v1${path}`, {
          method,
          headers: { authorization: `Bearer ${a.token}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
          ...(body === undefined ? {} : { body: JSON.stringify(body) }),
        });
        const json = (await res.json()) as Record<string, unknown>;
        if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${JSON.stringify(json)}`);
        return json;
      };
      const offer = await call(agent, 'GET', `/vms/${name}/migration/offer`);
      const [sent, totalMs] = await timed(async () => {
        const incoming = await call(target, 'POST', '/migrations/incoming', { vm: { name, ...spec }, machine: offer.machine });
        const report = await call(agent, 'POST', `/vms/${name}/migration/send`, { to: { uri: incoming.uri, psk: incoming.psk } });
        await call(target, 'POST', `/vms/${name}/migration/complete`, {});
        return report;
      });
      line += `; live migration to another agent ${totalMs} ms (QEMU downtime ${String(sent.downtime_ms)} ms, ${String(sent.transferred_bytes)} B)`;
      if ((await agent.client.capacity()).lazy_pages) {
        // Back lazily (post-copy): running on the first agent at the switch, the rest of its memory after.
        await agent.client.destroyVm(name, { force: true, timeoutMs: 60_000 });
        const back = await call(target, 'GET', `/vms/${name}/migration/offer`);
        const t1 = Date.now();
        const incoming = await call(agent, 'POST', '/migrations/incoming', { vm: { name, ...spec }, machine: back.machine, lazy: true });
        const report = await call(target, 'POST', `/vms/${name}/migration/send`, {
          to: { uri: incoming.uri, psk: incoming.psk },
          lazy: true,
        });
        const switchedMs = Date.now() - t1;
        await call(agent, 'POST', `/vms/${name}/migration/complete`, {});
        const runningMs = Date.now() - t1;
        for (;;) {
          const st = await call(agent, 'GET', `/vms/${name}/memory`);
          if (st.done === true) break;
          if (typeof st.error === 'string') throw new Error(`lazy migration broke: ${st.error}`);
          await new Promise((r) => setTimeout(r, 20));
        }
        line +=
          `; lazy (post-copy) migration back: running after ${runningMs} ms (switch after ${switchedMs} ms, guest stopped ` +
          `${String(report.downtime_ms)} ms at the source, ${String(report.transferred_bytes)} B before it), all memory in at ${Date.now() - t1} ms`;
      } else line += '; no lazy migration (no userfaultfd)';
      await target.client.destroyVm(name, { force: true, timeoutMs: 60_000 });
    } finally {
      await target.client.prune().catch(() => undefined);
      await target.stop();
      await rm(dataDir, { recursive: true, force: true });
    }
  }
  return line;
}
