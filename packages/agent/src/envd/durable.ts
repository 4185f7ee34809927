import { constants as osConstants } from 'node:os';
import { PassThrough, Writable } from 'node:stream';
import { AppError } from '@fleet/agent-protocol';
import type { Backend, ExitStatus, ProcessHandle, SpawnOptions } from '../backend.js';

/**
 * An envd process that outlives what the agent holds of it: a pause (CRIU
 * dumps the sandbox init's tree only, and a host-side exec is not in it), a
 * killed relay, a dropped client, an agent restart, a fork or a move. The
 * command runs inside the guest as a child of the guest's own /bin/sh
 * (SUPERVISE), itself reparented to the sandbox's init (so both are part of
 * the dumped tree and neither goes with the exec that started them), each in
 * a session of its own, with its stdout and stderr on files in a directory
 * of its own under /run/fleet-envd, its config in `meta` and its exit status
 * written there by that shell. The agent reads the files through a follower
 * exec (one shell loop) from the offsets it has seen, and the follower keeps
 * the offsets it has printed in `at`; when the follower dies without the
 * status (a pause killed it), the process stays listed and `revive()` starts
 * a new follower from the same offsets once the sandbox runs again. An agent
 * that finds a sandbox it did not start the processes of (its own restart,
 * or a CRIU restore into a new sandbox: fork, move) rebuilds them from these
 * directories (`recoverDurable`), from `at`: a fork's child goes on from
 * what the source had delivered at the fork point, with its own output.
 * The agent removes a directory once it has the status. Polling
 * (every 20 ms while output flows, backing off to 250 ms after 10 s idle)
 * because a guest image has no inotify tool to rely on.
 */

/**
 * The command's parent in the guest, in a session of its own (not the exec's, whose end kills its group): it
 * writes the command's pid and its own (whose liveness says the status is still to come), waits and writes the status.
 * With stdin, the command reads a FIFO in its directory that a holder (a sleep with the FIFO open for writing, so
 * the command sees no EOF while no agent writes) keeps open until stdin is closed: the agent writes through an exec
 * (`cat`), and the whole of it is the sandbox's own tree, which CRIU takes with the FIFO's unread bytes.
 */
const SUPERVISE =
  'd=$1; shift; i=/dev/null; if [ -p "$d/in" ]; then ' +
  '(exec 3<>"$d/in"; exec sleep 2147483647) </dev/null >/dev/null 2>&1 & echo "$!" >"$d/hold"; i="$d/in"; fi; ' +
  'pump() { o=0; while :; do dd bs=16384 count=32 of="$1.$o" 2>/dev/null; n=$(wc -c <"$1.$o"); n=$((n)); ' +
  '[ "$n" -gt 0 ] || break; o=$((o+n)); done; }; ' +
  'pump "$d/out" <"$d/o.p" & po=$!; pump "$d/err" <"$d/e.p" & pe=$!; ' +
  '"$@" <"$i" >"$d/o.p" 2>"$d/e.p" & p=$!; echo "$p $$" >"$d/pid.t"; mv "$d/pid.t" "$d/pid"; ' +
  'wait "$p"; r=$?; [ -f "$d/hold" ] && read -r h <"$d/hold" && kill "$h" 2>/dev/null; ' +
  '(sleep 2; kill "$po" "$pe") 2>/dev/null & k=$!; wait "$po" "$pe"; kill "$k" 2>/dev/null; ' +
  'echo "$r" >"$d/status.t"; mv "$d/status.t" "$d/status"';

/**
 * Whether pid $1 is the supervisor of directory $2. Not `kill -0`: /run is on the sandbox's disk, so a directory
 * outlives a stop, a disk restore or a disk snapshot, and in the fresh pid namespace after those its supervisor's pid
 * is likely some other process's. The supervisor's argv names its directory (and survives a CRIU restore).
 */
