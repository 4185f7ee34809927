import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmdirSync, rmSync, writeFileSync } from 'node:fs';
import { access, mkdtemp, readdir, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { HostAgentClient } from '../../src/adapters/host-agent.client.js';
import { buildImage } from '../../packages/agent/src/images.js';
import { AppError } from '@fleet/agent-protocol';

/**
 * Starts real host-agent processes (`node --import tsx packages/agent/src/main.ts`)
 * for integration tests and benchmarks, each with its own data directory,
 * bridge prefix and subnet, on a free port the agent picks itself (port 0,
 * read back from its "listening" log line).
 */

export const REPO_ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

// A safety net for callers whose cleanup did not run (a failed before(), a cancelled test):
// at process exit, agents still running are killed and image dirs and empty cgroup parents removed.
const atExit = { procs: new Set<ChildProcess>(), dirs: new Set<string>(), prefixes: new Set<string>() };
process.once('exit', () => {
  for (const p of atExit.procs) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
  for (const d of atExit.dirs) rmSync(d, { recursive: true, force: true });
  for (const prefix of atExit.prefixes) {
    try {
      for (const c of readdirSync('/sys/fs/cgroup')) {
        try {
          rmdirSync(join('/sys/fs/cgroup', c, `fleet-${prefix}`));
        } catch {
          /* absent or still in use */
        }
      }
    } catch {
      /* no cgroup fs */
    }
  }
});

export interface AgentOptions {
  dataDir: string;
  imageDir: string;
  /** Distinct per agent on one machine: bridges, routes and cgroups are host-global. */
  subnet: string;
  bridgePrefix: string;
  token?: string;
  env?: Record<string, string>;
}

export interface RunningAgent {
  readonly url: string;
  readonly port: number;
  readonly token: string;
  readonly opts: AgentOptions;
  readonly client: HostAgentClient;
  readonly proc: ChildProcess;
  output(): string;
  /** SIGTERM, bounded; SIGKILL if it does not exit in time. */
  stop(): Promise<void>;
  /** After stop(): removes this agent's empty host-global leftovers (cgroup parents). */
  cleanupHost(): Promise<void>;
  /** SIGKILL, as a crash would. */
  kill(): Promise<void>;
}

export async function startAgent(opts: AgentOptions, startTimeoutMs = 30_000): Promise<RunningAgent> {
  const token = opts.token ?? `tok-${randomBytes(16).toString('hex')}`;
  const proc = spawn(process.execPath, ['--import', 'tsx', join(REPO_ROOT, 'packages/agent/src/main.ts')], {
    cwd: REPO_ROOT,
    env: {
      ...process.env,
      AGENT_TOKEN: token,
      AGENT_HOST: '127.0.0.1',
      AGENT_PORT: '0',
      AGENT_DATA_DIR: opts.dataDir,
      AGENT_IMAGE_DIR: opts.imageDir,
      AGENT_SUBNET: opts.subnet,
      AGENT_BRIDGE_PREFIX: opts.bridgePrefix,
      AGENT_LOG_LEVEL: 'info',
      ...opts.env,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  atExit.procs.add(proc);
  atExit.prefixes.add(opts.bridgePrefix);
  proc.once('exit', () => atExit.procs.delete(proc));
  let out = '';
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => {
      proc.kill('SIGKILL');
      reject(new Error(`agent did not start within ${startTimeoutMs} ms:\n${out}`));
    }, startTimeoutMs);
    let buf = '';
    proc.stdout.on('data', (chunk: Buffer) => {
      out += chunk.toString();
      buf += chunk.toString();
      let nl: number;
      while ((nl = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        try {
          const rec = JSON.parse(line) as { msg?: string; port?: number };
          if (rec.msg === 'host agent listening' && typeof rec.port === 'number') {
            clearTimeout(timer);
            resolve(rec.port);
          }
        } catch {
          /* not a log line */
        }
      }
    });
    proc.stderr.on('data', (chunk: Buffer) => {
      out += chunk.toString();
    });
    proc.once('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new AgentStartError(`agent exited (${code ?? signal}) before listening:\n${out}`, out));
    });
  });
  // Keep draining the pipes so a chatty agent never blocks on a full pipe.
  const url = `http://127.0.0.1:${port}`;
  const client = new HostAgentClient({ hostId: `test-${opts.bridgePrefix}`, url, token, timeoutMs: 60_000, attempts: 2, backoffMs: 50 });
  const waitExit = (ms: number): Promise<boolean> => exitWithin(proc, exited, ms);
  return {
    url,
    port,
    token,
    opts,
    client,
    proc,
    output: () => out,
    async stop() {
      if (proc.exitCode !== null || proc.signalCode !== null) return;
      proc.kill('SIGTERM');
      if (!(await waitExit(12_000))) {
        proc.kill('SIGKILL');
        await waitExit(5_000);
      }
    },
    async cleanupHost() {
      // The backend's per-agent cgroup parents outlive the agent when empty; remove ours (rmdir only succeeds when empty).
      const root = '/sys/fs/cgroup';
      const controllers = await readdir(root).catch(() => [] as string[]);
      for (const c of controllers) await rmdir(join(root, c, `fleet-${opts.bridgePrefix}`)).catch(() => {});
      await rmdir(join(root, `fleet-${opts.bridgePrefix}`)).catch(() => {});
      // The agent's nftables tables, once none of its sandboxes is left on a veth (the agent removes them itself then).
      const links = spawnSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' }).stdout ?? '';
      if (!new RegExp(`^\\d+: ${opts.bridgePrefix}v`, 'm').test(links)) {
        for (const family of ['inet', 'bridge'])
          spawnSync('nft', ['delete', 'table', family, `fleet_${opts.bridgePrefix}`], { stdio: 'ignore' });
      }
    },
    async kill() {
      if (proc.exitCode !== null || proc.signalCode !== null) return;
      proc.kill('SIGKILL');
      await waitExit(5_000);
    },
  };
}

export class AgentStartError extends Error {
  constructor(
    message: string,
    readonly output: string,
  ) {
    super(message);
  }
}

/** Why the process-backend tests cannot run here, or undefined when they can. */
export async function missingPrerequisite(): Promise<string | undefined> {
  if (process.platform !== 'linux') return `the process backend needs Linux (this is ${process.platform})`;
  if (process.getuid?.() !== 0) return 'the process backend needs root (namespaces, mounts, cgroups)';
  for (const [path, feature] of [
    ['/bin/busybox', 'busybox-static (apt-get install busybox-static) for the base image'],
    ['/proc/self/ns/pid', 'pid namespaces'],
  ] as const) {
    try {
      await access(path);
    } catch {
      return `missing kernel/host feature: ${feature}`;
    }
  }
  return undefined;
}

/** Builds the base image once into a fresh directory; a missing feature becomes a skip reason. */
export async function prepareImages(): Promise<{ imageDir: string } | { skip: string }> {
  const imageDir = await mkdtemp(join(tmpdir(), 'agent-images-'));
  atExit.dirs.add(imageDir);
  try {
    await buildImage(imageDir, 'base');
  } catch (err) {
    if (err instanceof AppError && err.code === 'HOST_FEATURE_MISSING') return { skip: err.message };
    throw err;
  }
  return { imageDir };
}

/** A HOST_FEATURE_MISSING from the agent, as a skip reason naming the feature. */
export function featureSkip(err: unknown): string | undefined {
  if (err instanceof AppError && err.code === 'HOST_FEATURE_MISSING') return err.message;
  if (err instanceof AgentStartError) {
    const m = /host feature missing: [^"\n]*/.exec(err.output);
    if (m) return m[0];
  }
  return undefined;
}

export function uniquePrefix(): string {
  return `t${randomBytes(2).toString('hex')}`;
}

/** A /24 in 10.<200-249>.<0-255>: distinct per agent, used only inside this machine's own namespaces. */
export function uniqueSubnet(): string {
  const b = randomBytes(2);
  return `10.${200 + ((b[0] ?? 0) % 50)}.${b[1] ?? 0}.0/24`;
}

/**
 * Shell for a sandbox: `mb` MB of resident memory held by an awk in the background, and /tmp/ballast once it is all
 * written (the sprintf takes seconds on a loaded machine): a move or pause started before that carries less.
 */
export const ballastScript = (mb: number): string =>
  `(awk 'BEGIN{s=sprintf("%${mb * 1_000_000}s","x"); system("touch /tmp/ballast"); while(1) system("sleep 1")}') >/dev/null 2>&1 &`;

/**
 * A cgroup of the test's own that holds its processes to 2% of a CPU (v1 cpu controller, or v2 cpu.max), 0.1% once
 * tightened; null where the host has no cpu controller to do it with. Fault injection for a criu daemon that must be
 * slow (enough CPU to take the restore's hand-over, then hardly any).
 */
export function throttledCgroup(): { procs: string; throttle(): void; tighten(): void; unthrottle(): void; remove(): void } | null {
  const v2 = existsSync('/sys/fs/cgroup/cgroup.controllers');
  const parent = v2 ? '/sys/fs/cgroup' : '/sys/fs/cgroup/cpu';
  if (
    v2
      ? !readFileSync(join(parent, 'cgroup.subtree_control'), 'utf8').split(/\s+/).includes('cpu')
      : !existsSync(join(parent, 'cpu.cfs_period_us'))
  )
    return null;
  const dir = join(parent, `fleet-test-slow-${process.pid}-${randomBytes(3).toString('hex')}`);
  mkdirSync(dir);
  const limit = (quota: number | null, period: number): void => {
    if (v2) writeFileSync(join(dir, 'cpu.max'), `${quota ?? 'max'} ${period}`);
    else {
      writeFileSync(join(dir, 'cpu.cfs_quota_us'), '-1');
      writeFileSync(join(dir, 'cpu.cfs_period_us'), String(period));
      if (quota !== null) writeFileSync(join(dir, 'cpu.cfs_quota_us'), String(quota));
    }
  };
  limit(2000, 100_000);
  return {
    procs: join(dir, 'cgroup.procs'),
    throttle: () => limit(2000, 100_000),
    tighten: () => limit(1000, 1_000_000),
    unthrottle: () => limit(null, 100_000),
    remove: () => {
      limit(null, 100_000);
      // Its processes (a daemon that outlived the test) go back to the parent first.
      for (const pid of readFileSync(join(dir, 'cgroup.procs'), 'utf8').split('\n').filter(Boolean))
        writeFileSync(join(parent, 'cgroup.procs'), pid);
      rmdirSync(dir);
    },
  };
}

/**
 * A criu that runs as `real`, but puts its `lazy-pages` daemon in `cgroupProcs` while `flag` exists (the agent knows
 * a criu with the /dev/userfaultfd patch by a name in its binary: the wrapper names it too).
 */
export async function slowPagesCriu(path: string, real: string, flag: string, cgroupProcs: string): Promise<string> {
  await writeFile(
    path,
    `#!/bin/sh\n# wraps a criu with UFFD_DEV_OFF\nif [ "$1" = lazy-pages ] && [ -e ${flag} ]; then echo $$ > ${cgroupProcs}; fi\nexec ${real} "$@"\n`,
    { mode: 0o755 },
  );
  return path;
}

/**
 * The memory holder of the lazy-restore tests: 64 MiB of anonymous memory in an awk string, no page of it zero,
 * written to /tmp/dump whenever /tmp/ask appears; /tmp/ready once it is built.
 */
export const MEMORY_HOLDER =
  `(awk 'BEGIN{ c = ""; for (i = 0; i < 4096; i++) c = c sprintf("%c", 65 + (i * 7) % 26); s = c; ` +
  `while (length(s) < 64 * 1048576) s = s s; system("touch /tmp/ready"); ` +
  `while (1) { if (system("test -e /tmp/ask") == 0) { system("rm -f /tmp/ask"); printf "%s", s > "/tmp/dump"; close("/tmp/dump"); system("touch /tmp/dumped") } system("sleep 0.05") } }') >/dev/null 2>&1 &`;

/**
 * MEMORY_HOLDER's side in a test, over `sh` (a shell script run in the sandbox): `ready()` once its memory is built,
 * `sum()` the md5 and size of that memory as the holder writes it out.
 */
export function memoryHolder(sh: (script: string) => Promise<{ stdout: string; exitCode: number | null }>): {
  ready(): Promise<void>;
  sum(): Promise<string>;
} {
  const waitFor = async (file: string): Promise<void> => {
    for (let i = 0; i < 400 && (await sh(`test -e ${file}`)).exitCode !== 0; i++) await new Promise((r) => setTimeout(r, 50));
  };
  return {
    ready: () => waitFor('/tmp/ready'),
    sum: async () => {
      await sh('rm -f /tmp/dumped /tmp/dump; touch /tmp/ask');
      await waitFor('/tmp/dumped');
      return (await sh('md5sum < /tmp/dump && wc -c < /tmp/dump; rm -f /tmp/dump /tmp/dumped')).stdout.replace(/\s+/g, ' ').trim();
    },
  };
}

/**
 * True once `proc` has exited (`exited` settles on its exit), false after `ms`. The timer goes with the exit: one left
 * armed would hold the test process open for its whole length after the last test.
 */
export async function exitWithin(proc: ChildProcess, exited: Promise<void>, ms: number): Promise<boolean> {
  if (proc.exitCode !== null || proc.signalCode !== null) return true;
  return withTimeout(exited, ms, 'exit').then(
    () => true,
    () => false,
  );
}

export async function withTimeout<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what} took longer than ${ms} ms`)), ms))),
    ]);
  } finally {
    clearTimeout(timer);
  }
}
