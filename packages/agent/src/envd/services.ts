import type { MessageInitShape } from '@bufbuild/protobuf';
import { Code, ConnectError, createContextKey, type ConnectRouter, type HandlerContext } from '@connectrpc/connect';
import { EntryInfoSchema, FileType, Filesystem, WatchDirResponseSchema } from './gen/filesystem_pb.js';
import { Process, ProcessEventSchema, Signal } from './gen/process_pb.js';
import { absoluteGuestPath, type GuestEntry, type GuestFs } from './guest-fs.js';
import { follow, MAX_STDIN_PENDING, type OutputEvent, type ProcessTable } from './processes.js';
import { requireRootUser } from './user.js';
import type { WatcherTable } from './watch.js';
import { diffSnapshots, snapshotOf } from './watch.js';

/** The sandbox a request is for: set by the route from its URL, after the host token was checked. */
export const kSandbox = createContextKey<string>('', { description: 'sandbox name' });

function sandboxOf(ctx: HandlerContext): string {
  const name = ctx.values.get(kSandbox);
  if (!name) throw new ConnectError('no sandbox in the request path', Code.Internal);
  return name;
}

const WATCH_POLL_MS = 250;

export interface EnvdDeps {
  readonly processes: ProcessTable;
  readonly fs: GuestFs;
  readonly watchers: WatcherTable;
}

type EntryInit = MessageInitShape<typeof EntryInfoSchema>;
type EventInit = MessageInitShape<typeof ProcessEventSchema>;

export function entryInfo(e: GuestEntry): EntryInit {
  return {
    name: e.name,
    type:
      e.type === 'dir'
        ? FileType.DIRECTORY
        : e.type === 'file'
          ? FileType.FILE
          : e.type === 'symlink'
            ? FileType.SYMLINK
            : FileType.UNSPECIFIED,
    path: e.path,
    size: e.size,
    mode: e.mode,
    permissions: e.permissions,
    owner: e.owner,
    group: e.group,
    modifiedTime: { seconds: e.mtime.seconds, nanos: e.mtime.nanos },
    ...(e.symlinkTarget !== undefined ? { symlinkTarget: e.symlinkTarget } : {}),
  };
}

function toEvent(e: OutputEvent): EventInit {
  switch (e.kind) {
    case 'data':
      return { event: { case: 'data', value: { output: { case: e.stream, value: e.data } } } };
    case 'end':
      return {
        event: {
          case: 'end',
          value: { exitCode: e.exitCode, exited: e.exited, status: e.status, ...(e.error !== undefined ? { error: e.error } : {}) },
        },
      };
    case 'keepalive':
      return { event: { case: 'keepalive', value: {} } };
  }
}

/** The deadline the request carried, if any; the SDK sends its command timeout this way (0 = none). */
function deadlineOf(ctx: HandlerContext): number | undefined {
  const ms = ctx.timeoutMs();
  return ms !== undefined && ms > 0 ? ms : undefined;
}

