import { createHash, randomBytes } from 'node:crypto';
import { mkdir, open, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Worker } from 'node:worker_threads';
import {
  AGENT_API_PREFIX,
  artifactManifestSchema,
  errorBodySchema,
  type ArtifactManifest,
  type ArtifactMoved,
  type Checkpoint as WireCheckpoint,
} from '@fleet/agent-protocol';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import type { Backend, Checkpoint } from './backend.js';
import { chunkFile, patchFromBase } from './artifact-chunks.js';
import { eachLimited } from './backend/process/exec-util.js';

/** The checkpoint's rootfs archive; its sha256 is the checkpoint's digest (see backend.ts). */
export const ROOTFS_FILE = 'rootfs.tar';
const STAGING_PREFIX = 'pull-';

export const digestMismatch = (message: string, details?: Record<string, unknown>): AppError =>
  new AppError('ARTIFACT_DIGEST_MISMATCH', 422, message, details);
// 424: the source peer failed or refused; this host did nothing wrong.
export const transferFailed = (message: string, details?: Record<string, unknown>, cause?: unknown): AppError =>
  new AppError('ARTIFACT_TRANSFER_FAILED', 424, message, details, { cause });

export function toWireCheckpoint(cp: Checkpoint, vmName?: string): WireCheckpoint {
  return {
    id: cp.id,
    ...(vmName ? { vm_name: vmName } : {}),
    comment: cp.comment,
    size_bytes: cp.size_bytes,
    created_at: cp.created_at,
    digest: cp.digest,
    kind: cp.kind,
    image: cp.image,
    files: { ...cp.files },
    ...(cp.parent ? { parent: cp.parent } : {}),
    ...(cp.pause_ms !== undefined ? { pause_ms: cp.pause_ms } : {}),
  };
}

/** Every file a peer may fetch for this checkpoint, with size and sha256 (and, asked for, its chunks' sha256s). */
export async function buildManifest(backend: Backend, id: string, withChunks = false): Promise<ArtifactManifest> {
  const cp = await backend.getCheckpoint(id);
  const dir = await backend.checkpointDir(id);
  const files = [{ name: ROOTFS_FILE, sha256: cp.digest }, ...Object.entries(cp.files).map(([name, sha256]) => ({ name, sha256 }))];
  const sized = await Promise.all(
    files.map(async (f) => ({
      ...f,
      size_bytes: (await stat(join(dir, f.name))).size,
      ...(withChunks ? { chunks: await chunkFile(join(dir, f.name)) } : {}),
    })),
  );
  return { snapshot_id: id, digest: cp.digest, kind: cp.kind, rootfs_file: ROOTFS_FILE, files: sized, checkpoint: toWireCheckpoint(cp) };
}

/** The host path of one servable file, or CHECKPOINT_NOT_FOUND / 404 for a name not in the manifest. */
export async function servableFile(backend: Backend, id: string, file: string): Promise<string> {
  const cp = await backend.getCheckpoint(id);
  if (file !== ROOTFS_FILE && !(file in cp.files)) {
    throw new AppError('NOT_FOUND', 404, `checkpoint "${id}" has no file "${file}"`, { id, file });
  }
  return join(await backend.checkpointDir(id), file);
}

/** Parses a single `bytes=` range; null means "serve it all" (absent or unsupported header). */
export function parseRange(header: string | undefined, size: number): { start: number; end: number } | 'unsatisfiable' | null {
  if (!header) return null;
  const m = /^bytes=(\d*)-(\d*)$/.exec(header.trim());
  if (!m) return null;
  const [, a, b] = m as unknown as [string, string, string];
  let start: number;
  let end: number;
  if (a === '' && b === '') return null;
  if (a === '') {
    start = Math.max(0, size - Number(b));
    end = size - 1;
  } else {
    start = Number(a);
    end = b === '' ? size - 1 : Math.min(Number(b), size - 1);
  }
  if (start > end || start >= size) return 'unsatisfiable';
  return { start, end };
}

export interface PullRequest {
  snapshotId: string;
  sourceSnapshotId: string;
  digest: string;
  fromUrl: string;
  grant: string;
  files: Record<string, string>;
  timeoutMs: number;
  /** Staging directory names of pulls under way, so prune leaves them alone. */
  active: Set<string>;
  /** A checkpoint on this host whose files stand in for the wanted ones with the same sha256 (see reuseFromBase). */
  baseSnapshotId?: string | undefined;
}

