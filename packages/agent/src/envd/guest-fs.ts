import { posix } from 'node:path';
import { Code, ConnectError } from '@connectrpc/connect';
import type { Backend } from '../backend.js';

/**
 * Filesystem operations for envd, run INSIDE the sandbox by its own /bin/sh
 * and tools (busybox or coreutils), with every path passed as an argument,
 * never spliced into the script. Done on host paths through
 * /proc/<pid>/root instead, a guest racing a symlink swap could point a
 * host-side stat, rename or rm at the host's own files. Whatever the guest
 * prints is untrusted: it is parsed with bounds and can only mislead its
 * own tenant.
 *
 * One entry is three NUL-terminated fields: `stat -c` output (%y first, so
 * the name-free fields have fixed positions), the path, the symlink target.
 * Paths cannot hold NUL, so names with newlines or spaces survive.
 */
const SCRIPT = `
ENT='for p; do s=$(stat -c "%y %f %s %a %U %G" -- "$p" 2>/dev/null) || continue; t=; [ -L "$p" ] && t=$(readlink -- "$p"); printf "%s\\0%s\\0%s\\0" "$s" "$p" "$t"; done'
exists() { [ -e "$1" ] || [ -L "$1" ]; }
op=$1; shift
case $op in
  stat) exists "$1" || exit 2; sh -c "$ENT" ent "$1" ;;
  list) exists "$1" || exit 2; [ -d "$1" ] || exit 3; d=$1; [ -L "$d" ] && d="$d/"
        if [ "$2" = 0 ]; then find "$d" -mindepth 1 -exec sh -c "$ENT" ent {} +
        else find "$d" -mindepth 1 -maxdepth "$2" -exec sh -c "$ENT" ent {} +; fi ;;
  mkdir) exists "$1" && exit 17; mkdir -p -- "$1" || exit 1; sh -c "$ENT" ent "$1" ;;
  move) exists "$1" || exit 2; mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2" || exit 1; sh -c "$ENT" ent "$2" ;;
  remove) rm -rf -- "$1" ;;
  parent) [ -d "$1" ] && exit 21; mkdir -p -- "$(dirname -- "$1")" ;;
  *) exit 64 ;;
esac
`;

const OUTPUT_CAP = 64 * 1024 * 1024;
const RUN_TIMEOUT_MS = 60_000;

export type GuestFileType = 'file' | 'dir' | 'symlink' | 'other';

export interface GuestEntry {
  readonly name: string;
  readonly path: string;
  readonly type: GuestFileType;
  readonly size: bigint;
  /** Permission bits (0o7777). */
  readonly mode: number;
  /** Go's FileMode.String(), as envd answers: "-rw-r--r--", "drwxr-xr-x", "Lrwxrwxrwx". */
  readonly permissions: string;
  readonly owner: string;
  readonly group: string;
  readonly mtime: { readonly seconds: bigint; readonly nanos: number };
  readonly symlinkTarget?: string;
  /** Changes whenever content or metadata visibly changed: what watches compare. */
  readonly stamp: string;
}

/** The home directory every relative envd path is resolved against: envd runs as the guest's root. */
export const ENVD_HOME = '/root';

export function absoluteGuestPath(path: string): string {
  if (path.includes('\0')) throw new ConnectError('path must not contain NUL', Code.InvalidArgument);
  const expanded = path === '~' ? ENVD_HOME : path.startsWith('~/') ? `${ENVD_HOME}/${path.slice(2)}` : path;
  return posix.resolve(ENVD_HOME, expanded);
}

interface RunResult {
  readonly code: number;
  readonly stdout: Buffer;
  readonly stderr: string;
}

async function run(backend: Backend, sandbox: string, args: string[], signal?: AbortSignal): Promise<RunResult> {
  const h = await backend.spawn(sandbox, { argv: ['/bin/sh', '-c', SCRIPT, 'envd-fs', ...args], stdin: false });
  const out: Buffer[] = [];
  let size = 0;
  let stderr = '';
  const cut = { overflow: false };
  h.stdout.on('data', (c: Buffer) => {
    size += c.length;
    if (size > OUTPUT_CAP) {
      cut.overflow = true;
      h.kill('SIGKILL');
    } else out.push(c);
  });
  h.stderr.on('data', (c: Buffer) => {
    if (stderr.length < 4096) stderr += c.toString('utf8');
  });
  const timer = setTimeout(() => h.kill('SIGKILL'), RUN_TIMEOUT_MS);
  const onAbort = (): void => h.kill('SIGKILL');
  signal?.addEventListener('abort', onAbort, { once: true });
  try {
    const st = await h.wait();
    if (cut.overflow) throw new ConnectError(`the listing is larger than ${OUTPUT_CAP} bytes: ask for less depth`, Code.ResourceExhausted);
    return { code: st.exitCode ?? 128, stdout: Buffer.concat(out), stderr: stderr.trim().slice(0, 500) };
  } finally {
    clearTimeout(timer);
    signal?.removeEventListener('abort', onAbort);
  }
}