const ALIVE = `alive() { [ -n "$1" ] || return 1; [ -e /proc/self ] || { kill -0 "$1" 2>/dev/null; return; }; [ -e "/proc/$1" ] || return 1; case $(tr '\\000' ' ' <"/proc/$1/cmdline" 2>/dev/null) in *" envd-supervise $2 "*) return 0;; esac; return 1; }`;

/** Closes a durable command's stdin: the holder goes; the agent's writer, if any, has ended first. */
const CLOSE_STDIN = 'read -r h <"$1/hold" && kill "$h" 2>/dev/null; rm -f "$1/hold"';

/**
 * "start": launch then follow; "attach": follow `dir` from the two offsets. Prints "<pid> <dir>" first on a start.
 * A stream is chunks named by their first byte's offset (out.0, out.524288 …, each at most 512 KiB; the next one
 * exists only once its predecessor is complete); `rd` reads on from offset O in chunk S and, entering a chunk,
 * removes the one before the last: what stays of delivered output is at most the two last chunks (1 MiB) a stream.
 */
const SCRIPT = `
SUPERVISE='${SUPERVISE}'
${ALIVE}
if [ "$1" = start ]; then
  shift; in=$1; shift; c=$1; shift
  for t in dd mkfifo mktemp wc tail head tr; do
    command -v "$t" >/dev/null 2>&1 || { echo "this image has no $t, which envd processes need" >&2; exit 125; }
  done
  if [ "$c" = /bin/bash ] && [ ! -x /bin/bash ]; then c=/bin/sh; fi
  s=; if command -v setsid >/dev/null 2>&1; then s=setsid; fi
  mkdir -p /run/fleet-envd && d=$(mktemp -d /run/fleet-envd/p.XXXXXXXX) || exit 125
  umask 077
  mkfifo -m 600 "$d/o.p" "$d/e.p" && cat >"$d/meta" || exit 125
  if [ "$in" = 1 ]; then mkfifo -m 600 "$d/in" || exit 125; fi
  umask 022
  ( $s /bin/sh -c "$SUPERVISE" envd-supervise "$d" $s "$c" "$@" </dev/null >/dev/null 2>&1 & )
  i=0; while [ ! -e "$d/pid" ]; do i=$((i+1)); [ "$i" -gt 1000 ] && exit 125; sleep 0.01; done
  read -r p _ <"$d/pid"; echo "$p $d"; oo=0; eo=0
else
  d=$2; oo=$3; eo=$4
fi
sp=; [ -f "$d/pid" ] && read -r _ sp <"$d/pid"
rd() {
  if [ "$S" -lt 0 ]; then
    S=0; for f in "$1".*; do x=\${f##*.}; case $x in ''|*[!0-9]*) continue;; esac; [ "$x" -le "$O" ] && [ "$x" -gt "$S" ] && S=$x; done
    for f in "$1".*; do x=\${f##*.}; case $x in ''|*[!0-9]*) continue;; esac; [ "$x" -lt "$S" ] && rm -f "$f"; done
  fi
  while [ -e "$1.$S" ]; do
    n=$(wc -c <"$1.$S" 2>/dev/null); n=$((n)); w=$((O-S))
    if [ "$n" -gt "$w" ]; then tail -c +$((w+1)) "$1.$S" 2>/dev/null | head -c $((n-w)); O=$((S+n)); M=1; fi
    [ "$n" -gt 0 ] && [ -e "$1.$((S+n))" ] || break
    [ "$P" -ge 0 ] && rm -f "$1.$P"; P=$S; S=$((S+n))
  done
}
so=-1; po=-1; se=-1; pe=-1; idle=0
while :; do
  l=0; [ "$idle" -ge 25 ] && [ $((idle % 8)) = 1 ] && ! alive "$sp" "$d" && l=1
  f=0; [ -e "$d/status" ] && f=1
  [ -d "$d" ] || kill -ABRT $$
  M=0
  O=$oo; S=$so; P=$po; rd "$d/out"; oo=$O; so=$S; po=$P
  O=$eo; S=$se; P=$pe; rd "$d/err" >&2; eo=$O; se=$S; pe=$P
  if [ "$M" = 1 ]; then idle=0; echo "$oo $eo" >"$d/at"; fi
  if [ "$f" = 1 ]; then read -r r <"$d/status"; exit "$r"; fi
  if [ "$l" = 1 ]; then rm -rf "$d"; kill -ABRT $$; fi
  idle=$((idle+1)); if [ "$idle" -lt 25 ]; then sleep 0.02; elif [ "$idle" -lt 125 ]; then sleep 0.1; else sleep 0.25; fi
done`;

