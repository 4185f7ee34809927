import type { ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { readdir, readFile, rm } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { createServer, connect, type Server, type Socket } from 'node:net';
import { AppError } from '@fleet/agent-protocol';
import WebSocket, { createWebSocketStream } from 'ws';
import { sandboxFailed, sandboxNotFound, sandboxNotRunning, type Checkpoint, type CreateSpec, type SandboxInfo } from '../../backend.js';
import { adoptLazyDaemon, LAZY_EXIT_FILE, LAZY_LOG, startLazyDaemon, type LazyDaemon, type MemoryStatus } from './criu-lazy.js';
import { dumpMemory, sandboxOfRestoreScratch } from './criu-sandbox.js';
import { processStartTime, processStartTimeSync, sigkill } from './exec-util.js';
import { detachSandbox } from './network.js';
import { createSandbox } from './sandbox-create.js';
import type { SandboxHost } from './sandbox-host.js';
import { freeze } from './sandbox-memory.js';
import { layerDirs } from './storage.js';

/*
 * Lazy (post-copy) moves between two agents.
 *
 * Source: `pauseLazy` dumps the sandbox with `criu dump --lazy-pages`: the
 * tree ends, everything but its memory pages goes into an ordinary live
 * checkpoint (moved under the artifact grant like any other), and the pages
 * stay in that criu process, which serves them on 127.0.0.1 only. It is the
 * pinned capture: it lives until the target has fetched every page (then
 * criu exits and the pages are released) or the agent ends it.
 *
 * Transport: the page server has no authentication, so it never leaves
 * loopback. The target reaches it through the source agent's own HTTP
 * server, as a websocket on /v1/artifacts/:id/pages authenticated by the
 * same short-lived grant that moved the checkpoint (one snapshot, minutes):
 * only the granted target can pull, and one stream at a time.
 *
 * Target: `createLazy` restores the sandbox from the pulled checkpoint
 * before its memory is there; `criu lazy-pages` reads faults and background
 * pages through a loopback listener of this agent that is piped into that
 * websocket. If the stream breaks before every page is in (the source is
 * lost), the restored tasks cannot go on: the sandbox is killed and its
 * memory status keeps the error.
 */

export interface PageSource {
  readonly checkpointId: string;
  readonly port: number;
  readonly startedAt: number;
  /** One target stream at a time: the page server serves one client. */
  streaming: boolean;
  readonly released: Promise<void>;
  release(): void;
}

export interface LazyFrom {
  /** The source agent's base URL (http://host:port). */
  readonly url: string;
  readonly grant: string;
}

interface TargetState {
  daemon?: LazyDaemon;
  error?: string;
  listener?: Server;
  /** Paging in from this host's own images (a resume, fork or restore), not from a source agent. */
  local?: boolean;
  /** The daemon ended with every page in. */
  daemonDone?: boolean;
}

/** SIGKILL to a sandbox's init (its pid namespace's whole tree goes with it), if it is still that process. */
function killTree(pid: number, start: string): void {
  if (processStartTimeSync(pid) === start) sigkill(pid);
}

/**
 * How long a memory capture waits for a sandbox paging in from this host's images before it is refused (a 64 MiB
 * sandbox is in before its resume answers; this bounds it under the control plane's 30 s agent call).
 */
const LOCAL_PAGING_WAIT_MS = 15_000;

export class LazyMemory {
  private readonly sources = new Map<string, PageSource>();
  private readonly targets = new Map<string, TargetState>();

  constructor(private readonly host: SandboxHost) {}

  /** The pinned capture of a lazy pause, while its pages are still being served. */
  source(checkpointId: string): PageSource | undefined {
    return this.sources.get(checkpointId);
  }

  /**
   * Pauses the sandbox for a lazy move: as pause(), but its pages stay in a
   * serving criu process (source()) instead of the checkpoint.
   */
  async pauseLazy(name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
    const host = this.host;
    const criu = host.requireCriu();
    if (!criu.lazyPages) throw lazyUnsupported();
    const record = host.records.get(name);
    if (!record) throw sandboxNotFound(name);
    return host.locks.run(`sb:${name}`, async () => {
      const s = record.state;
      if (s.status === 'paused' && this.sources.has(s.paused_checkpoint))
        return { ...(await host.checkpoints.get(s.paused_checkpoint)), pause_ms: 0 };
      if (s.status !== 'running' || !(await host.isAlive(s))) throw sandboxNotRunning(name);
      await this.awaitResident(name);
      const t0 = performance.now();
      await freeze(host, name);
      let server: ChildProcess | undefined;
      let port = 0;
      let cp: Checkpoint;
      try {
        cp = await host.checkpoints.write(layerDirs(host.sandboxDir(name), s.storage_gb).upper, {
          ...(opts.id ? { id: opts.id } : {}),
          comment: opts.comment ?? 'lazy',
          image: s.image,
          now: new Date(),
          memory: async () => {
            const d = await dumpMemory(host, record, false, true);
            server = d.pageServer?.child;
            port = d.pageServer?.port ?? 0;
            return d;
          },
        });
      } catch (err) {
        if (server) server.kill('SIGKILL');
        else await host.cgroups.setFrozen(name, false).catch(() => undefined);
        throw err;
      }
      const pauseMs = Math.round(performance.now() - t0);
      const child = server;
      if (!child) throw new AppError('SANDBOX_FAILED', 500, 'criu dump --lazy-pages started no page server');
      const initPid = s.init_pid;
      const initStart = s.init_start;
      const released = new Promise<void>((resolve) => {
        if (child.exitCode !== null || child.signalCode !== null) resolve();
        else child.once('exit', () => resolve());
      }).then(async () => {
        // criu ends the tree itself once every page is fetched; a capture released before that leaves it to us
        // (the pid namespace's init: its whole tree goes with it). The start time guards against a reused pid.
        if ((await processStartTime(initPid)) !== initStart) return;
        try {
          process.kill(initPid, 'SIGKILL');
        } catch {
          /* gone */
        }
      });
      const src: PageSource = {
        checkpointId: cp.id,
        port,
        startedAt: Date.now(),
        streaming: false,
        released,
        release: () => {
          child.kill('SIGKILL');
        },
      };
      this.sources.set(cp.id, src);
      void released.then(() => {
        this.sources.delete(cp.id);
        host.log?.info({ sandbox: name, checkpoint: cp.id, served_ms: Date.now() - src.startedAt }, 'lazy pages released');
      });
      await host.unpublish(record);
      await detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip });
      await host.cgroups.setFrozen(name, false).catch(() => undefined);
      s.status = 'paused';
      s.paused_checkpoint = cp.id;
      s.init_pid = 0;
      s.init_start = '';
      await host.persist(s);
      host.log?.info({ sandbox: name, checkpoint: cp.id, pause_ms: pauseMs, port }, 'sandbox paused for a lazy move');
      return { ...cp, pause_ms: pauseMs };
    });
  }

  /** A loopback connection to a pinned capture's page server (the route pipes the grant-checked websocket into it). */
  openPages(checkpointId: string): Socket {
    const src = this.sources.get(checkpointId);
    if (!src) throw new AppError('LAZY_PAGES_GONE', 410, `checkpoint "${checkpointId}" has no pages being served`);
    if (src.streaming) throw new AppError('LAZY_PAGES_BUSY', 409, `the pages of "${checkpointId}" are already being pulled`);
    src.streaming = true;
    return connect({ host: '127.0.0.1', port: src.port });
  }

  /**
   * Restores a sandbox from a pulled lazy checkpoint and pages its memory in
   * from the source agent; answers once its processes run.
   */
  async createLazy(spec: CreateSpec, from: LazyFrom): Promise<SandboxInfo> {
    const host = this.host;
    const criu = host.requireCriu();
    if (!criu.lazyPages) throw lazyUnsupported();
    if (!spec.checkpointId) throw new AppError('VALIDATION_FAILED', 400, 'a lazy restore needs checkpoint_id');
    const checkpointId = spec.checkpointId;
    if (this.targets.has(spec.name)) {
      const known = host.records.get(spec.name);
      if (known) return host.info(known);
    }
    const state: TargetState = {};
    this.targets.set(spec.name, state);
    try {
      return await createSandbox(host, { ...spec, resume: true }, async (dir) => {
        const tunnel = await openTunnel(from, checkpointId, (err) => {
          state.error ??= `page stream from the source failed: ${err.message}`;
        });
        state.listener = tunnel;
        const address = tunnel.address();
        const port = typeof address === 'object' && address ? address.port : 0;
        const daemon = await startLazyDaemon(criu, dir, { address: '127.0.0.1', port }).catch((err: unknown) => {
          tunnel.close();
          throw err;
        });
        state.daemon = daemon;
        void daemon.exited.then((code) => this.settle(spec.name, state, code));
        return daemon;
      });
    } catch (err) {
      state.daemon?.kill();
      state.listener?.close();
      this.targets.delete(spec.name);
      throw err;
    }
  }

  /**
   * A restore from this host's images that pages its memory in after it runs (restoreInto): its status is the
   * sandbox's memory status, and a memory capture waits for it (awaitResident).
   */
  track(name: string, daemon: LazyDaemon, local = true): void {
    this.targets.get(name)?.daemon?.kill();
    const state: TargetState = { daemon, local };
    this.targets.set(name, state);
    void daemon.exited.then((code) => this.settle(name, state, code));
  }

  /**
   * A restore's `criu lazy-pages` outlives the agent that started it (the restored tree would lose its missing pages
   * with it): a restarted agent takes back each one still paging one of its sandboxes in, so captures wait for it
   * again and its scratch directory stays until it ends; one whose sandbox this agent does not hold is ended.
   */
  async adoptOrphans(): Promise<void> {
    const host = this.host;
    const adopted = new Set<string>();
    // A daemon writes its log into its scratch directory as it starts: with no such directory left, there is no
    // daemon of ours, and no need to read every process's command line.
    const lazyDirs = [];
    for (const entry of await readdir(host.checkpoints.staging).catch(() => [] as string[])) {
      const name = sandboxOfRestoreScratch(entry);
      if (name !== undefined && existsSync(join(host.checkpoints.staging, entry, LAZY_LOG))) lazyDirs.push({ entry, name });
    }
    if (lazyDirs.length === 0) return;
    const pids = (await readdir('/proc').catch(() => [] as string[])).filter((n) => /^\d+$/.test(n)).map(Number);
    for (const pid of pids) {
      const argv = (await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '')).split('\0');
      const at = argv.indexOf('-D');
      if (argv[1] !== 'lazy-pages' || at < 0) continue;
      const dir = argv[at + 1] ?? '';
      const entry = basename(dir);
      const start = await processStartTime(pid);
      const name = sandboxOfRestoreScratch(entry);
      if (dirname(dir) !== host.checkpoints.staging || name === undefined || start === null) continue;
      const daemon = adoptLazyDaemon(pid, start, dir);
      // Only a running sandbox's: a paused one means the agent died mid-resume, and that tree is not the sandbox.
      if (host.records.get(name)?.state.status !== 'running' || this.targets.has(name)) {
        daemon.kill();
        continue;
      }
      adopted.add(entry);
      host.scratch.add(entry);
      void daemon.exited.finally(() => {
        host.scratch.delete(entry);
        return rm(dir, { recursive: true, force: true }).catch(() => undefined);
      });
      this.track(name, daemon, !argv.includes('--page-server'));
      host.log?.info({ sandbox: name, pid }, 'a restore of the previous agent run is still paging memory in: adopted');
    }
    // A daemon that ended while no agent ran left its scratch directory (the agent removes it when it sees the end):
    // one that failed left its sandbox running on memory that faults in as zeros, which is lost.
    for (const { entry, name } of lazyDirs) {
      const dir = join(host.checkpoints.staging, entry);
      if (adopted.has(entry)) continue;
      const text = await readFile(join(dir, LAZY_EXIT_FILE), 'utf8').catch(() => '');
      const record = host.records.get(name);
      if (text.trim() !== '0' && record?.state.status === 'running' && record.state.init_pid > 0 && !this.targets.has(name)) {
        const error = `its memory was still being paged in when the agent stopped, and the paging ${text.trim() ? `failed (exit status ${text.trim()})` : 'was killed'}: the sandbox is lost`;
        this.targets.set(name, { error });
        host.log?.error({ sandbox: name, error }, 'lazy restore failed while no agent ran');
        killTree(record.state.init_pid, record.state.init_start);
      }
      await rm(dir, { recursive: true, force: true }).catch(() => undefined);
    }
  }

  private async settle(name: string, state: TargetState, code: number | null): Promise<void> {
    state.listener?.close();
    // A daemon replaced by a later restore's (or forgotten with its sandbox) speaks for nothing any more.
    if (this.targets.get(name) !== state) return;
    if (code === 0) {
      state.daemonDone = true;
      this.host.log?.info({ sandbox: name }, 'lazy restore: every page is resident');
      return;
    }
    // Tasks that touch a page that never came get SIGBUS at best: the sandbox is lost with its source.
    const status = await state.daemon?.status();
    state.error = status?.error ?? state.error ?? `criu lazy-pages ended with ${String(code)}`;
    this.host.log?.error({ sandbox: name, error: state.error }, 'lazy restore failed: the sandbox is lost');
    const record = this.host.records.get(name);
    if (record && record.state.init_pid > 0) killTree(record.state.init_pid, record.state.init_start);
  }

  /** The seed's MemoryStatus of a sandbox on this host; one not restored lazily is all resident. */
  async memoryStatus(name: string): Promise<MemoryStatus> {
    if (!this.host.records.has(name)) throw sandboxNotFound(name);
    const state = this.targets.get(name);
    if (state?.error !== undefined && !state.daemon) return { resident_chunks: 0, total_chunks: 0, done: false, error: state.error };
    if (!state?.daemon) return { resident_chunks: 0, total_chunks: 0, done: true };
    const st = await state.daemon.status();
    if (state.error !== undefined && !st.done) return { ...st, done: false, error: state.error };
    return st;
  }

  /**
   * A memory capture of a sandbox still paging in would miss the pages not yet there (CRIU dumps the pages present):
   * one paging in from this host's images is waited for (they are local: seconds), one paging in from a source agent
   * is refused until done.
   */
  async awaitResident(name: string): Promise<void> {
    const state = this.targets.get(name);
    const daemon = state?.daemon;
    if (!state || !daemon) return;
    if (state.local) {
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([daemon.exited, new Promise((r) => (timer = setTimeout(r, LOCAL_PAGING_WAIT_MS)))]);
      clearTimeout(timer);
    }
    const st = await daemon.status();
    if (st.done) return;
    if (state.error !== undefined || st.error !== undefined)
      throw sandboxFailed(`sandbox "${name}" lost its memory while paging it in: ${state.error ?? st.error ?? ''}`, { name });
    throw new AppError(
      'MEMORY_NOT_RESIDENT',
      409,
      `sandbox "${name}" is still paging its memory in (${String(st.resident_chunks)} of ${String(st.total_chunks)} pages): its memory cannot be captured until every page is resident`,
    );
  }

  /** Forget a destroyed sandbox; end a pinned capture that nobody will pull. */
  forget(name: string): void {
    const state = this.targets.get(name);
    state?.daemon?.kill();
    state?.listener?.close();
    this.targets.delete(name);
  }

  /**
   * The agent stops: pinned captures end, and so do restores paging from a source (their stream goes with the agent).
   * A restore paging from this host's images is left to finish (killing its daemon would leave the rest of the
   * sandbox's memory to fault in as zeros); the next run adopts it (adoptOrphans).
   */
  close(): void {
    for (const src of this.sources.values()) src.release();
    for (const [name, state] of [...this.targets]) {
      this.targets.delete(name);
      if (state.local || !state.daemon) continue;
      // Its stream goes with the agent: the tree cannot go on. Killed here, not left to settle, which may not run
      // before the agent's process exits.
      state.daemon.kill();
      state.listener?.close();
      const record = this.host.records.get(name);
      if (record && record.state.init_pid > 0 && !state.daemonDone) killTree(record.state.init_pid, record.state.init_start);
    }
  }
}