export function registerEnvdServices(router: ConnectRouter, deps: EnvdDeps): void {
  const { processes, fs, watchers } = deps;

  router.service(Process, {
    async list(_req, ctx) {
      requireRootUser(ctx.requestHeader);
      return {
        processes: (await processes.list(sandboxOf(ctx))).map((p) => ({
          pid: p.pid,
          ...(p.tag !== undefined ? { tag: p.tag } : {}),
          config: {
            cmd: p.config.cmd,
            args: [...p.config.args],
            envs: { ...p.config.envs },
            ...(p.config.cwd !== undefined ? { cwd: p.config.cwd } : {}),
          },
        })),
      };
    },

    async *start(req, ctx) {
      requireRootUser(ctx.requestHeader);
      const sandbox = sandboxOf(ctx);
      const cfg = req.process;
      if (!cfg) throw new ConnectError('process is required', Code.InvalidArgument);
      const size = req.pty?.size;
      const { proc, first } = await processes.start(
        sandbox,
        {
          config: { cmd: cfg.cmd, args: cfg.args, envs: cfg.envs, ...(cfg.cwd !== undefined ? { cwd: absoluteGuestPath(cfg.cwd) } : {}) },
          ...(req.pty ? { pty: { rows: size?.rows || 24, cols: size?.cols || 80 } } : {}),
          ...(req.tag !== undefined ? { tag: req.tag } : {}),
          stdin: req.stdin ?? false,
        },
        deadlineOf(ctx),
      );
      yield { event: { event: { case: 'start', value: { pid: proc.pid } } } };
      for await (const e of follow(proc, first, ctx)) yield { event: toEvent(e) };
    },

    async *connect(req, ctx) {
      const sandbox = sandboxOf(ctx);
      const proc = await processes.find(sandbox, req.process?.selector ?? { case: undefined });
      if (proc.unseenEnd) {
        yield { event: { event: { case: 'start', value: { pid: proc.pid } } } };
        yield { event: toEvent(proc.unseenEnd.event) };
        processes.forget(sandbox, proc);
        return;
      }
      const sub = proc.subscribe();
      yield { event: { event: { case: 'start', value: { pid: proc.pid } } } };
      for await (const e of follow(proc, sub, ctx)) yield { event: toEvent(e) };
    },

    async update(req, ctx) {
      const proc = await processes.find(sandboxOf(ctx), req.process?.selector ?? { case: undefined });
      if (req.pty?.size) {
        if (!proc.pty) throw new ConnectError(`process ${proc.pid} has no pty to resize`, Code.InvalidArgument);
        proc.handle.resize(req.pty.size.rows, req.pty.size.cols);
      }
      return {};
    },

    async streamInput(reqs, ctx) {
      const sandbox = sandboxOf(ctx);
      let proc: Awaited<ReturnType<ProcessTable['find']>> | undefined;
      for await (const r of reqs) {
        switch (r.event.case) {
          case 'start':
            proc = await processes.find(sandbox, r.event.value.process?.selector ?? { case: undefined });
            break;
          case 'data':
            if (!proc) throw new ConnectError('send a start event naming the process first', Code.FailedPrecondition);
            writeInput(proc, r.event.value.input?.input);
            break;
          default:
            break;
        }
      }
      return {};
    },

    async sendInput(req, ctx) {
      const proc = await processes.find(sandboxOf(ctx), req.process?.selector ?? { case: undefined });
      writeInput(proc, req.input?.input);
      return {};
    },

    async sendSignal(req, ctx) {
      const proc = await processes.find(sandboxOf(ctx), req.process?.selector ?? { case: undefined });
      if (req.signal !== Signal.SIGKILL && req.signal !== Signal.SIGTERM)
        throw new ConnectError('signal must be SIGTERM or SIGKILL', Code.InvalidArgument);
      proc.handle.kill(req.signal === Signal.SIGKILL ? 'SIGKILL' : 'SIGTERM');
      return {};
    },

    async closeStdin(req, ctx) {
      const proc = await processes.find(sandboxOf(ctx), req.process?.selector ?? { case: undefined });
      if (proc.pty) throw new ConnectError('a pty has no stdin to close; send EOT (0x04) as input', Code.InvalidArgument);
      proc.handle.stdin.end();
      return {};
    },
  });

  router.service(Filesystem, {
    async stat(req, ctx) {
      requireRootUser(ctx.requestHeader);
      return { entry: entryInfo(await fs.stat(sandboxOf(ctx), absoluteGuestPath(req.path))) };
    },

    async makeDir(req, ctx) {
      requireRootUser(ctx.requestHeader);
      return { entry: entryInfo(await fs.makeDir(sandboxOf(ctx), absoluteGuestPath(req.path))) };
    },

    async move(req, ctx) {
      requireRootUser(ctx.requestHeader);
      return { entry: entryInfo(await fs.move(sandboxOf(ctx), absoluteGuestPath(req.source), absoluteGuestPath(req.destination))) };
    },

    async listDir(req, ctx) {
      requireRootUser(ctx.requestHeader);
      const depth = req.depth === 0 ? 1 : req.depth;
      return { entries: (await fs.list(sandboxOf(ctx), absoluteGuestPath(req.path), depth, ctx.signal)).map(entryInfo) };
    },

    async remove(req, ctx) {
      requireRootUser(ctx.requestHeader);
      await fs.remove(sandboxOf(ctx), absoluteGuestPath(req.path));
      return {};
    },

    async *watchDir(req, ctx): AsyncGenerator<MessageInitShape<typeof WatchDirResponseSchema>> {
      requireRootUser(ctx.requestHeader);
      refuseWatchOptions(req);
      const sandbox = sandboxOf(ctx);
      const dir = absoluteGuestPath(req.path);
      let before = await snapshotOf(fs, sandbox, dir, req.recursive, ctx.signal);
      yield { event: { case: 'start', value: {} } };
      const interval = Number(ctx.requestHeader.get('keepalive-ping-interval') ?? '');
      const keepaliveMs = Number.isFinite(interval) && interval > 0 ? interval * 1000 : 0;
      let lastSent = Date.now();
      const stopped = (): boolean => ctx.signal.aborted;
      while (!stopped()) {
        await sleep(WATCH_POLL_MS, ctx.signal);
        if (stopped()) break;
        const after = await snapshotOf(fs, sandbox, dir, req.recursive, ctx.signal);
        for (const ev of diffSnapshots(dir, before, after)) {
          lastSent = Date.now();
          yield { event: { case: 'filesystem', value: { name: ev.name, type: ev.type } } };
        }
        before = after;
        if (keepaliveMs && Date.now() - lastSent >= keepaliveMs) {
          lastSent = Date.now();
          yield { event: { case: 'keepalive', value: {} } };
        }
      }
    },

    async createWatcher(req, ctx) {
      requireRootUser(ctx.requestHeader);
      refuseWatchOptions(req);
      const sandbox = sandboxOf(ctx);
      const dir = absoluteGuestPath(req.path);
      const snapshot = await snapshotOf(fs, sandbox, dir, req.recursive, ctx.signal);
      return { watcherId: watchers.create(sandbox, dir, req.recursive, snapshot) };
    },

    async getWatcherEvents(req, ctx) {
      const sandbox = sandboxOf(ctx);
      const w = watchers.get(sandbox, req.watcherId);
      const after = await snapshotOf(fs, sandbox, w.dir, w.recursive, ctx.signal);
      const events = diffSnapshots(w.dir, w.snapshot, after);
      w.snapshot = after;
      return { events: events.map((e) => ({ name: e.name, type: e.type })) };
    },

    removeWatcher(req, ctx) {
      watchers.remove(sandboxOf(ctx), req.watcherId);
      return {};
    },
  });
}