/**
 * One line per directory: dir, command pid, whether its supervisor lives, the status or "-", the offsets the last
 * follower printed, whether its stdin is open (its holder lives), then the meta JSON. The supervisor is asked before the status: dead without one, it never comes.
 */
const SCAN = `
${ALIVE}
for d in /run/fleet-envd/p.*; do
  [ -f "$d/meta" ] && [ -f "$d/pid" ] || continue
  read -r p s <"$d/pid"; a=0; alive "$s" "$d" && a=1
  st=-; [ -f "$d/status" ] && read -r st <"$d/status"
  o=0; e=0; [ -f "$d/at" ] && read -r o e <"$d/at"
  i=0; h=; [ -f "$d/hold" ] && read -r h <"$d/hold"; [ -n "$h" ] && [ -e "/proc/$h" ] && case $(tr '\\000' ' ' <"/proc/$h/cmdline" 2>/dev/null) in "sleep 2147483647 "*) i=1;; esac
  printf '%s %s %s %s %s %s %s ' "$d" "$p" "$a" "\${st:--}" "\${o:-0}" "\${e:-0}" "$i"; head -c 300000 "$d/meta" | tr '\\n' ' '; echo
done`;

const DIR = /^\/run\/fleet-envd\/p\.[A-Za-z0-9]+$/;

/** The command's group (it leads its session); busybox's kill takes no `--`, dash's needs it before a negative pid. */
const KILL = 'kill -s "$1" -- "-$2" 2>/dev/null || kill -s "$1" "-$2" 2>/dev/null || kill -s "$1" "$2"';

export interface DurableHandle extends ProcessHandle {
  /** Starts a follower again if the last one died without the exit status (the sandbox was paused, say). */
  revive(): void;
  /** Stdin bytes taken but not yet handed to the guest. */
  stdinPending(): number;
  /** Stops following without touching the guest's process (another handle follows it); wait() never settles then. */
  release(): void;
}

export function isDurable(h: ProcessHandle): h is DurableHandle {
  return typeof (h as Partial<DurableHandle>).revive === 'function';
}

/** What a durable process's directory keeps of how it was started, for an agent that did not start it. */
export interface DurableMeta {
  readonly cmd: string;
  readonly args: readonly string[];
  readonly envs: Readonly<Record<string, string>>;
  readonly cwd?: string | undefined;
  readonly tag?: string | undefined;
}

/** Its first stdout line is the guest pid (as the host-held path's wrapper prints it), then the command's output. */
export async function spawnDurable(
  backend: Backend,
  sandbox: string,
  meta: DurableMeta,
  withStdin: boolean,
  opts: Omit<SpawnOptions, 'argv' | 'stdin' | 'tty'>,
): Promise<DurableHandle> {
  const d = durable(backend, sandbox, withStdin, undefined);
  // The meta (envs: often secrets) goes through stdin into a file of the 0700 directory, never on an argv.
  const h = await backend.spawn(sandbox, {
    ...opts,
    argv: ['/bin/sh', '-c', SCRIPT, 'envd', 'start', withStdin ? '1' : '0', meta.cmd, ...meta.args],
    stdin: true,
  });
  h.stdin.on('error', () => undefined);
  h.stdin.end(JSON.stringify(meta));
  d.attach(h, true);
  return d.handle;
}

