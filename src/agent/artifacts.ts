import { createHash, randomBytes } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import { get as httpGet, type IncomingMessage } from 'node:http';
import { get as httpsGet } from 'node:https';
import { mkdir, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import {
  AGENT_API_PREFIX,
  artifactManifestSchema,
  errorBodySchema,
  type ArtifactManifest,
  type ArtifactMoved,
  type Checkpoint as WireCheckpoint,
} from '../domain/agent-protocol.js';
import { AppError, ConflictError } from '../domain/errors.js';
import type { Backend, Checkpoint } from './backend.js';

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
  };
}

/** Every file a peer may fetch for this checkpoint, with size and sha256. */
export async function buildManifest(backend: Backend, id: string): Promise<ArtifactManifest> {
  const cp = await backend.getCheckpoint(id);
  const dir = await backend.checkpointDir(id);
  const files = [{ name: ROOTFS_FILE, sha256: cp.digest }, ...Object.entries(cp.files).map(([name, sha256]) => ({ name, sha256 }))];
  const sized = await Promise.all(files.map(async (f) => ({ ...f, size_bytes: (await stat(join(dir, f.name))).size })));
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
    if (existing.digest === req.digest) return { snapshot_id: existing.id, size_bytes: existing.size_bytes + (await memBytes(backend, existing)), kind: existing.kind };
    throw new ConflictError('CHECKPOINT_EXISTS', `checkpoint "${req.snapshotId}" already exists on this host with another digest`, { id: req.snapshotId });
  }

  const signal = AbortSignal.timeout(req.timeoutMs);
  const base = req.fromUrl.replace(/\/$/, '') + `${AGENT_API_PREFIX}/artifacts/${encodeURIComponent(req.sourceSnapshotId)}`;
  const headers = { authorization: `Bearer ${req.grant}` };
  const manifest = await fetchManifest(`${base}/manifest`, headers, signal);

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
    if (!f || f.sha256 !== sha) throw digestMismatch(`the peer's manifest lists file "${name}" ${f ? `with sha256 ${f.sha256}` : 'not at all'}, expected ${sha}`, { file: name });
  }
  // Only the rootfs and the memory files the checkpoint itself declares travel; nothing else lands here.
  const wanted = manifest.files.filter((f) => f.name === ROOTFS_FILE || f.name in manifest.checkpoint.files);
  for (const f of wanted) {
    if (f.name !== ROOTFS_FILE && manifest.checkpoint.files[f.name] !== f.sha256) throw digestMismatch(`the peer's manifest disagrees with itself on "${f.name}"`, { file: f.name });
  }

  const stagingName = `${STAGING_PREFIX}${req.snapshotId}-${randomBytes(6).toString('hex')}`;
  const staging = join(backend.stagingDir(), stagingName);
  req.active.add(stagingName);
  try {
    await mkdir(staging, { recursive: true, mode: 0o700 });
    let total = 0;
    for (const f of wanted) {
      const got = await fetchFile(`${base}/files/${encodeURIComponent(f.name)}`, headers, signal, join(staging, f.name));
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
    }
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
    const importCheckpoint = backend.importCheckpoint.bind(backend) as (path: string, opts?: { verifyDigest?: boolean }) => Promise<Checkpoint>;
    let committed: Checkpoint;
    try {
      committed = await importCheckpoint(staging, { verifyDigest: false });
    } catch (err) {
      // A concurrent pull of the same bytes won the rename: same outcome, not a conflict.
      if (err instanceof AppError && err.code === 'CHECKPOINT_EXISTS') {
        const winner = await backend.getCheckpoint(req.snapshotId).catch(() => undefined);
        if (winner?.digest === req.digest) return { snapshot_id: winner.id, size_bytes: total, kind: winner.kind };
      }
      throw err;
    }
    return { snapshot_id: committed.id, size_bytes: total, kind: committed.kind };
  } catch (err) {
    await rm(staging, { recursive: true, force: true }).catch(() => {});
    throw err;
  } finally {
    req.active.delete(stagingName);
  }
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
    throw transferFailed(`the peer refused: ${code ? `${code}: ` : ''}${message}`, { peer_status: res.status, ...(code ? { peer_code: code } : {}) });
  }
  return res;
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

// node:http rather than fetch for the bulk bytes: web-stream plumbing costs a large share of throughput at 1 GiB.
function getStream(url: string, headers: Record<string, string>, signal: AbortSignal): Promise<IncomingMessage> {
  return new Promise((resolve, reject) => {
    const get = url.startsWith('https:') ? httpsGet : httpGet;
    const req = get(url, { headers, signal }, resolve);
    req.on('error', reject);
  });
}

async function fetchFile(url: string, headers: Record<string, string>, signal: AbortSignal, dest: string): Promise<{ size: number; sha256: string }> {
  let res: IncomingMessage;
  try {
    res = await getStream(url, headers, signal);
  } catch (err) {
    throw transferFailed(`could not reach the peer: ${describe(err)}`, { peer_url: new URL(url).origin }, err);
  }
  if ((res.statusCode ?? 0) < 200 || (res.statusCode ?? 0) >= 300) {
    const chunks: Buffer[] = [];
    try {
      for await (const c of res) chunks.push(c as Buffer);
    } catch {
      /* the status says enough */
    }
    let code: string | undefined;
    let message = `HTTP ${res.statusCode}`;
    try {
      const body = errorBodySchema.safeParse(JSON.parse(Buffer.concat(chunks).toString('utf8')));
      if (body.success) ({ code, message } = body.data);
    } catch {
      /* not JSON */
    }
    throw transferFailed(`the peer refused: ${code ? `${code}: ` : ''}${message}`, { peer_status: res.statusCode, ...(code ? { peer_code: code } : {}) });
  }
  const hash = createHash('sha256');
  let size = 0;
  const tap = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      hash.update(chunk);
      size += chunk.length;
      cb(null, chunk);
    },
  });
  try {
    await pipeline(res, tap, createWriteStream(dest, { flags: 'wx', mode: 0o600, highWaterMark: 1024 * 1024 }));
  } catch (err) {
    throw transferFailed(`the transfer broke off after ${size} bytes: ${describe(err)}`, { received_bytes: size }, err);
  }
  // A peer that dies mid-body can end the response "cleanly" on some paths: the length check below catches it too.
  if (!res.complete) throw transferFailed(`the transfer broke off after ${size} bytes: the peer closed the connection early`, { received_bytes: size });
  return { size, sha256: hash.digest('hex') };
}

function describe(err: unknown): string {
  const e = err as { name?: string; message?: string; cause?: { code?: string; message?: string } };
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
