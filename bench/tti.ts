import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { freePort } from '../src/adapters/postgres/embedded.js';

/**
 * `npm run bench -- tti [--runs N] [--burst N] [--stagger-ms N] [--no-sdk] [--keep]
 *    [--disk-pool N | --compare-pool N | --compare-root DIR] [--agent-timings]`
 *
 * Time to interactive as the public ComputeSDK leaderboard measures sandbox
 * platforms: from the create call to the first command's output, through the
 * public HTTP API of `npm start` (the embedded default: embedded Postgres, the
 * API, one local host agent), started here in a throwaway DATA_DIR on free
 * ports. Three shapes, each --runs (100) samples:
 *   sequential: one create → exec → (untimed) destroy after another;
 *   staggered:  a new create every --stagger-ms (200) without waiting;
 *   burst:      --burst (20) creates at once, repeated until --runs samples;
 *   e2b SDK:    sequential, through the stock `e2b` SDK (Sandbox.create() to the
 *               first stdout chunk of commands.run), configured as npm start prints.
 * --disk-pool N sets the local agent's AGENT_DISK_POOL; --compare-pool N starts
 * two stacks at once, pool 0 and pool N, and alternates their sequential samples
 * and burst rounds, so both see the same load. --agent-timings prints the p50 of
 * each step of the agent's own create (its `create timings` debug line).
 * --compare-root DIR does the same with another checkout (e.g. main's) as the
 * first stack and this tree as the second.
 * Every sample is a fresh sandbox; destroys are not timed. The leaderboard's
 * published medians (Daytona 0.11 s, E2B 0.44 s) cross a network from the
 * measuring client to the provider; these do not, which is said beside them.
 */
const ROOT = resolve(fileURLToPath(new URL('..', import.meta.url)));

interface Started {
  readonly base: string;
  readonly key: string;
  readonly child: ChildProcess;
  readonly dataDir: string;
  output(): string;
}

async function startEmbeddedDefault(extraEnv: Record<string, string>, root = ROOT): Promise<Started> {
  const dataDir = await mkdtemp(join(tmpdir(), 'fleet-tti-'));
  const [port, pgPort, agentPort] = [await freePort(), await freePort(), await freePort()];
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    DATA_DIR: dataDir,
    PORT: String(port),
    EMBEDDED_PG_PORT: String(pgPort),
    LOCAL_AGENT_PORT: String(agentPort),
    // Its own bridges, cgroups and subnet, so a developer's `npm start` on this machine is untouched.
    AGENT_BRIDGE_PREFIX: 'tt',
    AGENT_SUBNET: '10.252.0.0/16',
    LOG_LEVEL: 'warn',
    AGENT_LOG_LEVEL: 'warn',
    ...extraEnv,
  };
  const child = spawn(process.execPath, ['--import', 'tsx', join(root, 'src/main.ts')], {
    cwd: root,
    env,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  child.stdout?.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr?.on('data', (d: Buffer) => (out += d.toString()));
  const base = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 180_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`npm start exited (${child.exitCode}):\n${out.slice(-3000)}`);
    if (Date.now() > deadline) {
      child.kill('SIGKILL');
      throw new Error(`npm start was not ready within 180 s:\n${out.slice(-3000)}`);
    }
    try {
      const secrets = JSON.parse(await readFile(join(dataDir, 'secrets.json'), 'utf8')) as { admin_api_key: string; demo_api_key: string };
      const hosts = await fetch(`${base}/v1/hosts`, { headers: { authorization: `Bearer ${secrets.admin_api_key}` } });
      const body = (await hosts.json()) as { hosts?: Array<{ id: string; state: string }> };
      if (hosts.ok && body.hosts?.some((h) => h.id === 'local' && h.state === 'active')) {
        return { base, key: secrets.demo_api_key, child, dataDir, output: () => out };
      }
    } catch {
      /* not yet */
    }
    await new Promise((r) => setTimeout(r, 250));
  }
}

async function stop(s: Started, keep: boolean): Promise<void> {
  if (s.child.exitCode === null) {
    s.child.kill('SIGTERM');
    await new Promise<void>((r) => {
      const t = setTimeout(() => {
        s.child.kill('SIGKILL');
        r();
      }, 30_000);
      s.child.once('exit', () => {
        clearTimeout(t);
        r();
      });
    });
  }
  if (!keep) await rm(s.dataDir, { recursive: true, force: true }).catch(() => undefined);
}

interface Sample {
  readonly ms: number;
  readonly vm: string;
  /** Wall clock (ms) at the create call, its answer, and the exec's answer. */
  readonly at: { readonly start: number; readonly created: number; readonly done: number };
}