function fail(r: RunResult, path: string, what: string): never {
  switch (r.code) {
    case 2:
      throw new ConnectError(`path '${path}' does not exist`, Code.NotFound);
    case 3:
      throw new ConnectError(`path '${path}' is not a directory`, Code.InvalidArgument);
    case 17:
      throw new ConnectError(`path '${path}' already exists`, Code.AlreadyExists);
    case 21:
      throw new ConnectError(`path '${path}' is a directory`, Code.InvalidArgument);
    default:
      throw new ConnectError(`${what} '${path}' failed: ${r.stderr || `exit ${r.code}`}`, Code.Internal);
  }
}

const S_IFMT = 0o170000;

function typeOf(raw: number): GuestFileType {
  switch (raw & S_IFMT) {
    case 0o100000:
      return 'file';
    case 0o040000:
      return 'dir';
    case 0o120000:
      return 'symlink';
    default:
      return 'other';
  }
}

function goModeString(raw: number): string {
  const t = typeOf(raw);
  const lead = t === 'dir' ? 'd' : t === 'symlink' ? 'L' : t === 'file' ? '-' : '?';
  const rwx = 'rwxrwxrwx';
  let s = lead;
  for (let i = 0; i < 9; i++) s += raw & (1 << (8 - i)) ? rwx.charAt(i) : '-';
  return s;
}

/** "2026-12-03 09:36:45.181969528 +0000" → seconds and nanos; the epoch when unreadable. */
function parseTime(date: string, time: string, tz: string): { seconds: bigint; nanos: number } {
  const [hms, frac = ''] = time.split('.');
  const offset = /^[+-]\d{4}$/.test(tz) ? `${tz.slice(0, 3)}:${tz.slice(3)}` : 'Z';
  const ms = Date.parse(`${date}T${hms ?? ''}${offset}`);
  if (!Number.isFinite(ms)) return { seconds: 0n, nanos: 0 };
  const nanos = /^\d{1,9}$/.test(frac) ? Number(frac.padEnd(9, '0')) : 0;
  return { seconds: BigInt(Math.floor(ms / 1000)), nanos };
}

export function parseEntries(out: Buffer): GuestEntry[] {
  const fields = out.toString('utf8').split('\0');
  const entries: GuestEntry[] = [];
  for (let i = 0; i + 2 < fields.length; i += 3) {
    const statLine = fields[i] ?? '';
    // A listed symlinked directory yields "link//name": shown as the guest would write it.
    const path = posix.normalize(fields[i + 1] ?? '');
    const target = fields[i + 2] ?? '';
    const t = statLine.split(' ');
    if (t.length < 8 || path === '.') continue;
    const raw = parseInt(t[3] ?? '', 16);
    const sizeField = t[4] ?? '';
    const size = /^\d+$/.test(sizeField) ? BigInt(sizeField) : 0n;
    if (!Number.isFinite(raw)) continue;
    const type = typeOf(raw);
    entries.push({
      name: posix.basename(path),
      path,
      type,
      size,
      mode: raw & 0o7777,
      permissions: goModeString(raw),
      owner: t[6] ?? '',
      group: t.slice(7).join(' '),
      mtime: parseTime(t[0] ?? '', t[1] ?? '', t[2] ?? ''),
      ...(type === 'symlink' ? { symlinkTarget: target } : {}),
      stamp: `${t[0]} ${t[1]} ${t[3]} ${t[4]} ${t[6]} ${t.slice(7).join(' ')}`,
    });
  }
  return entries;
}

export class GuestFs {
  constructor(private readonly backend: Backend) {}

  async stat(sandbox: string, path: string): Promise<GuestEntry> {
    const r = await run(this.backend, sandbox, ['stat', path]);
    if (r.code !== 0) fail(r, path, 'stat');
    const [entry] = parseEntries(r.stdout);
    if (!entry) throw new ConnectError(`path '${path}' does not exist`, Code.NotFound);
    return entry;
  }

  /** depth 0: the whole tree. */
  async list(sandbox: string, path: string, depth: number, signal?: AbortSignal): Promise<GuestEntry[]> {
    const r = await run(this.backend, sandbox, ['list', path, String(depth)], signal);
    if (r.code !== 0) fail(r, path, 'list');
    return parseEntries(r.stdout);
  }

  async makeDir(sandbox: string, path: string): Promise<GuestEntry> {
    const r = await run(this.backend, sandbox, ['mkdir', path]);
    if (r.code !== 0) fail(r, path, 'mkdir');
    const [entry] = parseEntries(r.stdout);
    if (!entry) throw new ConnectError(`mkdir '${path}' left no directory`, Code.Internal);
    return entry;
  }

  async move(sandbox: string, source: string, destination: string): Promise<GuestEntry> {
    const r = await run(this.backend, sandbox, ['move', source, destination]);
    if (r.code !== 0) fail(r, source, 'move');
    const [entry] = parseEntries(r.stdout);
    if (!entry) throw new ConnectError(`move to '${destination}' left nothing there`, Code.Internal);
    return entry;
  }

  async remove(sandbox: string, path: string): Promise<void> {
    const r = await run(this.backend, sandbox, ['remove', path]);
    if (r.code !== 0) fail(r, path, 'remove');
  }

  /** Creates the parent directories of a file about to be written; a directory at `path` is refused. */
  async prepareFile(sandbox: string, path: string): Promise<void> {
    const r = await run(this.backend, sandbox, ['parent', path]);
    if (r.code !== 0) fail(r, path, 'create parent of');
  }
}
