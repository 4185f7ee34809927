import { spawn } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { createReadStream, createWriteStream } from 'node:fs';
import { chmod, mkdir, open, readdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { z } from 'zod';
import { AppError, describeFields, fieldsFromZod } from '@fleet/agent-protocol';
import { BackendErrorCode, checkpointNotFound, invalidSpec, sandboxFailed, type Checkpoint } from '../../backend.js';
import { CRIU_META, MEMORY_FILE_PREFIX, type CriuMeta } from './criu.js';
import { eachLimited } from './exec-util.js';

/**
 * Disk checkpoints: `<dataDir>/checkpoints/<id>/{manifest.json,rootfs.tar}`
 * (layout documented in backend.ts). A checkpoint is written under a
 * `.tmp-` name and renamed into place, manifest last, so a directory with a
 * manifest is always complete.
 */

export const checkpointIdRe = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$/;

export const manifestSchema = z.object({
  id: z.string().regex(checkpointIdRe),
  comment: z.string(),
  kind: z.enum(['disk', 'live']),
  size_bytes: z.number().int().nonnegative(),
  digest: z.string().regex(/^[0-9a-f]{64}$/),
  created_at: z.string(),
  image: z.string().min(1),
  files: z.record(z.string(), z.string()),
  parent: z.string(),
});

export const ROOTFS = 'rootfs.tar';
export const MANIFEST = 'manifest.json';

// Only the overlay xattrs that carry meaning in a portable upper layer (opaque
// directories); origin/impure/index handles point at this host's lower fs.
const TAR_XATTRS = [
  '--xattrs',
  '--xattrs-include=trusted.overlay.opaque',
  '--xattrs-include=user.*',
  '--xattrs-include=security.capability',
];

/**
 * An upper bound on the archive of a layer that takes `used_bytes` on disk
 * in `entries` entries: with --sparse, tar stores a file's data regions
 * (never more than its allocated blocks) plus a 512-byte header, and a
 * second one for a long name, an xattr or a sparse map; then the end
 * marker, padded to a 10 KiB record. Checked against quotas before archiving.
 */
export function expectedArchiveBytes(usage: { used_bytes: number; entries: number }): number {
  const raw = usage.used_bytes + usage.entries * 1024 + 1024;
  return Math.ceil(raw / 10240) * 10240;
}

export const checkpointTooLarge = (limit: number): AppError =>
  new AppError(
    BackendErrorCode.CheckpointTooLarge,
    413,
    `the checkpoint archive grew past the ${limit} bytes it was allowed; nothing was kept`,
    { max_bytes: limit },
  );

/**
 * Runs `tar` with `args` (writing the archive to stdout) into `dest`,
 * hashing and counting as it writes, refused past `maxBytes`
 * (CHECKPOINT_TOO_LARGE) with tar killed; `what` names the source in an error.
 */
export async function tarInto(
  args: readonly string[],
  dest: string,
  maxBytes: number | undefined,
  what: string,
): Promise<{ size: number; digest: string }> {
  const hash = createHash('sha256');
  let size = 0;
  const tar = spawn('tar', [...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  tar.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
  const exit = new Promise<number | null>((resolve, reject) => {
    tar.once('error', reject);
    tar.once('close', resolve);
  });
  const count = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      size += chunk.length;
      if (maxBytes !== undefined && size > maxBytes) {
        cb(checkpointTooLarge(maxBytes));
        return;
      }
      hash.update(chunk);
      cb(null, chunk);
    },
  });
  try {
    await pipeline(tar.stdout, count, createWriteStream(dest));
  } catch (err) {
    tar.kill('SIGKILL');
    await exit.catch(() => undefined);
    throw err;
  }
  const code = await exit;
  if (code !== 0) throw sandboxFailed(`tar of ${what} failed (exit ${code}): ${stderr.trim().slice(0, 300)}`);
  return { size, digest: hash.digest('hex') };
}

export function validateCheckpointId(id: string): void {
  if (!checkpointIdRe.test(id)) {
    throw invalidSpec(`checkpoint id "${id}" is invalid: use 1-128 of [A-Za-z0-9_.-], starting with a letter or digit`, [
      { path: 'id', message: 'invalid checkpoint id' },
    ]);
  }
}

export class CheckpointStore {
  constructor(
    readonly dir: string,
    readonly staging: string,
  ) {}

  async init(): Promise<void> {
    // Tenants' layers (0644 archives inside): closed to host users whatever the data dir's mode.
    for (const d of [this.dir, this.staging]) {
      await mkdir(d, { recursive: true, mode: 0o700 });
      await chmod(d, 0o700);
    }
  }

  path(id: string): string {
    validateCheckpointId(id);
    return join(this.dir, id);
  }