function writeInput(
  proc: Awaited<ReturnType<ProcessTable['find']>>,
  input: { case: 'stdin' | 'pty'; value: Uint8Array } | { case: undefined; value?: undefined } | undefined,
): void {
  if (!input || input.case === undefined) throw new ConnectError('input needs stdin or pty bytes', Code.InvalidArgument);
  if (input.case === 'pty' && !proc.pty) throw new ConnectError(`process ${proc.pid} has no pty: send stdin`, Code.InvalidArgument);
  if (!proc.stdinWritable)
    throw new ConnectError(`stdin of process ${proc.pid} is closed (start it with stdin: true to keep it open)`, Code.FailedPrecondition);
  if (proc.stdinPending + input.value.length > MAX_STDIN_PENDING)
    throw new ConnectError(
      `stdin of process ${proc.pid} has ${proc.stdinPending} bytes not yet read (at most ${MAX_STDIN_PENDING}): it is not reading them`,
      Code.ResourceExhausted,
    );
  proc.handle.stdin.write(Buffer.from(input.value));
}

/** Fields this envd does not honour are refused, never accepted and ignored (the SDK refuses them itself below envd 0.6.3). */
function refuseWatchOptions(req: { includeEntry: boolean; allowNetworkMounts: boolean }): void {
  if (req.includeEntry) throw new ConnectError('includeEntry is not supported by this envd', Code.Unimplemented);
  if (req.allowNetworkMounts) throw new ConnectError('allowNetworkMounts is not supported by this envd', Code.Unimplemented);
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done(): void {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}
