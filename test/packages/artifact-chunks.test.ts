import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { chunkFile, patchFromBase } from '../../packages/agent/src/artifact-chunks.js';

/**
 * The agent's chunked pull against a local copy: content-defined chunks
 * survive an insertion, only missing chunks are fetched (byte ranges from a
 * real HTTP server), and a peer that serves wrong bytes is caught by the
 * whole-file sha256.
 */

const sha = (b: Buffer): string => createHash('sha256').update(b).digest('hex');

describe('content-defined chunks and a pull patched from a local copy', () => {
  let dir = '';
  let server: Server;
  let url = '';
  let served: Buffer = Buffer.alloc(0);
  let tamper = false;
  let rangeBytes = 0;

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'ckpt-chunks-'));
    server = createServer((req, res) => {
      const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? '');
      if (!m) {
        res.writeHead(200).end(served);
        return;
      }
      const part = Buffer.from(served.subarray(Number(m[1]), Number(m[2]) + 1));
      if (tamper) part[0] = (part[0]! + 1) & 0xff;
      rangeBytes += part.length;
      res.writeHead(206, { 'content-range': `bytes ${m[1]}-${m[2]}/${served.length}` }).end(part);
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/f`;
  });

  after(async () => {
    await new Promise((r) => server.close(r));
    await rm(dir, { recursive: true, force: true });
  });

  const setUp = async (base: Buffer, next: Buffer) => {
    await writeFile(join(dir, 'base'), base);
    await writeFile(join(dir, 'next'), next);
    await rm(join(dir, 'out'), { force: true });
    served = next;
    rangeBytes = 0;
    return { name: 'rootfs.tar', size_bytes: next.length, sha256: sha(next), chunks: await chunkFile(join(dir, 'next')) };
  };

  it('bytes inserted near the start move only the chunks around them; the file is rebuilt exactly', async () => {
    const base = randomBytes(8 * 1024 * 1024);
    const next = Buffer.concat([base.subarray(0, 1000), randomBytes(700), base.subarray(1000)]);
    const f = await setUp(base, next);
    assert.equal(
      f.chunks.reduce((n, c) => n + c.size, 0),
      next.length,
    );
    const fetched = await patchFromBase(join(dir, 'base'), f, url, {}, AbortSignal.timeout(10_000), join(dir, 'out'));
    assert.ok(fetched !== undefined && fetched < 600 * 1024, `only the changed chunks were fetched: ${fetched}`);
    assert.equal(fetched, rangeBytes);
    assert.ok((await readFile(join(dir, 'out'))).equals(next));
  });

  it('a mostly new file is left to a plain copy (nothing written)', async () => {
    const f = await setUp(randomBytes(2 * 1024 * 1024), randomBytes(2 * 1024 * 1024));
    assert.equal(await patchFromBase(join(dir, 'base'), f, url, {}, AbortSignal.timeout(10_000), join(dir, 'out')), undefined);
    assert.equal(rangeBytes, 0);
  });

  it('a peer serving other bytes for a range than its chunks promise: ARTIFACT_DIGEST_MISMATCH', async () => {
    const base = randomBytes(4 * 1024 * 1024);
    const next = Buffer.from(base);
    randomBytes(300).copy(next, 2 * 1024 * 1024);
    const f = await setUp(base, next);
    tamper = true;
    try {
      await assert.rejects(
        patchFromBase(join(dir, 'base'), f, url, {}, AbortSignal.timeout(10_000), join(dir, 'out')),
        (err: unknown) => err instanceof AppError && err.code === 'ARTIFACT_DIGEST_MISMATCH',
      );
    } finally {
      tamper = false;
    }
  });
});