/**
 * Pulls a checkpoint from a peer: fetch its manifest, stream each file into
 * a fresh staging directory hashing as it writes, check every size and
 * sha256 against the manifest AND against what the caller expects, write
 * manifest.json last, then let the backend rename the directory into the
 * checkpoint store. Any failure removes the staging directory, so a broken
 * or tampered transfer leaves nothing behind.
 */
export async function pullArtifact(backend: Backend, req: PullRequest): Promise<ArtifactMoved> {
  const existing = await backend.getCheckpoint(req.snapshotId).catch((err: unknown) => {
    if (err instanceof AppError && err.code === 'CHECKPOINT_NOT_FOUND') return undefined;
    throw err;
  });
  if (existing) {
    // A retried pull of the same bytes is a success, not a conflict.
    if (existing.digest === req.digest)
      return { snapshot_id: existing.id, size_bytes: existing.size_bytes + (await memBytes(backend, existing)), kind: existing.kind };
    throw new ConflictError('CHECKPOINT_EXISTS', `checkpoint "${req.snapshotId}" already exists on this host with another digest`, {
      id: req.snapshotId,
    });
  }

  const signal = AbortSignal.timeout(req.timeoutMs);
  const base = req.fromUrl.replace(/\/$/, '') + `${AGENT_API_PREFIX}/artifacts/${encodeURIComponent(req.sourceSnapshotId)}`;
  const headers = { authorization: `Bearer ${req.grant}` };
  const manifest = await fetchManifest(`${base}/manifest${req.baseSnapshotId ? '?chunks=1' : ''}`, headers, signal);

  if (manifest.digest !== req.digest) {
    throw digestMismatch(`the peer's checkpoint "${req.sourceSnapshotId}" has digest ${manifest.digest}, not the expected ${req.digest}`, {
      expected: req.digest,
      actual: manifest.digest,
    });
  }
  const byName = new Map(manifest.files.map((f) => [f.name, f]));
  const rootfs = byName.get(manifest.rootfs_file);
  if (manifest.rootfs_file !== ROOTFS_FILE || !rootfs || rootfs.sha256 !== req.digest) {
    throw digestMismatch(`the peer's manifest does not list ${ROOTFS_FILE} with the expected digest`, { expected: req.digest });
  }
  for (const [name, sha] of Object.entries(req.files)) {
    const f = byName.get(name);
    if (!f || f.sha256 !== sha)
      throw digestMismatch(`the peer's manifest lists file "${name}" ${f ? `with sha256 ${f.sha256}` : 'not at all'}, expected ${sha}`, {
        file: name,
      });
  }
  // Only the rootfs and the memory files the checkpoint itself declares travel; nothing else lands here.
  const wanted = manifest.files.filter((f) => f.name === ROOTFS_FILE || f.name in manifest.checkpoint.files);
  for (const f of wanted) {
    if (f.name !== ROOTFS_FILE && manifest.checkpoint.files[f.name] !== f.sha256)
      throw digestMismatch(`the peer's manifest disagrees with itself on "${f.name}"`, { file: f.name });
  }

  const stagingName = `${STAGING_PREFIX}${req.snapshotId}-${randomBytes(6).toString('hex')}`;
  const staging = join(backend.stagingDir(), stagingName);
  req.active.add(stagingName);
  try {
    await mkdir(staging, { recursive: true, mode: 0o700 });
    let total = 0;
    const local = req.baseSnapshotId ? await localCopy(backend, req.baseSnapshotId) : undefined;
    const reused = local ? await reuseFromBase(local, wanted, staging) : new Set<string>();
    let reusedBytes = 0;
    for (const f of wanted) if (reused.has(f.name)) reusedBytes += f.size_bytes;
    // A file of the same name in the local copy (the layer, a memory image): only its changed slices are fetched.
    if (local) {
      for (const f of wanted) {
        if (reused.has(f.name) || !local.names.has(f.name)) continue;
        const fetched = await patchFromBase(
          join(local.dir, f.name),
          f,
          `${base}/files/${encodeURIComponent(f.name)}`,
          headers,
          signal,
          join(staging, f.name),
        );
        if (fetched === undefined) continue;
        reused.add(f.name);
        total += fetched;
        reusedBytes += f.size_bytes - fetched;
      }
    }
    // A live checkpoint is a few dozen CRIU image files: fetched four at a time, a move is not a row of round trips.
    const queue = wanted.filter((f) => !reused.has(f.name));
    const fetchOne = async (f: (typeof wanted)[number]): Promise<void> => {
      const url = `${base}/files/${encodeURIComponent(f.name)}`;
      const got =
        f.size_bytes <= SMALL_FILE
          ? await fetchSmallFile(url, headers, signal, join(staging, f.name), f.size_bytes)
          : await fetchFile(url, headers, signal, join(staging, f.name));
      if (got.size !== f.size_bytes) {
        throw transferFailed(`file "${f.name}" from the peer was ${got.size} bytes, its manifest says ${f.size_bytes}`, { file: f.name });
      }
      if (got.sha256 !== f.sha256) {
        throw digestMismatch(`file "${f.name}" from the peer hashes to ${got.sha256}, expected ${f.sha256}; nothing was kept`, {
          file: f.name,
          expected: f.sha256,
          actual: got.sha256,
        });
      }
      total += got.size;
    };
    // Every fetch started has ended before a failure reaches the cleanup below, which removes their directory.
    await eachLimited(queue, 4, fetchOne);
    const cp = manifest.checkpoint;
    const kind = cp.kind === 'live' && Object.keys(cp.files).length > 0 ? 'live' : 'disk';
    await writeFile(
      join(staging, 'manifest.json'),
      JSON.stringify({
        id: req.snapshotId,
        comment: cp.comment,
        kind,
        size_bytes: rootfs.size_bytes,
        digest: req.digest,
        created_at: cp.created_at,
        image: cp.image,
        files: kind === 'live' ? cp.files : {},
        parent: cp.parent ?? '',
      }),
    );
    // Every byte was hashed on its way to disk above; a backend that can skip re-reading 1 GiB to check it again may.
    let committed: Checkpoint;
    try {
      committed = await backend.importCheckpoint(staging, { verifyDigest: false });
    } catch (err) {
      // A concurrent pull of the same bytes won the rename: same outcome, not a conflict.
      if (err instanceof AppError && err.code === 'CHECKPOINT_EXISTS') {
        const winner = await backend.getCheckpoint(req.snapshotId).catch(() => undefined);
        if (winner?.digest === req.digest)
          return { snapshot_id: winner.id, size_bytes: total, kind: winner.kind, reused_bytes: reusedBytes };
      }
      throw err;
    }
    return { snapshot_id: committed.id, size_bytes: total, kind: committed.kind, reused_bytes: reusedBytes };
  } catch (err) {
    await rm(staging, { recursive: true, force: true }).catch(() => {});
    throw err;
  } finally {
    req.active.delete(stagingName);
  }
}