export type Recovered =
  | { readonly pid: number; readonly meta: DurableMeta; readonly handle: DurableHandle }
  | { readonly pid: number; readonly meta: DurableMeta; readonly exitCode: number; readonly forget: () => void };

/**
 * The durable processes of a sandbox this agent did not start them in (after its own restart, or a CRIU restore
 * into a new sandbox): running ones are followed again from the offsets the last follower printed; ended ones
 * carry their status until a client has been told (`forget`). A directory whose supervisor died without a
 * status is removed. Whatever the guest printed is untrusted: bounded, and a line that does not parse is skipped.
 */
export async function recoverDurable(backend: Backend, sandbox: string, max: number): Promise<Recovered[]> {
  const h = await backend.spawn(sandbox, { argv: ['/bin/sh', '-c', SCAN, 'envd-scan'], stdin: false });
  h.stderr.resume();
  const chunks: Buffer[] = [];
  let size = 0;
  h.stdout.on('data', (c: Buffer) => {
    size += c.length;
    if (size > 80 * 1024 * 1024) h.kill('SIGKILL');
    else chunks.push(c);
  });
  await h.wait();
  const out: Recovered[] = [];
  for (const line of Buffer.concat(chunks).toString('utf8').split('\n')) {
    const m = /^(\S+) (\d+) ([01]) (-|\d+) (\d+) (\d+) ([01]) (.*)$/.exec(line);
    if (!m || out.length >= max) continue;
    const [, dir = '', pidText = '', alive, status = '-', o = '0', e = '0', stdinOpen, json = ''] = m;
    const pid = Number(pidText);
    const meta = parseMeta(json);
    if (!DIR.test(dir) || !meta || !(pid > 0)) continue;
    if (alive === '1') {
      const d = durable(backend, sandbox, stdinOpen === '1', { pid, dir, out: Number(o), err: Number(e) });
      d.handle.revive();
      out.push({ pid, meta, handle: d.handle });
    } else if (status !== '-') {
      out.push({ pid, meta, exitCode: Number(status), forget: () => void removeDir(backend, sandbox, dir) });
    } else void removeDir(backend, sandbox, dir);
  }
  return out;
}

function parseMeta(json: string): DurableMeta | undefined {
  try {
    const v = JSON.parse(json) as unknown;
    if (typeof v !== 'object' || v === null) return undefined;
    const { cmd, args, envs, cwd, tag } = v as Record<string, unknown>;
    const strings = (x: unknown): x is string[] => Array.isArray(x) && x.every((a) => typeof a === 'string');
    const record = (x: unknown): x is Record<string, string> =>
      typeof x === 'object' && x !== null && !Array.isArray(x) && Object.values(x).every((a) => typeof a === 'string');
    if (typeof cmd !== 'string' || !strings(args) || !record(envs)) return undefined;
    if ((cwd !== undefined && typeof cwd !== 'string') || (tag !== undefined && typeof tag !== 'string')) return undefined;
    return { cmd, args, envs, cwd, tag };
  } catch {
    return undefined;
  }
}

function removeDir(backend: Backend, sandbox: string, dir: string): Promise<void> {
  if (!DIR.test(dir)) return Promise.resolve();
  return backend
    .spawn(sandbox, { argv: ['/bin/sh', '-c', 'rm -rf -- "$1"', 'envd-rm', dir], stdin: false })
    .then((h) => h.wait())
    .then(
      () => undefined,
      () => undefined,
    );
}