  async get(id: string): Promise<Checkpoint> {
    const dir = this.path(id);
    let raw: string;
    try {
      raw = await readFile(join(dir, MANIFEST), 'utf8');
    } catch {
      throw checkpointNotFound(id);
    }
    const parsed = manifestSchema.safeParse(JSON.parse(raw));
    if (!parsed.success) throw new AppError(BackendErrorCode.CheckpointCorrupt, 500, `checkpoint "${id}" has an invalid manifest`, { id });
    return parsed.data;
  }

  async list(): Promise<Checkpoint[]> {
    const names = await readdir(this.dir).catch(() => [] as string[]);
    const out: Checkpoint[] = [];
    for (const n of names) {
      if (!checkpointIdRe.test(n)) continue;
      try {
        out.push(await this.get(n));
      } catch {
        /* incomplete or foreign directory */
      }
    }
    return out.sort((a, b) => a.created_at.localeCompare(b.created_at) || a.id.localeCompare(b.id));
  }

  async delete(id: string): Promise<void> {
    const dir = this.path(id);
    // Rename first so a concurrent reader never sees a half-deleted checkpoint.
    const trash = join(this.dir, `.del-${id}-${randomBytes(4).toString('hex')}`);
    try {
      await rename(dir, trash);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return;
      throw err;
    }
    await rm(trash, { recursive: true, force: true });
  }

  /**
   * Archives `upperDir` into a new checkpoint, hashing the bytes as they are
   * written. Sparse files stay sparse (only their data regions are stored).
   * Past `maxBytes` the archive is abandoned (CHECKPOINT_TOO_LARGE) before it
   * takes more of the host's disk.
   */
  async write(
    upperDir: string,
    meta: {
      id?: string;
      comment: string;
      image: string;
      now: Date;
      maxBytes?: number;
      /** Called once the rootfs is archived (the guest still frozen): dumps memory into a directory, moved in here. */
      memory?: () => Promise<{ dir: string; meta: CriuMeta }>;
    },
  ): Promise<Checkpoint> {
    const id = meta.id ?? `ckpt-${meta.now.getTime().toString(36)}-${randomBytes(6).toString('hex')}`;
    validateCheckpointId(id);
    if (
      await stat(join(this.dir, id)).then(
        () => true,
        () => false,
      )
    ) {
      throw new AppError(BackendErrorCode.CheckpointExists, 409, `checkpoint "${id}" already exists on this host; pick another id`, { id });
    }
    const tmp = join(this.dir, `.tmp-${id}-${randomBytes(4).toString('hex')}`);
    await mkdir(tmp);
    try {
      const { size, digest } = await tarInto(
        [...TAR_XATTRS, '--sparse', '--numeric-owner', '-C', upperDir, '-cf', '-', '.'],
        join(tmp, ROOTFS),
        meta.maxBytes,
        'the writable layer',
      );
      // The memory half (a CRIU dump): moved in beside the rootfs, each file hashed, so it travels under the same grant.
      const files: Record<string, string> = {};
      if (meta.memory) {
        const dump = await meta.memory();
        try {
          // Eight at a time: some fifty files, each moved and hashed (one after the other, each waited on the event
          // loop and the thread pool in turn: 150-200 ms of a pause here).
          const names = (await readdir(dump.dir)).filter((name) => !name.endsWith('.log')).sort();
          const digests = await eachLimited(names, 8, async (name) => {
            const target = `${MEMORY_FILE_PREFIX}${name}`;
            await rename(join(dump.dir, name), join(tmp, target));
            return [target, (await this.hashFile(join(tmp, target))).digest] as const;
          });
          for (const [target, digest] of digests) files[target] = digest;
        } finally {
          await rm(dump.dir, { recursive: true, force: true });
        }
        await writeFile(join(tmp, CRIU_META), JSON.stringify(dump.meta));
        files[CRIU_META] = (await this.hashFile(join(tmp, CRIU_META))).digest;
      }
      const checkpoint: Checkpoint = {
        id,
        comment: meta.comment,
        kind: meta.memory ? 'live' : 'disk',
        size_bytes: size,
        digest,
        created_at: meta.now.toISOString(),
        image: meta.image,
        files,
        parent: '',
      };
      await writeFile(join(tmp, MANIFEST), JSON.stringify(checkpoint, null, 2));
      await rename(tmp, join(this.dir, id));
      return checkpoint;
    } catch (err) {
      await rm(tmp, { recursive: true, force: true }).catch(() => undefined);
      throw err;
    }
  }