/**
 * Copies into the staging directory every wanted file that the base
 * checkpoint on this host holds with the same sha256 (under any name), and
 * answers their names: those need not cross the network. Each copy is hashed
 * again as it is read, so a base whose file changed on disk since it was
 * verified is simply not used for it (the file is fetched instead).
 */
interface LocalCopy {
  readonly dir: string;
  readonly names: ReadonlySet<string>;
  readonly bySha: ReadonlyMap<string, string>;
}

async function localCopy(backend: Backend, id: string): Promise<LocalCopy | undefined> {
  const base = await backend.getCheckpoint(id).catch(() => undefined);
  if (!base) return undefined;
  const bySha = new Map<string, string>([[base.digest, ROOTFS_FILE]]);
  for (const [name, sha] of Object.entries(base.files)) bySha.set(sha, name);
  return { dir: await backend.checkpointDir(id), names: new Set([ROOTFS_FILE, ...Object.keys(base.files)]), bySha };
}

async function reuseFromBase(
  base: LocalCopy,
  wanted: ReadonlyArray<{ name: string; sha256: string; size_bytes: number }>,
  staging: string,
): Promise<Set<string>> {
  const out = new Set<string>();
  for (const f of wanted) {
    const local = base.bySha.get(f.sha256);
    if (local === undefined) continue;
    const dest = join(staging, f.name);
    const got = await copyHashed(join(base.dir, local), dest).catch(() => undefined);
    if (got && got.size === f.size_bytes && got.sha256 === f.sha256) out.add(f.name);
    else await rm(dest, { force: true });
  }
  return out;
}

async function copyHashed(from: string, to: string): Promise<{ size: number; sha256: string }> {
  const hash = createHash('sha256');
  let size = 0;
  const src = await open(from, 'r');
  const dst = await open(to, 'wx', 0o600);
  try {
    const buf = Buffer.allocUnsafe(1024 * 1024);
    for (;;) {
      const { bytesRead } = await src.read(buf, 0, buf.length, null);
      if (bytesRead === 0) break;
      const chunk = buf.subarray(0, bytesRead);
      hash.update(chunk);
      for (let off = 0; off < bytesRead;) off += (await dst.write(chunk, off, bytesRead - off)).bytesWritten;
      size += bytesRead;
    }
  } finally {
    await src.close();
    await dst.close();
  }
  return { size, sha256: hash.digest('hex') };
}