export function lazyUnsupported(): AppError {
  return new AppError('LAZY_PAGES_UNSUPPORTED', 409, 'this host cannot restore lazily (capacity lazy_pages is false)');
}

/**
 * A loopback listener for `criu lazy-pages --page-server`: its one
 * connection is piped into a websocket to the source agent's page route,
 * authenticated by the artifact grant.
 */
function openTunnel(from: LazyFrom, checkpointId: string, onError: (err: Error) => void): Promise<Server> {
  return new Promise((resolve, reject) => {
    const server = createServer({ noDelay: true } as never, (sock) => {
      server.close();
      const url = `${from.url.replace(/^http/, 'ws').replace(/\/+$/, '')}/v1/artifacts/${encodeURIComponent(checkpointId)}/pages`;
      const ws = new WebSocket(url, { headers: { authorization: `Bearer ${from.grant}` }, perMessageDeflate: false });
      ws.once('unexpected-response', (_req, res) => {
        onError(new Error(`the source answered ${String(res.statusCode)}`));
        sock.destroy();
      });
      ws.once('error', (err) => {
        onError(err);
        sock.destroy();
      });
      // The daemon hangs up once it has every page (or when it fails): the stream then closes from this side, and
      // whether the restore succeeded is the daemon's exit code (settle), whatever the close code.
      let daemonDone = false;
      sock.once('end', () => {
        daemonDone = true;
      });
      ws.once('close', (code) => {
        if (code !== 1000 && !daemonDone) onError(new Error(`the page stream closed (${String(code)})`));
        sock.destroy();
      });
      ws.once('open', () => {
        const stream = createWebSocketStream(ws);
        stream.on('error', () => sock.destroy());
        sock.on('error', () => ws.terminate());
        sock.pipe(stream).pipe(sock);
      });
    });
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => resolve(server));
  });
}