  /** Extracts a checkpoint's layer into `upperDir`, checking the digest of the bytes it read. */
  async extract(id: string, upperDir: string): Promise<Checkpoint> {
    const cp = await this.get(id);
    const hash = createHash('sha256');
    const tar = spawn('tar', [...TAR_XATTRS, '--numeric-owner', '-C', upperDir, '-xpf', '-'], { stdio: ['pipe', 'ignore', 'pipe'] });
    let stderr = '';
    tar.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
    const exit = new Promise<number | null>((resolve, reject) => {
      tar.once('error', reject);
      tar.once('close', resolve);
    });
    // GNU tar stops reading at the end-of-archive marker and exits, leaving the record padding
    // unread: writing the rest then fails with EPIPE (a "Premature close" pipeline). So feed tar
    // while it reads, and keep hashing to the last byte whatever tar does.
    tar.stdin.on('error', () => {});
    for await (const chunk of createReadStream(join(this.path(id), ROOTFS), { highWaterMark: 1024 * 1024 })) {
      hash.update(chunk as Buffer);
      if (tar.stdin.writable && !tar.stdin.write(chunk)) {
        await new Promise<void>((resolve) => {
          const done = () => {
            tar.stdin.off('drain', done);
            tar.stdin.off('close', done);
            resolve();
          };
          tar.stdin.once('drain', done);
          tar.stdin.once('close', done);
        });
      }
    }
    tar.stdin.end();
    const code = await exit;
    if (code !== 0 && /No space left on device/.test(stderr)) {
      throw invalidSpec(`checkpoint "${id}" does not fit on the sandbox's disk: ask for a larger storage_gb`, [
        { path: 'storage_gb', message: 'too small for the checkpoint' },
      ]);
    }
    if (code !== 0) throw sandboxFailed(`restoring checkpoint "${id}" failed (tar exit ${code}): ${stderr.trim().slice(0, 300)}`);
    const digest = hash.digest('hex');
    if (digest !== cp.digest) {
      throw new AppError(
        BackendErrorCode.CheckpointCorrupt,
        500,
        `checkpoint "${id}" is corrupt: rootfs.tar hashes to ${digest}, its manifest says ${cp.digest}`,
        { id },
      );
    }
    return cp;
  }

  async hashFile(path: string): Promise<{ digest: string; size: number }> {
    // Read into one buffer of up to 4 MiB, not through a stream's 64 KiB chunks: a pause hashes its memory file
    // (64 MiB in 60 ms rather than 130-350 ms here, most of it the stream's per-chunk cost, not SHA-256).
    const hash = createHash('sha256');
    let size = 0;
    const fh = await open(path, 'r');
    try {
      const buf = Buffer.allocUnsafe(Math.min(4 * 1024 * 1024, Math.max(4096, (await fh.stat()).size)));
      for (;;) {
        const { bytesRead } = await fh.read(buf, 0, buf.length, null);
        if (bytesRead === 0) break;
        hash.update(buf.subarray(0, bytesRead));
        size += bytesRead;
      }
    } finally {
      await fh.close();
    }
    return { digest: hash.digest('hex'), size };
  }

  /** Validates a staged checkpoint directory and renames it into place; removes it on any failure. */
  async import(stagingPath: string, opts: { verifyDigest?: boolean } = {}): Promise<Checkpoint> {
    try {
      let raw: string;
      try {
        raw = await readFile(join(stagingPath, MANIFEST), 'utf8');
      } catch {
        throw new AppError(BackendErrorCode.CheckpointCorrupt, 400, `staged checkpoint at ${stagingPath} has no ${MANIFEST}`);
      }
      let json: unknown;
      try {
        json = JSON.parse(raw);
      } catch {
        throw new AppError(BackendErrorCode.CheckpointCorrupt, 400, `staged ${MANIFEST} is not JSON`);
      }
      const parsed = manifestSchema.safeParse(json);
      if (!parsed.success)
        throw new AppError(
          BackendErrorCode.CheckpointCorrupt,
          400,
          `staged ${MANIFEST} is invalid: ${describeFields(fieldsFromZod(parsed.error))}`,
        );
      const cp = parsed.data;
      if (opts.verifyDigest !== false) {
        const { digest, size } = await this.hashFile(join(stagingPath, ROOTFS));
        if (digest !== cp.digest || size !== cp.size_bytes) {
          throw new AppError(
            BackendErrorCode.CheckpointCorrupt,
            400,
            `staged ${ROOTFS} does not match its manifest (sha256 ${digest}, ${size} bytes; expected ${cp.digest}, ${cp.size_bytes} bytes)`,
            { id: cp.id },
          );
        }
      }
      try {
        // rename(2) onto an existing non-empty directory fails, so a taken id is never overwritten.
        await rename(stagingPath, join(this.dir, cp.id));
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === 'ENOTEMPTY' || code === 'EEXIST')
          throw new AppError(BackendErrorCode.CheckpointExists, 409, `checkpoint "${cp.id}" already exists on this host`, { id: cp.id });
        throw err;
      }
      return cp;
    } catch (err) {
      await rm(stagingPath, { recursive: true, force: true });
      throw err;
    }
  }
}
