import { randomBytes } from 'node:crypto';
import { PassThrough, type Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { AppError } from '@fleet/agent-protocol';
import { guestPathNotFound, invalidSpec, type ProcessHandle, sandboxFailed, type SpawnOptions } from '../../backend.js';
import { guestRun, guestSpawn } from './guest-client.js';
import { envKeyRe } from '../spec-rules.js';
import type { QemuHost } from './vm-host.js';

/** Processes and files inside a VM, through the in-guest agent (the guest's own view: no host path is involved). */

export const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

export async function spawnInVm(qemu: QemuHost, name: string, opts: SpawnOptions): Promise<ProcessHandle> {
  const r = await qemu.running(name);
  if (!Array.isArray(opts.argv) || opts.argv.length === 0 || opts.argv.some((a) => typeof a !== 'string' || a.includes('\0'))) {
    throw invalidSpec('argv must be a non-empty list of strings without NUL bytes', [{ path: 'argv', message: 'invalid argv' }]);
  }
  const env: Record<string, string> = { PATH: DEFAULT_PATH, HOME: '/root', HOSTNAME: name, ...r.state.env, ...(opts.env ?? {}) };
  for (const [k, v] of Object.entries(env)) {
    if (!envKeyRe.test(k) || v.includes('\0')) {
      throw invalidSpec(`environment variable "${k}" is invalid`, [{ path: `env.${k}`, message: 'invalid name or value' }]);
    }
  }
  const cwd = opts.cwd ?? '/';
  if (!cwd.startsWith('/') || cwd.includes('\0'))
    throw invalidSpec('cwd must be an absolute guest path', [{ path: 'cwd', message: 'must start with /' }]);
  if (opts.tty && !('TERM' in env)) env.TERM = 'xterm-256color';
  try {
    return await guestSpawn(qemu.target(r.state), { ...opts, env, cwd });
  } catch (err) {
    throw sandboxFailed(`the in-guest agent of "${name}" did not answer: ${(err as Error).message}`, { vm: name }, err);
  }
}

export async function writeGuestFile(
  qemu: QemuHost,
  name: string,
  guestPath: string,
  data: Readable,
  opts: { mode?: number; maxBytes?: number; parents?: boolean } = {},
): Promise<{ path: string; bytes: number }> {
  const r = await qemu.running(name);
  checkGuestPath(guestPath);
  const mode = (opts.mode ?? 0o644) & 0o7777;
  const tmpName = `.fleet-upload-${randomBytes(6).toString('hex')}`;
  // Parent must exist (as for the process backend); temp file + rename inside the guest.
  const script = [
    'p="$1"; d=$(dirname "$p"); t="$d/$3"',
    ...(opts.parents ? ['mkdir -p "$d" || exit 3'] : []),
    '[ -d "$d" ] || exit 3',
    '[ -d "$p" ] && exit 4',
    'cat > "$t" || { rm -f "$t"; exit 5; }',
    'chmod "$2" "$t" && mv -f "$t" "$p" || { rm -f "$t"; exit 5; }',
  ].join('\n');
  const h = await spawnInVm(qemu, name, { argv: ['sh', '-c', script, 'sh', guestPath, mode.toString(8), tmpName], stdin: true });
  // Mutated by the counting transform.
  const seen = { bytes: 0, tooLarge: false };
  const errOut: Buffer[] = [];
  h.stderr.on('data', (d: Buffer) => errOut.push(d));
  h.stdout.resume();
  const counter = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      seen.bytes += chunk.length;
      if (opts.maxBytes !== undefined && seen.bytes > opts.maxBytes) {
        seen.tooLarge = true;
        cb(new Error('too large'));
        return;
      }
      cb(null, chunk);
    },
  });
  try {
    await pipeline(data, counter, h.stdin);
  } catch (err) {
    h.kill('SIGKILL');
    await h.wait();
    const dir = guestPath.slice(0, guestPath.lastIndexOf('/')) || '/';
    await guestRun(qemu.target(r.state), ['rm', '-f', `${dir}/${tmpName}`]).catch(() => undefined);
    if (seen.tooLarge) throw new AppError('PAYLOAD_TOO_LARGE', 413, `the file is larger than ${opts.maxBytes} bytes`, { path: guestPath });
    throw err;
  }
  const st = await h.wait();
  if (st.exitCode === 3) throw guestPathNotFound(guestPath.slice(0, guestPath.lastIndexOf('/')) || '/');
  if (st.exitCode === 4)
    throw new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${guestPath}" is a directory in the sandbox; give a file path`, {
      path: guestPath,
    });
  if (st.exitCode !== 0) {
    throw sandboxFailed(`writing "${guestPath}" in VM "${name}" failed: ${Buffer.concat(errOut).toString().trim().slice(0, 300)}`, {
      vm: name,
    });
  }
  return { path: guestPath, bytes: seen.bytes };
}

export async function readGuestFile(
  qemu: QemuHost,
  name: string,
  guestPath: string,
): Promise<{ path: string; size: number; stream: Readable; done: Promise<void> }> {
  await qemu.running(name);
  checkGuestPath(guestPath);
  // One process: the size line comes from the descriptor cat then reads, so the two agree unless the file changes under it.
  const script = '[ -e "$1" ] || exit 3; [ -f "$1" ] || exit 4; exec 3<"$1" || exit 5; stat -L -c %s "$1"; exec cat <&3';
  const h = await spawnInVm(qemu, name, { argv: ['sh', '-c', script, 'sh', guestPath], stdin: false });
  h.stderr.resume();
  let head: Buffer = Buffer.alloc(0);
  const size = await new Promise<number | null>((resolveSize) => {
    const onData = (d: Buffer): void => {
      head = Buffer.concat([head, d]);
      const nl = head.indexOf(10);
      if (nl < 0) return;
      h.stdout.off('data', onData);
      h.stdout.pause();
      const rest = head.subarray(nl + 1);
      if (rest.length) h.stdout.unshift(rest);
      resolveSize(Number(head.subarray(0, nl).toString()));
    };
    h.stdout.on('data', onData);
    void h.wait().then(() => resolveSize(null));
  });
  if (size === null || !Number.isSafeInteger(size)) {
    const st = await h.wait();
    if (st.exitCode === 3) throw guestPathNotFound(guestPath);
    if (st.exitCode === 4)
      throw new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${guestPath}" is not a regular file in the sandbox`, { path: guestPath });
    throw sandboxFailed(`reading "${guestPath}" in VM "${name}" failed (exit ${st.exitCode})`, { vm: name });
  }
  let left = size;
  const limit = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      const take = chunk.subarray(0, Math.max(0, left));
      left -= take.length;
      cb(null, take.length ? take : undefined);
    },
  });
  const stream = new PassThrough();
  const done = pipeline(h.stdout, limit, stream).then(async () => {
    const st = await h.wait();
    if (left > 0 || st.exitCode !== 0) throw sandboxFailed(`reading "${guestPath}" ended early (exit ${st.exitCode})`, { vm: name });
  });
  done.catch(() => undefined);
  return { path: guestPath, size, stream, done };
}

export function checkGuestPath(p: string): void {
  if (!p.startsWith('/') || p.includes('\0') || p.endsWith('/')) {
    throw invalidSpec(`"${p}" is not an absolute file path in the guest`, [{ path: 'path', message: 'must be an absolute file path' }]);
  }
}