async function memBytes(backend: Backend, cp: Checkpoint): Promise<number> {
  const dir = await backend.checkpointDir(cp.id);
  let n = 0;
  for (const name of Object.keys(cp.files)) n += (await stat(join(dir, name)).catch(() => ({ size: 0 }))).size;
  return n;
}

async function peerFetch(url: string, headers: Record<string, string>, signal: AbortSignal): Promise<Response> {
  let res: Response;
  try {
    res = await fetch(url, { headers, signal });
  } catch (err) {
    throw transferFailed(`could not reach the peer: ${describe(err)}`, { peer_url: new URL(url).origin }, err);
  }
  if (!res.ok) {
    let code: string | undefined;
    let message = `HTTP ${res.status}`;
    try {
      const body = errorBodySchema.safeParse(await res.json());
      if (body.success) {
        code = body.data.code;
        message = body.data.message;
      }
    } catch {
      /* the status says enough */
    }
    throw transferFailed(`the peer refused: ${code ? `${code}: ` : ''}${message}`, {
      peer_status: res.status,
      ...(code ? { peer_code: code } : {}),
    });
  }
  return res;
}

/**
 * At most this size a file is fetched on the agent's own thread: starting a receiver thread (below) costs tens of
 * milliseconds, more than such a copy, and a live checkpoint is a few dozen small CRIU images besides its pages (a
 * 0.4 MB move took 1.3 s of a live migrate's downtime, one thread per file).
 */
const SMALL_FILE = 1 << 20;

async function fetchSmallFile(
  url: string,
  headers: Record<string, string>,
  signal: AbortSignal,
  dest: string,
  expected: number,
): Promise<{ size: number; sha256: string }> {
  const res = await peerFetch(url, headers, signal);
  const hash = createHash('sha256');
  const chunks: Uint8Array[] = [];
  let size = 0;
  try {
    if (res.body) {
      for await (const chunk of res.body as AsyncIterable<Uint8Array>) {
        size += chunk.length;
        // More than the manifest says is cut off as it comes (the caller refuses the size), not held in memory.
        if (size > expected) break;
        hash.update(chunk);
        chunks.push(chunk);
      }
    }
  } catch (err) {
    throw transferFailed(`the transfer broke off after ${size} bytes: ${describe(err)}`, { received_bytes: size }, err);
  }
  await writeFile(dest, Buffer.concat(chunks), { flag: 'wx', mode: 0o600 });
  return { size, sha256: hash.digest('hex') };
}

async function fetchManifest(url: string, headers: Record<string, string>, signal: AbortSignal): Promise<ArtifactManifest> {
  const res = await peerFetch(url, headers, signal);
  let json: unknown;
  try {
    json = await res.json();
  } catch (err) {
    throw transferFailed(`the peer's manifest is not JSON: ${describe(err)}`, {}, err);
  }
  const parsed = artifactManifestSchema.safeParse(json);
  if (!parsed.success) throw transferFailed(`the peer's manifest is malformed: ${parsed.error.issues[0]?.message ?? 'invalid'}`);
  return parsed.data;
}

/**
 * The bulk bytes are received, hashed and written by a worker thread: on the
 * agent's own thread, Node's HTTP receive path, the sha256 and the threadpool
 * round trip of each async write took turns on one core (42-63% of a plain
 * copy). In the worker each chunk is hashed and written synchronously as it
 * arrives (the worker has nothing else to do), and the agent's event loop
 * stays free. Plain JS evaluated as CommonJS, so it runs the same under tsx
 * and from the build. The file descriptor is the caller's: a worker that is
 * terminated (timeout) leaks nothing.
 */
