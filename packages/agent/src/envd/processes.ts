import { Code, ConnectError, type HandlerContext } from '@connectrpc/connect';
import { PassThrough, Writable } from 'node:stream';
import { AppError } from '@fleet/agent-protocol';
import { BackendErrorCode, type Backend, type ProcessHandle } from '../backend.js';
import { isDurable, recoverDurable, spawnDurable } from './durable.js';
import { ENVD_HOME } from './guest-fs.js';

/**
 * The processes envd started, per sandbox. A process belongs to the agent,
 * not to the RPC that started it: a client that goes away leaves it
 * running, and Connect re-attaches to its output from then on (like envd,
 * nothing is replayed). Only the deadline the start request carried
 * (Connect-Timeout-Ms) kills it. Where processes are durable (durable.ts),
 * the table of a sandbox this agent did not start them in is rebuilt from
 * the guest on its first use (the deadline is not kept across that).
 */

/**
 * The SDK always asks for /bin/bash; an image without bash (the busybox base
 * image) runs /bin/sh instead, decided inside the guest. `echo $$` before the
 * exec hands the agent the guest pid of what follows (exec keeps the pid).
 */
const WRAPPER = 'echo $$; c=$1; shift; if [ "$c" = /bin/bash ] && [ ! -x /bin/bash ]; then c=/bin/sh; fi; exec "$c" "$@"';

/** Output waiting for one slow client past which the guest's pipes are paused. */
const HIGH_WATER = 4 * 1024 * 1024;
const MAX_PROCESSES_PER_SANDBOX = 256;
/** Stdin taken for a process and not yet in the guest (it is not reading, or it is paused) past which writes are refused. */
export const MAX_STDIN_PENDING = 4 * 1024 * 1024;
/** The kernel's bound on one argv string (MAX_ARG_STRLEN), less its NUL. */
const MAX_ARG_BYTES = 128 * 1024 - 1;
/** One `KEY=VALUE`: the process backend hands the guest's env to its helper hex-encoded, twice the size, in one string. */
const MAX_ENV_BYTES = Math.floor((128 * 1024 - 16) / 2);
/** cmd, args, envs, cwd and tag as JSON: what a durable process keeps in the guest and a recovery reads back. */
const MAX_CONFIG_BYTES = 256 * 1024;

export interface ProcessConfigInit {
  readonly cmd: string;
  readonly args: readonly string[];
  readonly envs: Readonly<Record<string, string>>;
  readonly cwd?: string | undefined;
}

export type OutputEvent =
  | { readonly kind: 'data'; readonly stream: 'stdout' | 'stderr' | 'pty'; readonly data: Uint8Array }
  | { readonly kind: 'end'; readonly exitCode: number; readonly exited: boolean; readonly status: string; readonly error?: string }
  | { readonly kind: 'keepalive' };

/** One client's view of a process's output: a bounded queue it drains at its own pace. */
export class Subscriber {
  #queue: OutputEvent[] = [];
  #bytes = 0;
  #wake: (() => void) | null = null;
  #closed = false;

  constructor(private readonly onDrained: () => void) {}

  get backlog(): number {
    return this.#bytes;
  }

