import { createHash } from 'node:crypto';
import { open, type FileHandle } from 'node:fs/promises';
import { AppError, type ArtifactFile } from '@fleet/agent-protocol';

/* Moving only the chunks of a file that changed, against an older copy of it on the receiving host. */

export interface Chunk {
  readonly size: number;
  readonly sha256: string;
}

const MIN_CHUNK = 16 * 1024;
const MAX_CHUNK = 256 * 1024;
/** About one boundary in 64 KiB past the minimum. */
const MASK = (1 << 16) - 1;
/** A range fetched in one request, at most: its body is held in memory before it is written. */
const MAX_RANGE = 4 * 1024 * 1024;

// The gear table of the rolling hash (FastCDC's): fixed, so every host cuts the same bytes the same way.
const GEAR = (() => {
  const t = new Uint32Array(256);
  let x = 0x9e3779b9;
  for (let i = 0; i < 256; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    t[i] = x >>> 0;
  }
  return t;
})();

/**
 * Content-defined chunks of a file: a boundary falls where a rolling hash
 * of the last bytes matches MASK (between MIN_CHUNK and MAX_CHUNK apart), so
 * bytes inserted early in a file (a tar entry that grew) move the chunks
 * after them, not change them.
 */
export async function chunkFile(path: string): Promise<Chunk[]> {
  const fh = await open(path, 'r');
  try {
    return await chunksOf(fh);
  } finally {
    await fh.close();
  }
}

async function chunksOf(fh: FileHandle): Promise<Chunk[]> {
  const out: Chunk[] = [];
  const buf = Buffer.allocUnsafe(1024 * 1024);
  let hash = createHash('sha256');
  let size = 0;
  let h = 0;
  for (let pos = 0; ;) {
    const { bytesRead } = await fh.read(buf, 0, buf.length, pos);
    if (bytesRead === 0) break;
    pos += bytesRead;
    let from = 0;
    for (let i = 0; i < bytesRead; i++) {
      h = ((h << 1) + (GEAR[buf[i] ?? 0] ?? 0)) >>> 0;
      size++;
      if ((size >= MIN_CHUNK && (h & MASK) === 0) || size >= MAX_CHUNK) {
        hash.update(buf.subarray(from, i + 1));
        out.push({ size, sha256: hash.digest('hex') });
        hash = createHash('sha256');
        from = i + 1;
        size = 0;
        h = 0;
      }
    }
    hash.update(buf.subarray(from, bytesRead));
  }
  if (size > 0) out.push({ size, sha256: hash.digest('hex') });
  return out;
}

/**
 * Writes `dest` from the chunks the local copy `basePath` also holds (found
 * by sha256 wherever they sit in it) and fetches the others as byte ranges;
 * the whole file is then checked against its sha256, so a wrong chunk cannot
 * land. Answers the bytes fetched, or undefined (nothing written) when most
 * of the file is new: a plain copy is cheaper then.
 */
export async function patchFromBase(
  basePath: string,
  f: ArtifactFile,
  url: string,
  headers: Record<string, string>,
  signal: AbortSignal,
  dest: string,
): Promise<number | undefined> {
  const chunks = f.chunks;
  if (!chunks || chunks.reduce((n, c) => n + c.size, 0) !== f.size_bytes) return undefined;
  const base = await open(basePath, 'r').catch(() => undefined);
  if (!base) return undefined;
  try {
    const have = new Map<string, number>();
    let at = 0;
    for (const c of await chunksOf(base)) {
      if (!have.has(c.sha256)) have.set(c.sha256, at);
      at += c.size;
    }
    const ranges: Array<{ start: number; end: number }> = [];
    const copies: Array<{ from: number; to: number; size: number }> = [];
    let off = 0;
    for (const c of chunks) {
      const from = have.get(c.sha256);
      if (from !== undefined) copies.push({ from, to: off, size: c.size });
      else {
        const last = ranges.at(-1);
        if (last && last.end + 1 === off && last.end + c.size - last.start < MAX_RANGE) last.end = off + c.size - 1;
        else ranges.push({ start: off, end: off + c.size - 1 });
      }
      off += c.size;
    }
    const fetched = ranges.reduce((n, r) => n + r.end - r.start + 1, 0);
    if (fetched > f.size_bytes / 2) return undefined;
    const out = await open(dest, 'wx', 0o600);
    try {
      const buf = Buffer.allocUnsafe(MAX_CHUNK);
      for (const c of copies) {
        const { bytesRead } = await base.read(buf, 0, c.size, c.from);
        if (bytesRead !== c.size) throw transferFailed(`the local copy of "${f.name}" changed while it was read`, f.name);
        await out.write(buf, 0, c.size, c.to);
      }
      for (const r of ranges) {
        const res = await fetch(url, { headers: { ...headers, range: `bytes=${r.start}-${r.end}` }, signal }).catch((err: unknown) => {
          throw transferFailed(`could not reach the peer: ${(err as Error).message}`, f.name);
        });
        const body = Buffer.from(await res.arrayBuffer());
        if (res.status !== 206 || body.length !== r.end - r.start + 1)
          throw transferFailed(`the peer answered a range of "${f.name}" with ${res.status} and ${body.length} bytes`, f.name);
        await out.write(body, 0, body.length, r.start);
      }
      await out.truncate(f.size_bytes);
    } finally {
      await out.close();
    }
    const got = await sha256Of(dest);
    if (got !== f.sha256)
      throw new AppError(
        'ARTIFACT_DIGEST_MISMATCH',
        422,
        `file "${f.name}" assembled from the local copy hashes to ${got}, expected ${f.sha256}`,
        {
          file: f.name,
        },
      );
    return fetched;
  } finally {
    await base.close();
  }
}

const transferFailed = (message: string, file: string): AppError => new AppError('ARTIFACT_TRANSFER_FAILED', 424, message, { file });

async function sha256Of(path: string): Promise<string> {
  const fh = await open(path, 'r');
  try {
    const h = createHash('sha256');
    const buf = Buffer.allocUnsafe(1024 * 1024);
    for (let pos = 0; ;) {
      const { bytesRead } = await fh.read(buf, 0, buf.length, pos);
      if (bytesRead === 0) break;
      h.update(buf.subarray(0, bytesRead));
      pos += bytesRead;
    }
    return h.digest('hex');
  } finally {
    await fh.close();
  }
}