/** The state of one durable process and its followers; `known` when the process already runs (recovery). */
function durable(
  backend: Backend,
  sandbox: string,
  withStdin: boolean,
  known: { pid: number; dir: string; out: number; err: number } | undefined,
): { handle: DurableHandle; attach: (h: ProcessHandle, start: boolean) => void } {
  const stdout = new PassThrough();
  const stderr = new PassThrough();
  let pid: number | undefined = known?.pid;
  let dir = known?.dir ?? '';
  const fifo = withStdin ? fifoWriter(backend, sandbox, () => (pid === undefined ? undefined : dir)) : undefined;
  const stdin = fifo?.stream ?? closedWriter();
  const offset = { out: known?.out ?? 0, err: known?.err ?? 0 };
  const sent = new Set<number>();
  let pendingKill: NodeJS.Signals | undefined;
  let ended = false;
  let following: ProcessHandle | undefined;
  let reviving = false;
  let settle!: (st: ExitStatus) => void;
  const exited = new Promise<ExitStatus>((resolve) => (settle = resolve));

  const finish = (st: ExitStatus): void => {
    if (ended) return;
    ended = true;
    fifo?.stop();
    stdout.end();
    stderr.end();
    settle(st);
  };
  const signalGuest = (signal: NodeJS.Signals): void => {
    const num = osConstants.signals[signal];
    if (pid === undefined) {
      pendingKill = signal;
      return;
    }
    sent.add(num);
    void backend
      .spawn(sandbox, { argv: ['/bin/sh', '-c', KILL, 'kill', String(num), String(pid)], stdin: false })
      .then((h) => h.wait())
      .catch(() => undefined);
  };

  const attach = (h: ProcessHandle, start: boolean): void => {
    following = h;
    let head = start ? Buffer.alloc(0) : null;
    const onDrain = (): void => {
      if (following === h) {
        h.stdout.resume();
        h.stderr.resume();
      }
    };
    stdout.on('drain', onDrain);
    stderr.on('drain', onDrain);
    h.stdout.on('data', (chunk: Buffer) => {
      let data = chunk;
      if (head) {
        head = Buffer.concat([head, chunk]);
        const nl = head.indexOf(10);
        if (nl < 0) {
          if (head.length > 4200) h.kill('SIGKILL');
          return;
        }
        const m = /^(\d+) (\/run\/fleet-envd\/p\.[A-Za-z0-9]+)$/.exec(head.subarray(0, nl).toString('latin1'));
        data = head.subarray(nl + 1);
        head = null;
        if (!m) {
          h.kill('SIGKILL');
          return;
        }
        pid = Number(m[1]);
        dir = m[2] ?? '';
        stdout.write(`${String(pid)}\n`);
        if (pendingKill) signalGuest(pendingKill);
      }
      if (data.length === 0) return;
      offset.out += data.length;
      if (!stdout.write(data)) h.stdout.pause();
    });
    h.stderr.on('data', (chunk: Buffer) => {
      if (pid !== undefined) offset.err += chunk.length;
      if (!stderr.write(chunk)) h.stderr.pause();
    });
    void h.wait().then(
      (st) => {
        stdout.off('drain', onDrain);
        stderr.off('drain', onDrain);
        if (following === h) following = undefined;
        // By number: the exec reports signal 6 as SIGIOT, its other name.
        const lost = st.signal !== null && osConstants.signals[st.signal] === osConstants.signals.SIGABRT;
        if (pid === undefined || st.exitCode !== null || lost) {
          // The status (or a start that failed), or the end is lost (the directory or the supervisor gone, no status).
          if (pid !== undefined && lost) {
            finish({ exitCode: -1, signal: null });
            return;
          }
          const code = st.exitCode;
          if (pid !== undefined && code !== null) void removeDir(backend, sandbox, dir);
          if (code !== null && code > 128 && sent.has(code - 128)) {
            const name = Object.entries(osConstants.signals).find(([, n]) => n === code - 128)?.[0] as NodeJS.Signals | undefined;
            finish({ exitCode: null, signal: name ?? 'SIGKILL' });
          } else finish(st);
        }
        // Else the follower was killed with the command still running: revive() follows on.
      },
      () => undefined,
    );
  };

  const handle: DurableHandle = {
    stdout,
    stderr,
    stdin,
    resize: () => undefined,
    kill: (signal = 'SIGKILL') => {
      signalGuest(signal);
    },
    wait: () => exited,
    stdinPending: () => fifo?.pending() ?? 0,
    release: () => {
      if (ended) return;
      ended = true;
      fifo?.stop();
      following?.kill('SIGKILL');
      stdout.end();
      stderr.end();
    },
    revive: () => {
      fifo?.kick();
      if (ended || following || reviving || pid === undefined) return;
      reviving = true;
      backend
        .spawn(sandbox, {
          argv: ['/bin/sh', '-c', SCRIPT, 'envd', 'attach', dir, String(offset.out), String(offset.err)],
          stdin: false,
        })
        .then(
          (h) => {
            reviving = false;
            if (ended) h.kill('SIGKILL');
            else attach(h, false);
          },
          (err: unknown) => {
            reviving = false;
            // The sandbox is gone: so is the process. Not running (paused): a later call tries again.
            if (err instanceof AppError && err.code === 'SANDBOX_NOT_FOUND') finish({ exitCode: null, signal: 'SIGKILL' });
          },
        );
    },
  };
  return { handle, attach };
}