/** create → first output of `echo ready`; the sandbox is destroyed afterwards (untimed). */
async function oneTti(s: Started, tag: string): Promise<Sample> {
  const h = { authorization: `Bearer ${s.key}`, 'content-type': 'application/json' };
  const t0 = performance.now();
  const start = Date.now();
  const created = await fetch(`${s.base}/v1/vms`, {
    method: 'POST',
    headers: h,
    body: JSON.stringify({ cpus: 1, ram_mb: 128, storage_gb: 1 }),
  });
  const vm = (await created.json()) as { id?: string; code?: string; detail?: string };
  if (!created.ok || !vm.id) throw new Error(`create ${tag} failed: ${created.status} ${vm.code ?? ''} ${vm.detail ?? ''}`);
  const createdAt = Date.now();
  const exec = await fetch(`${s.base}/v1/vms/${vm.id}/exec`, {
    method: 'POST',
    headers: h,
    body: JSON.stringify({ argv: ['echo', 'ready'] }),
  });
  const res = (await exec.json()) as { stdout?: string; exit_code?: number };
  const ms = performance.now() - t0;
  if (!exec.ok || res.stdout?.trim() !== 'ready') throw new Error(`exec in ${vm.id} failed: ${exec.status} ${JSON.stringify(res)}`);
  return { ms, vm: vm.id, at: { start, created: createdAt, done: Date.now() } };
}

/**
 * Where one create's time went, from its own stream: each append's commit
 * time (`recorded_at`) against the client's clock (same machine).
 */
async function phases(s: Started, sample: Sample): Promise<Map<string, number>> {
  const r = await fetch(`${s.base}/v1/audit/streams/vm-${sample.vm}`, { headers: { authorization: `Bearer ${s.key}` } });
  const body = (await r.json()) as { events?: Array<{ type: string; recorded_at: string }> };
  const at = new Map<string, number>();
  for (const e of body.events ?? []) if (!at.has(e.type)) at.set(e.type, Date.parse(e.recorded_at));
  const out = new Map<string, number>();
  let prev = { name: 'create call', t: sample.at.start };
  for (const [type, t] of [...at].filter(([type]) => type !== 'VmDestroyRequested' && type !== 'VmDestroyed')) {
    out.set(`${prev.name} → ${type} committed`, t - prev.t);
    prev = { name: type, t };
  }
  out.set(`${prev.name} → create answered`, sample.at.created - prev.t);
  out.set('create answered → exec output', sample.at.done - sample.at.created);
  return out;
}

/**
 * The same through the stock `e2b` SDK, configured only by the lines `npm start` prints:
 * `Sandbox.create()` → the first stdout chunk of `commands.run('echo ready')` (envd through the ingress).
 */
async function oneSdkTti(s: Started, tag: string): Promise<number> {
  process.env.E2B_API_URL = `${s.base}/e2b`;
  // What `npm start` printed: the in-process ingress (header routing to its envd handler).
  const printed = /^export E2B_SANDBOX_URL=(\S+)$/m.exec(s.output())?.[1];
  if (printed === undefined) throw new Error('npm start printed no E2B_SANDBOX_URL');
  process.env.E2B_SANDBOX_URL = printed;
  process.env.E2B_API_KEY = s.key;
  const { Sandbox } = await import('e2b');
  const t0 = performance.now();
  const sbx = await Sandbox.create();
  let first: number | undefined;
  const r = await sbx.commands.run('echo ready', { onStdout: () => void (first ??= performance.now() - t0) });
  await sbx.kill();
  if (r.stdout.trim() !== 'ready' || first === undefined) throw new Error(`sdk ${tag}: unexpected output ${JSON.stringify(r.stdout)}`);
  return first;
}

async function destroy(s: Started, vm: string): Promise<void> {
  const r = await fetch(`${s.base}/v1/vms/${vm}`, { method: 'DELETE', headers: { authorization: `Bearer ${s.key}` } });
  if (!r.ok && r.status !== 404) throw new Error(`destroy ${vm}: ${r.status} ${await r.text()}`);
}

function pct(sorted: readonly number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.ceil(sorted.length * p) - 1)] ?? NaN;
}

function summary(name: string, samples: readonly number[], failures: number): string {
  const s = [...samples].sort((a, b) => a - b);
  const f = (v: number): string => `${v.toFixed(0)} ms`;
  return `${name.padEnd(11)} n=${s.length}${failures ? ` (${failures} failed)` : ''}  p50 ${f(pct(s, 0.5))}  p95 ${f(pct(s, 0.95))}  p99 ${f(pct(s, 0.99))}  max ${f(s.at(-1) ?? NaN)}`;
}

interface Shapes {
  readonly lines: string[];
  /** The stack's output during its sequential samples (the agent's `create timings` lines of those creates). */
  seqOutput: string;
}

