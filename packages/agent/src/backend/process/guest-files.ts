import { randomBytes } from 'node:crypto';
import { Transform, type Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { AppError } from '@fleet/agent-protocol';
import { invalidSpec, sandboxFailed, type ProcessHandle } from '../../backend.js';
import { enterSandbox } from './guest-exec.js';
import { resolveInRoot } from './guest-path.js';
import { spawnPiped } from './guest-process.js';
import type { SandboxHost } from './sandbox-host.js';

/** The helper's `enter` for a file op, forked by the exec spawner when it is up (as execs are), else spawned. */
function spawnHelper(host: SandboxHost, argv: string[], stdin: boolean): ProcessHandle {
  return host.spawner?.ready ? host.spawner.spawn(argv.slice(1), {}, stdin) : spawnPiped(argv, {}, stdin);
}

export async function resolveGuestPath(host: SandboxHost, name: string, guestPath: string, opts: { forWrite: boolean }): Promise<string> {
  const record = host.must(name);
  await host.assertRunning(record);
  const { hostPath } = await resolveInRoot(`/proc/${record.state.init_pid}/root`, guestPath, opts);
  return hostPath;
}

export async function writeGuestFile(
  host: SandboxHost,
  name: string,
  guestPath: string,
  data: Readable,
  opts: { mode?: number; maxBytes?: number; parents?: boolean } = {},
): Promise<{ path: string; bytes: number }> {
  const record = host.must(name);
  await host.assertRunning(record);
  const resolved = await resolveInRoot(`/proc/${record.state.init_pid}/root`, guestPath, {
    forWrite: true,
    ...(opts.parents ? { parents: true } : {}),
  });
  const mode = (opts.mode ?? 0o644).toString(8);
  if (!/^[0-7]{1,4}$/.test(mode))
    throw invalidSpec(`file mode ${mode} is invalid: use octal permission bits`, [{ path: 'mode', message: 'invalid mode' }]);
  // Done by the helper inside the sandbox, as its root: the rename happens in the guest's view of its root.
  const tmp = `${resolved.guestPath}.upload-${randomBytes(6).toString('hex')}`;
  const h = spawnHelper(
    host,
    await enterSandbox(host, record, { op: 'put', path: resolved.guestPath, mode, tmp, ...(opts.parents ? { parents: true } : {}) }),
    true,
  );
  let bytes = 0;
  // Set inside the transform below, read after the pipeline: a field, so the compiler does not narrow it to false.
  const over = { tooLarge: false };
  let stderr = '';
  h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
  h.stdout.resume();
  const counter = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      bytes += chunk.length;
      if (opts.maxBytes !== undefined && bytes > opts.maxBytes) {
        over.tooLarge = true;
        // Killed before its stdin closes: an end of input would commit the partial file.
        h.kill('SIGKILL');
        cb(new Error('too large'));
      } else cb(null, chunk);
    },
  });
  // A cut transfer must not look finished: the writer is killed before the pipe closes, as its EOF would commit the partial file.
  const killNow = (): void => h.kill('SIGKILL');
  data.once('aborted', killNow);
  data.once('error', killNow);
  let pipeErr: unknown;
  try {
    await pipeline(data, counter, h.stdin);
  } catch (err) {
    pipeErr = err;
    // Killing the group leaves the temp file: remove it from inside below.
    h.kill('SIGKILL');
  }
  const st = await h.wait();
  if (over.tooLarge || pipeErr !== undefined || st.exitCode !== 0) {
    if (pipeErr !== undefined) {
      await enterSandbox(host, record, { op: 'unlink', path: tmp })
        .then((argv) => {
          const c = spawnHelper(host, argv, false);
          c.stdout.resume();
          c.stderr.resume();
          return c.wait();
        })
        .catch(() => undefined);
    }
    if (over.tooLarge)
      throw new AppError('PAYLOAD_TOO_LARGE', 413, `the file is larger than ${opts.maxBytes} bytes`, { path: resolved.guestPath });
    if (st.exitCode === 21)
      throw new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${resolved.guestPath}" is a directory in the sandbox; give a file path`, {
        path: resolved.guestPath,
      });
    if (pipeErr !== undefined)
      throw pipeErr instanceof AppError
        ? pipeErr
        : sandboxFailed(`writing "${resolved.guestPath}" failed: ${(pipeErr as Error).message}`, { path: resolved.guestPath }, pipeErr);
    throw sandboxFailed(`writing "${resolved.guestPath}" in the sandbox failed: ${stderr.trim().slice(0, 300) || `exit ${st.exitCode}`}`, {
      path: resolved.guestPath,
    });
  }
  return { path: resolved.guestPath, bytes };
}

export async function readGuestFile(
  host: SandboxHost,
  name: string,
  guestPath: string,
): Promise<{ path: string; size: number; stream: Readable; done: Promise<void> }> {
  const record = host.must(name);
  await host.assertRunning(record);
  const resolved = await resolveInRoot(`/proc/${record.state.init_pid}/root`, guestPath, { forWrite: false });
  // First line: the size, from the same process that then streams the bytes.
  const h = spawnHelper(host, await enterSandbox(host, record, { op: 'get', path: resolved.guestPath }), false);
  let stderr = '';
  h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
  const size = await new Promise<number>((resolve, reject) => {
    let head = Buffer.alloc(0);
    const onData = (chunk: Buffer): void => {
      head = Buffer.concat([head, chunk]);
      const nl = head.indexOf(10);
      if (nl < 0) return;
      h.stdout.off('data', onData);
      h.stdout.pause();
      const rest = head.subarray(nl + 1);
      if (rest.length > 0) h.stdout.unshift(rest);
      resolve(Number(head.subarray(0, nl).toString()));
    };
    h.stdout.on('data', onData);
    h.wait().then((st) => {
      if (st.exitCode === 21)
        reject(
          new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${resolved.guestPath}" is not a regular file in the sandbox`, {
            path: resolved.guestPath,
          }),
        );
      else
        reject(
          sandboxFailed(`reading "${resolved.guestPath}" failed: ${stderr.trim().slice(0, 300) || `exit ${st.exitCode}`}`, {
            path: resolved.guestPath,
          }),
        );
    }, reject);
  });
  const done = h.wait().then((st) => {
    if (st.exitCode !== 0)
      throw sandboxFailed(`reading "${resolved.guestPath}" failed part-way: ${stderr.trim().slice(0, 300) || `exit ${st.exitCode}`}`, {
        path: resolved.guestPath,
      });
  });
  done.catch(() => undefined);
  return { path: resolved.guestPath, size, stream: h.stdout, done };
}
