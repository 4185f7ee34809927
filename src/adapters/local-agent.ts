import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Logger } from 'pino';

const ROOT = resolve(fileURLToPath(new URL('../..', import.meta.url)));
const AGENT_MAIN = join(ROOT, 'packages/agent/src/main.ts');

/**
 * The embedded default's local host overcommits CPU 4:1 (unless CPU_OVERCOMMIT_RATIO says otherwise), so a
 * 2-core laptop holds 8 idle 1-CPU sandboxes: an idle sandbox uses next to no CPU, and each one's cgroup
 * still caps it at its own share. Memory is not overcommitted.
 */
export const LOCAL_HOST_CPU_OVERCOMMIT_RATIO = 4;

export interface LocalAgent {
  readonly url: string;
  readonly pid: number;
  stop(): Promise<void>;
}

/**
 * The embedded default's one host: a host agent child process on loopback,
 * with its data under DATA_DIR/agent. It builds the base image on first
 * start. Its sandboxes outlive it (as on any host): stopping the service
 * leaves VMs running, and the next start finds them again.
 */
export async function startLocalAgent(opts: {
  dataDir: string;
  port: number;
  token: string;
  logger: Logger;
  env?: NodeJS.ProcessEnv;
}): Promise<LocalAgent> {
  const dataDir = resolve(opts.dataDir, 'agent');
  const env = localAgentEnv(opts.env ?? process.env, {
    AGENT_PORT: String(opts.port),
    AGENT_TOKEN: opts.token,
    AGENT_DATA_DIR: dataDir,
    AGENT_HOST: '127.0.0.1',
  });
  await ensureHostPackages(opts.logger);
  if (!existsSync(join(dataDir, 'images', 'base'))) {
    opts.logger.info('building the base sandbox image (first start)…');
    await runToEnd(process.execPath, ['--import', 'tsx', AGENT_MAIN, 'image', 'build', 'base'], env, opts.logger);
  }
  const child = spawn(process.execPath, ['--import', 'tsx', AGENT_MAIN, 'serve'], { env, stdio: ['ignore', 'inherit', 'inherit'] });
  const pid = child.pid ?? -1;
  const url = `http://127.0.0.1:${opts.port}`;
  const exited = new Promise<number | null>((res) => child.once('exit', (code) => res(code)));
  await waitHealthy(url, child, exited);
  opts.logger.info({ url }, 'local host agent is up');
  return {
    url,
    pid,
    async stop() {
      if (child.exitCode !== null) return;
      child.kill('SIGTERM');
      const t = setTimeout(() => child.kill('SIGKILL'), 10_000);
      await exited;
      clearTimeout(t);
    },
  };
}

/** What a host agent reads besides its own AGENT_* settings: nothing secret (CRIU_PATH: its CRIU, README). */
const PASSED_THROUGH = ['PATH', 'LANG', 'LC_ALL', 'TZ', 'NODE_ENV', 'TMPDIR', 'CRIU_PATH'];

/**
 * The local agent's environment: its own AGENT_* settings and a few neutral
 * variables, never the control plane's whole environment. A remote host's
 * agent never sees ADMIN_API_KEY, TOKEN_ENCRYPTION_KEY, DATABASE_URL or the
 * tenants' keys; the local one must not either.
 */
export function localAgentEnv(from: NodeJS.ProcessEnv, settings: Record<string, string>): Record<string, string> {
  const env: Record<string, string> = { AGENT_LOG_LEVEL: 'info' };
  for (const [k, v] of Object.entries(from)) {
    if (v !== undefined && (k.startsWith('AGENT_') || PASSED_THROUGH.includes(k))) env[k] = v;
  }
  return { ...env, ...settings };
}

async function waitHealthy(url: string, child: ChildProcess, exited: Promise<number | null>): Promise<void> {
  let done = false;
  void exited.then(() => (done = true));
  // `done` flips while this loop awaits: read it through a call, not a narrowed local.
  const hasExited = (): boolean => done;
  const deadline = Date.now() + 60_000;
  while (Date.now() < deadline) {
    if (hasExited()) throw new Error(`the local host agent exited during start (code ${child.exitCode}); see its log above`);
    try {
      const r = await fetch(`${url}/healthz`, { signal: AbortSignal.timeout(1000) });
      if (r.ok) return;
    } catch {
      /* not yet */
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  child.kill('SIGKILL');
  throw new Error('the local host agent did not become healthy within 60 s');
}

function runToEnd(cmd: string, args: string[], env: Record<string, string | undefined>, logger: Logger): Promise<void> {
  return new Promise((resolvePromise, reject) => {
    const child = spawn(cmd, args, { env, stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    child.stdout.on('data', (d: Buffer) => (out += d.toString()));
    child.stderr.on('data', (d: Buffer) => (out += d.toString()));
    child.on('error', reject);
    child.on('exit', (code) => {
      if (code === 0) {
        resolvePromise();
        return;
      }
      logger.error({ output: out.slice(-2000) }, `${args.join(' ')} failed`);
      reject(new Error(`${args.slice(-3).join(' ')} failed (exit ${code}): ${out.trim().split('\n').at(-1) ?? ''}`));
    });
  });
}

/**
 * What the process backend needs on the host, by a file each package
 * installs: the static busybox (base image, set-up scripts), nftables (the
 * network boundary), e2fsprogs (per-sandbox disks), gcc with the static libc
 * (the sandbox helper is compiled at agent start). On a fresh Debian machine,
 * run as root, the embedded default installs what is missing itself (and
 * says so), so `npm install && npm start` needs nothing else; anywhere else
 * it stops naming the packages to install.
 */
const HOST_PACKAGES: ReadonlyArray<readonly [file: string, pkg: string]> = [
  ['/bin/busybox', 'busybox-static'],
  ['/usr/sbin/nft', 'nftables'],
  ['/sbin/mkfs.ext4', 'e2fsprogs'],
  ['/usr/bin/gcc', 'gcc'],
  ['/usr/include/stdio.h', 'libc6-dev'],
];

async function ensureHostPackages(logger: Logger): Promise<void> {
  const missing = HOST_PACKAGES.filter(([file]) => !existsSync(file)).map(([, pkg]) => pkg);
  if (missing.length === 0) return;
  const canInstall = process.getuid?.() === 0 && existsSync('/usr/bin/apt-get');
  if (!canInstall)
    throw new Error(
      `the local host agent needs ${missing.join(', ')}: install them (Debian: apt-get install ${missing.join(' ')}) and start again`,
    );
  logger.info({ packages: missing }, 'installing the Debian packages the local host agent needs (apt-get)…');
  const env = { ...process.env, DEBIAN_FRONTEND: 'noninteractive' };
  const install = ['install', '-y', '-q', '--no-install-recommends', ...missing];
  await runToEnd('apt-get', install, env, logger).catch(async () => {
    await runToEnd('apt-get', ['update', '-q'], env, logger);
    await runToEnd('apt-get', install, env, logger);
  });
}