/** Per-phase p50 of the agent's own create (its `create timings` debug lines: cumulative ms since the create began). */
function agentPhases(output: string): string[] {
  const rows = new Map<string, number[]>();
  const disks = new Map<string, number>();
  for (const line of output.split('\n')) {
    if (!line.includes('"phases_ms"')) continue;
    try {
      const o = JSON.parse(line) as { phases_ms?: Record<string, number>; disk?: string };
      if (o.disk) disks.set(o.disk, (disks.get(o.disk) ?? 0) + 1);
      for (const [k, v] of Object.entries(o.phases_ms ?? {})) rows.set(k, [...(rows.get(k) ?? []), v]);
    } catch {
      /* not a JSON log line */
    }
  }
  const med = [...rows]
    .map(
      ([k, v]) =>
        [
          k,
          pct(
            [...v].sort((a, b) => a - b),
            0.5,
          ),
          v.length,
        ] as const,
    )
    .sort((a, b) => a[1] - b[1]);
  let prev = 0;
  const lines = med.map(([k, v, n]) => {
    const line = `    ${k.padEnd(16)} at ${v.toFixed(1)} ms  (+${(v - prev).toFixed(1)}, n=${n})`;
    prev = v;
    return line;
  });
  if (disks.size > 0) lines.push(`    disks: ${[...disks].map(([k, n]) => `${n} ${k}`).join(', ')}`);
  return lines;
}

export default async function ttiBench(args: string[]): Promise<void> {
  const opt = (name: string, dflt: number): number => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const runs = opt('runs', 100);
  const burst = opt('burst', 20);
  const staggerMs = opt('stagger-ms', 200);
  const keep = args.includes('--keep');
  const noSdk = args.includes('--no-sdk');
  // --disk-pool N: AGENT_DISK_POOL for the local agent; --compare-pool N: two stacks, pool 0 and pool N, samples alternated.
  const comparePool = args.includes('--compare-pool') ? opt('compare-pool', 2) : undefined;
  const diskPool = args.includes('--disk-pool') ? opt('disk-pool', 2) : undefined;
  const agentTimings = args.includes('--agent-timings');
  // --compare-root DIR: a second checkout (e.g. main) as the first stack, this tree as the second, samples alternated.
  const compareRoot = args.includes('--compare-root') ? resolve(args[args.indexOf('--compare-root') + 1] ?? '.') : undefined;
  const log = (s: string): void => void process.stdout.write(`${s}\n`);
  log(
    `machine: ${cpus().length} × ${cpus()[0]?.model ?? '?'}, node ${process.version}, load ${loadavg()
      .map((l) => l.toFixed(1))
      .join(' ')}`,
  );
  log('starting `npm start` (embedded default) in a throwaway data directory…');
  // A burst needs room for every sandbox at once: 1-CPU sandboxes on this host's cores, overcommitted
  // (they are idle apart from one echo); never below the embedded default's own 4:1.
  const ratio = Math.max(4, Math.ceil(burst / cpus().length));
  log(`CPU_OVERCOMMIT_RATIO=${ratio} for the local host (room for a burst of ${burst} 1-CPU sandboxes)`);
  const stackEnv = (i: number, pool: number | undefined): Record<string, string> => ({
    CPU_OVERCOMMIT_RATIO: String(ratio),
    ...(i > 0 ? { AGENT_BRIDGE_PREFIX: `tt${i}`, AGENT_SUBNET: `10.${252 - i}.0.0/16` } : {}),
    ...(pool !== undefined ? { AGENT_DISK_POOL: String(pool) } : {}),
    ...(agentTimings ? { AGENT_LOG_LEVEL: 'debug' } : {}),
  });
  const configs: Array<{ label: string; env: Record<string, string>; root?: string }> =
    compareRoot !== undefined
      ? [
          { label: `baseline ${compareRoot}`, env: stackEnv(0, diskPool), root: compareRoot },
          { label: `this tree${diskPool !== undefined ? `, disk pool ${diskPool}` : ''}`, env: stackEnv(1, diskPool) },
        ]
      : comparePool !== undefined
        ? [
            { label: 'disk pool 0', env: stackEnv(0, 0) },
            { label: `disk pool ${comparePool}`, env: stackEnv(1, comparePool) },
          ]
        : [{ label: diskPool !== undefined ? `disk pool ${diskPool}` : 'default', env: stackEnv(0, diskPool) }];
  const stacks: Started[] = [];
  try {
    for (const c of configs) stacks.push(await startEmbeddedDefault(c.env, c.root));
    const results = await measure(stacks, { runs, burst, staggerMs, noSdk }, log);
    for (const [i, c] of configs.entries()) {
      log(`\n== ${c.label} ==`);
      for (const l of results[i]!.lines) log(l);
      if (agentTimings) {
        log(
          "  the agent's create in the sequential samples, p50 of each step (its `create timings` debug line; cumulative, step's own in parentheses):",
        );
        for (const l of agentPhases(results[i]!.seqOutput)) log(l);
      }
    }
    log('\npublished medians on the ComputeSDK leaderboard (measured across the internet to each provider): Daytona 110 ms, E2B 440 ms;');
    log('the figures above are on one machine over loopback, no network crossed.');
    log(
      `load at the end: ${loadavg()
        .map((l) => l.toFixed(1))
        .join(' ')}`,
    );
  } finally {
    for (const s of stacks) await stop(s, keep);
  }
}