const RECEIVER_SOURCE = `
const { workerData, parentPort } = require('node:worker_threads');
const { createHash } = require('node:crypto');
const { writeSync } = require('node:fs');
const { url, headers, fd } = workerData;
const get = url.startsWith('https:') ? require('node:https').get : require('node:http').get;
let size = 0;
const fail = (message, code) => parentPort.postMessage({ kind: 'broken', size, message, code });
const req = get(url, { headers }, (res) => {
  const status = res.statusCode || 0;
  if (status < 200 || status >= 300) {
    const chunks = [];
    let n = 0;
    res.on('data', (c) => { if (n < 65536) { chunks.push(c); n += c.length; } });
    const done = () => parentPort.postMessage({ kind: 'status', status, body: Buffer.concat(chunks).toString('utf8') });
    res.on('end', done);
    res.on('error', done);
    return;
  }
  const hash = createHash('sha256');
  res.on('data', (chunk) => {
    hash.update(chunk);
    for (let off = 0; off < chunk.length; ) off += writeSync(fd, chunk, off, chunk.length - off);
    size += chunk.length;
  });
  res.on('error', (err) => fail(err.message, err.code));
  res.on('aborted', () => fail('the peer closed the connection early'));
  res.on('end', () => {
    if (!res.complete) return fail('the peer closed the connection early');
    parentPort.postMessage({ kind: 'done', size, sha256: hash.digest('hex') });
  });
});
req.on('error', (err) => parentPort.postMessage({ kind: 'unreachable', message: err.message, code: err.code }));
`;

type ReceiverResult =
  | { kind: 'done'; size: number; sha256: string }
  | { kind: 'status'; status: number; body: string }
  | { kind: 'broken'; size: number; message: string; code?: string }
  | { kind: 'unreachable'; message: string; code?: string };

function receive(url: string, headers: Record<string, string>, fd: number, signal: AbortSignal): Promise<ReceiverResult> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(signal.reason as Error);
      return;
    }
    const worker = new Worker(RECEIVER_SOURCE, { eval: true, workerData: { url, headers, fd } });
    let settled = false;
    const settle = (fn: () => void): void => {
      if (settled) return;
      settled = true;
      signal.removeEventListener('abort', onAbort);
      fn();
      void worker.terminate();
    };
    const onAbort = (): void => settle(() => reject(signal.reason as Error));
    signal.addEventListener('abort', onAbort, { once: true });
    worker.once('message', (m: ReceiverResult) => settle(() => resolve(m)));
    worker.once('error', (err) => settle(() => reject(err)));
    worker.once('exit', (code) => settle(() => reject(new Error(`the receiver thread exited (${code}) before the transfer finished`))));
  });
}

export async function fetchFile(
  url: string,
  headers: Record<string, string>,
  signal: AbortSignal,
  dest: string,
): Promise<{ size: number; sha256: string }> {
  const fh = await open(dest, 'wx', 0o600);
  let r: ReceiverResult;
  try {
    r = await receive(url, headers, fh.fd, signal);
  } catch (err) {
    throw transferFailed(`the transfer broke off: ${describe(err)}`, {}, err);
  } finally {
    await fh.close();
  }
  switch (r.kind) {
    case 'done':
      return { size: r.size, sha256: r.sha256 };
    case 'unreachable':
      throw transferFailed(`could not reach the peer: ${r.code ?? r.message}`, { peer_url: new URL(url).origin });
    case 'broken':
      // A peer that dies mid-body can end the response "cleanly" on some paths: the caller's length check catches it too.
      throw transferFailed(`the transfer broke off after ${r.size} bytes: ${r.code ?? r.message}`, { received_bytes: r.size });
    case 'status': {
      let code: string | undefined;
      let message = `HTTP ${r.status}`;
      try {
        const body = errorBodySchema.safeParse(JSON.parse(r.body));
        if (body.success) ({ code, message } = body.data);
      } catch {
        /* not JSON */
      }
      throw transferFailed(`the peer refused: ${code ? `${code}: ` : ''}${message}`, {
        peer_status: r.status,
        ...(code ? { peer_code: code } : {}),
      });
    }
  }
}

function describe(err: unknown): string {
  const e = err as { name?: string; message?: string; cause?: { code?: string; message?: string } } | null | undefined;
  if (e?.name === 'TimeoutError') return 'timed out';
  return e?.cause?.code ?? e?.cause?.message ?? e?.message ?? String(err);
}

/** Staging directories of pulls that died with a crashed agent. */
export async function pruneStaging(backend: Backend, active: ReadonlySet<string>): Promise<string[]> {
  const dir = backend.stagingDir();
  const out: string[] = [];
  let names: string[];
  try {
    names = await readdir(dir);
  } catch {
    return out;
  }
  for (const name of names) {
    if (!name.startsWith(STAGING_PREFIX) || active.has(name)) continue;
    await rm(join(dir, name), { recursive: true, force: true });
    out.push(`staging ${name}`);
  }
  return out;
}