function closedWriter(): Writable {
  const w = new Writable({ write: (_c, _e, cb) => cb() });
  w.end();
  return w;
}

/**
 * The agent's side of a durable command's stdin FIFO: bytes queue here and go to the guest through a `cat` exec,
 * started on demand and again after a pause ended the last one (bytes the killed `cat` had not yet written into the
 * FIFO are lost with it; those in the FIFO are the sandbox's). end(): the queue drains, `cat` ends, the holder goes.
 */
function fifoWriter(
  backend: Backend,
  sandbox: string,
  dirOf: () => string | undefined,
): { stream: Writable; kick: () => void; stop: () => void; pending: () => number } {
  const queue: Buffer[] = [];
  let queued = 0;
  let relay: ProcessHandle | undefined;
  let starting = false;
  let stopped = false;
  let closing: (() => void) | undefined;
  const pump = (): void => {
    const dir = dirOf();
    if (dir === undefined || starting || stopped) return;
    if (!relay) {
      if (queue.length === 0) {
        closing?.();
        return;
      }
      starting = true;
      backend.spawn(sandbox, { argv: ['/bin/sh', '-c', 'exec cat >"$1"', 'envd-in', `${dir}/in`], stdin: true }).then(
        (h) => {
          starting = false;
          if (stopped) {
            h.kill('SIGKILL');
            return;
          }
          relay = h;
          h.stdin.on('error', () => undefined);
          h.stdout.resume();
          h.stderr.resume();
          void h.wait().then(
            () => {
              if (relay === h) relay = undefined;
              if (closing) closing();
            },
            () => undefined,
          );
          pump();
        },
        () => {
          // Not running (paused): the bytes wait for the next write or close.
          starting = false;
        },
      );
      return;
    }
    for (const b of queue.splice(0)) relay.stdin.write(b);
    queued = 0;
    if (closing) relay.stdin.end();
  };
  const stream = new Writable({
    write(chunk: Buffer, _enc, cb) {
      queue.push(chunk);
      queued += chunk.length;
      pump();
      cb();
    },
    final(cb) {
      // Once in flight or done. A close the sandbox did not run to its end (paused meanwhile) is tried again at the
      // next kick (revive after the resume): otherwise the holder would keep the FIFO open and the command never see EOF.
      let done = false;
      closing = () => {
        const dir = dirOf();
        if (done || relay || dir === undefined) return;
        done = true;
        void backend
          .spawn(sandbox, { argv: ['/bin/sh', '-c', CLOSE_STDIN, 'envd-close', dir], stdin: false })
          .then((h) => h.wait())
          .then(
            (st) => {
              if (st.exitCode !== 0) done = false;
            },
            () => {
              done = false;
            },
          );
      };
      pump();
      cb();
    },
  });
  return {
    stream,
    kick: pump,
    pending: () => queued + (relay?.stdin.writableLength ?? 0),
    stop: () => {
      stopped = true;
      queue.length = 0;
      queued = 0;
      relay?.kill('SIGKILL');
    },
  };
}