/** Every shape on each stack; with two stacks, sequential samples and burst rounds alternate between them (same load). */
async function measure(
  stacks: readonly Started[],
  o: { runs: number; burst: number; staggerMs: number; noSdk: boolean },
  log: (s: string) => void,
): Promise<Shapes[]> {
  const out: Shapes[] = stacks.map(() => ({ lines: [], seqOutput: '' }));
  // Warm-up: the first create after start pays for cold caches (image pages, JIT).
  for (const s of stacks) for (let i = 0; i < 3; i++) await destroy(s, (await oneTti(s, `warm${i}`)).vm);

  const seq = stacks.map(() => ({ ms: [] as number[], fail: 0, split: new Map<string, number[]>() }));
  const seqFrom = stacks.map((s) => s.output().length);
  for (let i = 0; i < o.runs; i++) {
    for (const [k, s] of stacks.entries()) {
      const acc = seq[k]!;
      try {
        const r = await oneTti(s, `seq${i}`);
        acc.ms.push(r.ms);
        for (const [name, v] of await phases(s, r)) acc.split.set(name, [...(acc.split.get(name) ?? []), v]);
        await destroy(s, r.vm);
      } catch (err) {
        acc.fail++;
        log(`  ${(err as Error).message}`);
      }
    }
  }
  for (const [k, acc] of seq.entries()) {
    out[k]!.seqOutput = stacks[k]!.output().slice(seqFrom[k]);
    const lines = out[k]!.lines;
    lines.push(summary('sequential', acc.ms, acc.fail));
    lines.push('  where a sequential sample went (p50 of each step; commit times from the VM stream, ±1 ms clocks):');
    for (const [name, v] of acc.split)
      lines.push(
        `    ${name}: ${pct(
          [...v].sort((a, b) => a - b),
          0.5,
        ).toFixed(0)} ms (n=${v.length})`,
      );
  }

  for (const [k, s] of stacks.entries()) {
    const sdk: number[] = [];
    let sdkFail = 0;
    for (let i = 0; i < (o.noSdk ? 0 : o.runs); i++) {
      try {
        sdk.push(await oneSdkTti(s, `sdk${i}`));
      } catch (err) {
        sdkFail++;
        log(`  ${(err as Error).message}`);
      }
    }
    if (sdk.length + sdkFail > 0) out[k]!.lines.push(summary('e2b SDK', sdk, sdkFail));
  }

  for (const [k, s] of stacks.entries()) {
    const stag: number[] = [];
    let stagFail = 0;
    const pending: Array<Promise<void>> = [];
    for (let i = 0; i < o.runs; i++) {
      pending.push(
        oneTti(s, `stag${i}`).then(
          async (r) => {
            stag.push(r.ms);
            await destroy(s, r.vm);
          },
          (err: unknown) => {
            stagFail++;
            log(`  ${(err as Error).message}`);
          },
        ),
      );
      await new Promise((r) => setTimeout(r, o.staggerMs));
    }
    await Promise.all(pending);
    out[k]!.lines.push(summary(`staggered ${o.staggerMs}ms`, stag, stagFail));
  }

  const bursts = stacks.map(() => ({ ms: [] as number[], fail: 0 }));
  for (let round = 0; bursts.some((b) => b.ms.length + b.fail < o.runs); round++) {
    for (const [k, s] of stacks.entries()) {
      const acc = bursts[k]!;
      const n = Math.min(o.burst, o.runs - acc.ms.length - acc.fail);
      if (n <= 0) continue;
      const results = await Promise.allSettled(Array.from({ length: n }, (_, i) => oneTti(s, `burst${round}.${i}`)));
      for (const r of results) {
        if (r.status === 'fulfilled') acc.ms.push(r.value.ms);
        else {
          acc.fail++;
          log(`  ${(r.reason as Error).message}`);
        }
      }
      await Promise.all(results.flatMap((r) => (r.status === 'fulfilled' ? [destroy(s, r.value.vm)] : [])));
      // The pool refills while nothing is created: as between a user's bursts, not in the middle of the next one.
      await new Promise((r) => setTimeout(r, 1000));
    }
  }
  for (const [k, acc] of bursts.entries()) out[k]!.lines.push(summary(`burst of ${o.burst}`, acc.ms, acc.fail));
  return out;
}