  push(e: OutputEvent): void {
    if (this.#closed) return;
    this.#queue.push(e);
    if (e.kind === 'data') this.#bytes += e.data.length;
    this.#wake?.();
  }

  close(): void {
    this.#closed = true;
    this.#wake?.();
  }

  async *events(signal: AbortSignal): AsyncGenerator<OutputEvent> {
    const onAbort = (): void => this.#wake?.();
    signal.addEventListener('abort', onAbort);
    try {
      for (;;) {
        const e = this.#queue.shift();
        if (e) {
          if (e.kind === 'data') {
            this.#bytes -= e.data.length;
            if (this.#bytes < HIGH_WATER / 4) this.onDrained();
          }
          yield e;
          if (e.kind === 'end') return;
          continue;
        }
        if (this.#closed || signal.aborted) return;
        await new Promise<void>((resolve) => (this.#wake = resolve));
        this.#wake = null;
      }
    } finally {
      signal.removeEventListener('abort', onAbort);
    }
  }
}

export class EnvdProcess {
  readonly subscribers = new Set<Subscriber>();
  ended = false;
  #paused = false;

  constructor(
    readonly pid: number,
    readonly tag: string | undefined,
    readonly config: ProcessConfigInit,
    readonly pty: boolean,
    readonly handle: ProcessHandle,
    /** A recovered durable process that ended while no agent followed it: its end, told to the first client that connects. */
    readonly unseenEnd?: { readonly event: OutputEvent & { kind: 'end' }; readonly forget: () => void },
  ) {}

  subscribe(): Subscriber {
    const s = new Subscriber(() => this.resumeIfDrained());
    this.subscribers.add(s);
    return s;
  }

  unsubscribe(s: Subscriber): void {
    this.subscribers.delete(s);
    s.close();
    this.resumeIfDrained();
  }

  publish(e: OutputEvent): void {
    for (const s of this.subscribers) s.push(e);
    if (e.kind === 'data' && !this.#paused && [...this.subscribers].some((s) => s.backlog > HIGH_WATER)) {
      // The guest then blocks on a full pipe until the slowest client catches up; output keeps its order.
      this.#paused = true;
      this.handle.stdout.pause();
      this.handle.stderr.pause();
    }
  }

  private resumeIfDrained(): void {
    if (!this.#paused || [...this.subscribers].some((s) => s.backlog > HIGH_WATER / 4)) return;
    this.#paused = false;
    this.handle.stdout.resume();
    this.handle.stderr.resume();
  }

  get stdinWritable(): boolean {
    return !this.handle.stdin.destroyed && !this.handle.stdin.writableEnded;
  }

  get stdinPending(): number {
    return this.handle.stdin.writableLength + (isDurable(this.handle) ? this.handle.stdinPending() : 0);
  }
}

export interface StartRequest {
  readonly config: ProcessConfigInit;
  readonly pty?: { readonly rows: number; readonly cols: number } | undefined;
  readonly tag?: string | undefined;
  readonly stdin: boolean;
}

export class ProcessTable {
  readonly #bySandbox = new Map<string, Map<number, EnvdProcess>>();
  /**
   * Sandboxes whose durable processes this agent has looked for (or is looking for) in the guest, per incarnation:
   * a sandbox that comes back under the same name (a move there and back, a restore) is another one.
   */
  readonly #recovered = new Map<string, { readonly incarnation: string; readonly pending: Promise<void> }>();

  /** Whether a sandbox here can be paused with its processes (CRIU): only then is the durable path worth its cost. */
  #pausable: Promise<boolean> | undefined;

  constructor(private readonly backend: Backend) {}

  private pausable(): Promise<boolean> {
    // A QEMU pause keeps the whole guest, host-attached processes too; a process sandbox without CRIU never pauses.
    const known =
      this.#pausable ??
      (this.backend.kind === 'process'
        ? this.backend.capacity().then(
            (c) => c.live_snapshot === true,
            () => {
              this.#pausable = undefined;
              return false;
            },
          )
        : Promise.resolve(false));
    this.#pausable = known;
    return known;
  }

  /**
   * The first use of a sandbox by this agent: durable processes already in it (this agent restarted, or the sandbox
   * is a CRIU restore: a fork, a move) are taken into the table. A sandbox without /run/fleet-envd costs no exec.
   */
  private async recover(sandbox: string): Promise<void> {
    if (!(await this.pausable())) return;
    const incarnation = await this.incarnation(sandbox);
    if (incarnation === undefined) return;
    const seen = this.#recovered.get(sandbox);
    if (seen && seen.incarnation !== incarnation) this.forgetSandbox(sandbox);
    let pending = seen?.incarnation === incarnation ? seen.pending : undefined;
    if (!pending) {
      if (!seen) await this.pruneGone();
      pending = this.backend
        .resolveGuestPath(sandbox, '/run/fleet-envd', { forWrite: false })
        .then(
          () => true,
          (err: unknown) => {
            if (err instanceof AppError && err.code === BackendErrorCode.GuestPathNotFound) return false;
            throw err;
          },
        )
        .then(async (any) => {
          if (!any) return;
          const found = await recoverDurable(this.backend, sandbox, MAX_PROCESSES_PER_SANDBOX);
          if (this.#recovered.get(sandbox)?.pending !== pending) {
            // Another incarnation took over meanwhile: these followers are not its.
            for (const r of found) if ('handle' in r) r.handle.release();
            return;
          }
          const table = this.#bySandbox.get(sandbox) ?? new Map<number, EnvdProcess>();
          for (const r of found) {
            if (table.has(r.pid)) {
              // A start in flight got there first: one follower is enough.
              if ('handle' in r) r.handle.release();
              continue;
            }
            const config = { cmd: r.meta.cmd, args: r.meta.args, envs: r.meta.envs, cwd: r.meta.cwd };
            if ('handle' in r) {
              const proc = new EnvdProcess(r.pid, r.meta.tag, config, false, r.handle);
              r.handle.stdout.on('data', (chunk: Buffer) => {
                proc.publish({ kind: 'data', stream: 'stdout', data: chunk });
              });
              r.handle.stderr.on('data', (chunk: Buffer) => {
                proc.publish({ kind: 'data', stream: 'stderr', data: chunk });
              });
              this.track(sandbox, table, proc, () => false, undefined);
            } else {
              const status = `exit status ${r.exitCode}`;
              const end = {
                kind: 'end' as const,
                exitCode: r.exitCode,
                exited: true,
                status,
                ...(r.exitCode !== 0 ? { error: status } : {}),
              };
              const ended = new Promise<never>(() => undefined);
              const proc = new EnvdProcess(r.pid, r.meta.tag, config, false, endedHandle(ended), { event: end, forget: r.forget });
              proc.ended = true;
              table.set(r.pid, proc);
            }
          }
          if (table.size > 0) this.#bySandbox.set(sandbox, table);
        });
      const entry = { incarnation, pending };
      this.#recovered.set(sandbox, entry);
      // Not running (paused) or gone: the next use looks again.
      pending.catch(() => {
        if (this.#recovered.get(sandbox) === entry) this.#recovered.delete(sandbox);
      });
    }
    await pending.catch(() => undefined);
  }

  /**
   * When the sandbox was made on this host and what it was last restored from: new for a sandbox that comes back
   * (a move there and back) or is restored, unchanged by a pause and resume (whose processes this table keeps).
   */
  private async incarnation(sandbox: string): Promise<string | undefined> {
    try {
      const info = await this.backend.get(sandbox);
      return `${info.created_at} ${info.checkpoint_id}`;
    } catch (err) {
      if (err instanceof AppError && err.code === BackendErrorCode.SandboxNotFound) this.forgetSandbox(sandbox);
      return undefined;
    }
  }

  /** What this agent held of a sandbox's earlier incarnation: its followers stop, its clients are let go. */
  private forgetSandbox(sandbox: string): void {
    this.#recovered.delete(sandbox);
    const table = this.#bySandbox.get(sandbox);
    if (!table) return;
    this.#bySandbox.delete(sandbox);
    for (const p of table.values()) {
      if (!isDurable(p.handle)) continue;
      p.handle.release();
      p.ended = true;
      for (const s of p.subscribers) s.close();
    }
  }

  /** Entries of sandboxes no longer on this host go, so the table does not grow with every sandbox it ever served. */
  private async pruneGone(): Promise<void> {
    const here = new Set((await this.backend.list().catch(() => undefined))?.map((s) => s.name));
    if (here.size === 0) return;
    for (const name of [...this.#recovered.keys(), ...this.#bySandbox.keys()]) if (!here.has(name)) this.forgetSandbox(name);
  }

  async list(sandbox: string): Promise<EnvdProcess[]> {
    await this.recover(sandbox);
    const live = [...(this.#bySandbox.get(sandbox)?.values() ?? [])].filter((p) => !p.ended);
    // A process whose follower a pause ended is followed again once the sandbox answers (this call is the sign).
    for (const p of live) if (isDurable(p.handle)) p.handle.revive();
    return live;
  }

  async find(
    sandbox: string,
    selector: { case: 'pid'; value: number } | { case: 'tag'; value: string } | { case: undefined },
  ): Promise<EnvdProcess> {
    if (selector.case === undefined) throw new ConnectError('process selector needs a pid or a tag', Code.InvalidArgument);
    const match = (p: EnvdProcess): boolean => (selector.case === 'pid' ? p.pid === selector.value : p.tag === selector.value);
    const found =
      (await this.list(sandbox)).find(match) ??
      [...(this.#bySandbox.get(sandbox)?.values() ?? [])].find((p) => p.unseenEnd !== undefined && match(p));
    if (!found) throw new ConnectError(`process with ${selector.case} ${String(selector.value)} not found`, Code.NotFound);
    return found;
  }

  /** A recovered process's end has been told: it leaves the table and its directory the guest. */
  forget(sandbox: string, proc: EnvdProcess): void {
    const table = this.#bySandbox.get(sandbox);
    if (table?.get(proc.pid) !== proc) return;
    table.delete(proc.pid);
    if (table.size === 0) this.#bySandbox.delete(sandbox);
    proc.unseenEnd?.forget();
  }

  /**
   * Spawns the process and subscribes `first` before any output can flow, so
   * the starting client misses nothing; resolves once the guest pid is known.
   */
  async start(sandbox: string, req: StartRequest, timeoutMs: number | undefined): Promise<{ proc: EnvdProcess; first: Subscriber }> {
    if ((await this.list(sandbox)).length >= MAX_PROCESSES_PER_SANDBOX) {
      throw new ConnectError(`more than ${MAX_PROCESSES_PER_SANDBOX} envd processes are running in this sandbox`, Code.ResourceExhausted);
    }
    if (!req.config.cmd) throw new ConnectError('process.cmd is required', Code.InvalidArgument);
    checkSize(req);
    const env = { HOME: ENVD_HOME, ...(req.pty ? { TERM: 'xterm-256color' } : {}), ...req.config.envs };
    const cwd = req.config.cwd ?? ENVD_HOME;
    // Without a pty, nothing of the process needs the host: where a pause would otherwise end it, it runs in the
    // sandbox's own tree (durable.ts; slower to start and to relay, so only there), its stdin a FIFO in the guest.
    // A pty session stays host-attached and ends at a pause.
    const attached = req.pty !== undefined || !(await this.pausable());
    const spawned = attached
      ? this.backend.spawn(sandbox, {
          argv: ['/bin/sh', '-c', WRAPPER, 'envd', req.config.cmd, ...req.config.args],
          env,
          cwd,
          stdin: req.stdin || req.pty !== undefined,
          ...(req.pty ? { tty: req.pty } : {}),
        })
      : spawnDurable(
          this.backend,
          sandbox,
          { cmd: req.config.cmd, args: req.config.args, envs: req.config.envs, cwd: req.config.cwd, tag: req.tag },
          req.stdin,
          { env, cwd },
        );
    const handle = await spawned.catch((err: unknown) => {
      // The backend's own exec bounds (checkSize should have caught them first) are the client's input too.
      if (err instanceof AppError && err.code === BackendErrorCode.InvalidSpec) throw new ConnectError(err.message, Code.InvalidArgument);
      throw err;
    });
    handle.stdin.on('error', () => {});
    const pending: OutputEvent[] = [];
    // Output that comes before the pid is known waits here for the process record.
    const live: { proc?: EnvdProcess } = {};
    const emit = (e: OutputEvent): void => {
      if (live.proc) live.proc.publish(e);
      else pending.push(e);
    };

    // The first line of stdout is the wrapper's pid; everything after it is the process's own output.
    const pid = new Promise<number>((resolve, reject) => {
      let head = Buffer.alloc(0);
      let found = false;
      const outStream = req.pty ? 'pty' : 'stdout';
      handle.stdout.on('data', (chunk: Buffer) => {
        if (found) {
          emit({ kind: 'data', stream: outStream, data: chunk });
          return;
        }
        head = Buffer.concat([head, chunk]);
        const nl = head.indexOf(10);
        if (nl < 0) {
          if (head.length > 64) handle.kill('SIGKILL');
          return;
        }
        found = true;
        const line = head.subarray(0, nl).toString('latin1').replace(/\r$/, '');
        const rest = head.subarray(nl + 1);
        const n = Number(line);
        if (!/^\d+$/.test(line) || n <= 0) {
          handle.kill('SIGKILL');
          reject(new ConnectError('the process did not start', Code.Internal));
          return;
        }
        resolve(n);
        if (rest.length > 0) emit({ kind: 'data', stream: outStream, data: rest });
      });
      let stderrHead = '';
      handle.stderr.on('data', (chunk: Buffer) => {
        if (!found && stderrHead.length < 2000) stderrHead += chunk.toString('utf8');
        emit({ kind: 'data', stream: 'stderr', data: chunk });
      });
      handle.wait().then(
        (st) => {
          if (!found)
            reject(
              new ConnectError(
                `could not start ${req.config.cmd}: ${stderrHead.trim().slice(0, 500) || `exit ${st.exitCode ?? st.signal}`}`,
                Code.InvalidArgument,
              ),
            );
        },
        (err: unknown) => {
          reject(err instanceof Error ? err : new Error(String(err)));
        },
      );
    });

    let timedOut = false;
    const timer =
      timeoutMs !== undefined && timeoutMs > 0
        ? setTimeout(() => {
            timedOut = true;
            handle.kill('SIGKILL');
          }, timeoutMs)
        : undefined;
    let guestPid: number;
    try {
      guestPid = await pid;
    } catch (err) {
      if (timer) clearTimeout(timer);
      throw err;
    }
    const proc = new EnvdProcess(guestPid, req.tag, req.config, req.pty !== undefined, handle);
    live.proc = proc;
    const first = proc.subscribe();
    for (const e of pending.splice(0)) proc.publish(e);
    const table = this.#bySandbox.get(sandbox) ?? new Map<number, EnvdProcess>();
    this.track(sandbox, table, proc, () => timedOut, timer);
    return { proc, first };
  }

  /** Into the table until it ends; its end goes to every client then. */
  private track(
    sandbox: string,
    table: Map<number, EnvdProcess>,
    started: EnvdProcess,
    timedOut: () => boolean,
    timer: NodeJS.Timeout | undefined,
  ): void {
    const before = table.get(started.pid);
    if (before && before !== started && isDurable(before.handle)) {
      // A recovery that ran while this start was in flight follows the same process: this one is enough.
      before.handle.release();
      before.ended = true;
      for (const s of before.subscribers) s.close();
    }
    table.set(started.pid, started);
    this.#bySandbox.set(sandbox, table);
    void started.handle.wait().then(
      (st) => {
        if (timer) clearTimeout(timer);
        started.ended = true;
        const exitCode = st.exitCode ?? -1;
        const status = st.signal ? `signal: ${signalName(st.signal)}` : `exit status ${exitCode}`;
        started.publish({
          kind: 'end',
          exitCode,
          exited: st.signal === null,
          status,
          ...(exitCode !== 0 || st.signal ? { error: timedOut() ? `${status} (deadline exceeded)` : status } : {}),
        });
        for (const s of started.subscribers) s.close();
        if (table.get(started.pid) === started) table.delete(started.pid);
        if (table.size === 0 && this.#bySandbox.get(sandbox) === table) this.#bySandbox.delete(sandbox);
      },
      () => undefined,
    );
  }
}

/** Oversized input fails here with a clear error, not at the guest's exec (E2BIG) nor in a recovery that cannot read it back. */
function checkSize(req: StartRequest): void {
  const arg = [req.config.cmd, ...req.config.args].find((a) => Buffer.byteLength(a) > MAX_ARG_BYTES);
  if (arg !== undefined)
    throw new ConnectError(`an argument is ${Buffer.byteLength(arg)} bytes; at most ${MAX_ARG_BYTES}`, Code.InvalidArgument);
  const env = Object.entries(req.config.envs).find(([k, v]) => Buffer.byteLength(`${k}=${v}`) > MAX_ENV_BYTES);
  if (env !== undefined)
    throw new ConnectError(
      `env var ${env[0].slice(0, 64)} is ${Buffer.byteLength(`${env[0]}=${env[1]}`)} bytes; at most ${MAX_ENV_BYTES}`,
      Code.InvalidArgument,
    );
  const { cmd, args, envs, cwd } = req.config;
  const total = Buffer.byteLength(JSON.stringify({ cmd, args, envs, cwd, tag: req.tag }));
  if (total > MAX_CONFIG_BYTES)
    throw new ConnectError(`cmd, args and envs take ${total} bytes as JSON; at most ${MAX_CONFIG_BYTES}`, Code.InvalidArgument);
}

/** The handle of a process that ended before this agent knew it: nothing to read, write or signal. */
function endedHandle(never: Promise<never>): ProcessHandle {
  const stdin = new Writable({ write: (_c, _e, cb) => cb() });
  stdin.end();
  const stdout = new PassThrough();
  const stderr = new PassThrough();
  stdout.end();
  stderr.end();
  return { stdin, stdout, stderr, resize: () => undefined, kill: () => undefined, wait: () => never };
}

function signalName(signal: NodeJS.Signals): string {
  return signal === 'SIGKILL' ? 'killed' : signal === 'SIGTERM' ? 'terminated' : signal.toLowerCase();
}

/** Streams a subscriber's events with keepalives; the process outlives a client that disconnects. */
export async function* follow(proc: EnvdProcess, sub: Subscriber, ctx: HandlerContext): AsyncGenerator<OutputEvent> {
  const interval = Number(ctx.requestHeader.get('keepalive-ping-interval') ?? '');
  const keepalive =
    Number.isFinite(interval) && interval > 0
      ? setInterval(() => sub.push({ kind: 'keepalive' }), Math.max(1, interval) * 1000)
      : undefined;
  try {
    yield* sub.events(ctx.signal);
  } finally {
    if (keepalive) clearInterval(keepalive);
    proc.unsubscribe(sub);
  }
}
