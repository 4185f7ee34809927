import type { IncomingMessage, ServerResponse } from 'node:http';
import { posix } from 'node:path';
import { PassThrough, type Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { createGunzip } from 'node:zlib';
import { Busboy } from '@fastify/busboy';
import { ConnectError } from '@connectrpc/connect';
import { AppError } from '@fleet/agent-protocol';
import type { Backend } from '../backend.js';
import { absoluteGuestPath, type GuestFs } from './guest-fs.js';
import { requestedUser, userProblem } from './user.js';

/**
 * envd's `GET /files` (download) and `POST /files` (upload: multipart with
 * one or more `file` parts whose filename is the destination path, or a raw
 * `application/octet-stream` body, optionally gzip-encoded, for the `path`
 * in the query). Errors are envd's `{code, message}` with the HTTP status
 * the SDK maps to its exceptions (404 → FileNotFoundError, 400
 * InvalidArgumentError, 401 AuthenticationError, 507 NotEnoughSpaceError).
 */

export class EnvdHttpError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
  }
}

export function sendJson(res: ServerResponse, status: number, body: unknown): void {
  if (res.headersSent) {
    res.destroy();
    return;
  }
  const text = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
  res.end(text);
}

/** Any failure as envd answers it; a 5xx says nothing of the agent's insides. */
export function sendFileError(res: ServerResponse, err: unknown): void {
  const [status, message] = statusOf(err);
  sendJson(res, status, { code: status, message });
}

const CONNECT_TO_HTTP: Record<number, number> = { 3: 400, 5: 404, 6: 409, 7: 403, 8: 429, 16: 401 };

function statusOf(err: unknown): [number, string] {
  if (err instanceof EnvdHttpError) return [err.status, err.message];
  if (err instanceof ConnectError) return [CONNECT_TO_HTTP[err.code] ?? 500, err.rawMessage];
  if (err instanceof AppError) {
    switch (err.code) {
      case 'GUEST_PATH_NOT_FOUND':
      case 'SANDBOX_NOT_FOUND':
        return [404, err.message];
      case 'GUEST_PATH_NOT_A_FILE':
      case 'PATH_ESCAPES_SANDBOX':
      case 'INVALID_SANDBOX_SPEC':
      case 'VALIDATION_FAILED':
        return [400, err.message];
      case 'PAYLOAD_TOO_LARGE':
        return [413, err.message];
      case 'HOST_CAPACITY_EXHAUSTED':
        return [507, 'not enough disk space available'];
      default:
        return err.status < 500 ? [err.status, err.message] : [500, 'the file operation failed in the host agent'];
    }
  }
  if ((err as NodeJS.ErrnoException | undefined)?.code === 'ENOSPC') return [507, 'not enough disk space available'];
  return [500, 'the file operation failed in the host agent'];
}

function checkUser(req: IncomingMessage, query: URLSearchParams): void {
  const problem = userProblem(requestedUser(req.headers, query.get('username') ?? undefined));
  if (problem) throw new EnvdHttpError(401, problem);
}

export async function downloadFile(
  backend: Backend,
  sandbox: string,
  req: IncomingMessage,
  res: ServerResponse,
  query: URLSearchParams,
): Promise<void> {
  checkUser(req, query);
  const raw = query.get('path');
  if (!raw) throw new EnvdHttpError(400, 'the path query parameter is required');
  const path = absoluteGuestPath(raw);
  const file = await backend.readGuestFile(sandbox, path);
  // Identity encoding always: a client's Accept-Encoding allows it, and the size is then known up front.
  res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': file.size });
  res.on('close', () => {
    if (!res.writableFinished) file.stream.destroy();
  });
  await pipeline(file.stream, res).catch(() => undefined);
  await file.done.catch(() => res.destroy());
}

interface Written {
  readonly path: string;
  readonly name: string;
  readonly type: 'file';
}

export async function uploadFiles(
  backend: Backend,
  fs: GuestFs,
  sandbox: string,
  req: IncomingMessage,
  res: ServerResponse,
  query: URLSearchParams,
  maxBytes: number,
): Promise<void> {
  checkUser(req, query);
  for (const h of Object.keys(req.headers)) {
    if (h.startsWith('x-metadata-')) throw new EnvdHttpError(400, 'file metadata (X-Metadata-* headers) is not supported by this envd');
  }
  const queryPath = query.get('path') ?? undefined;
  const contentType = req.headers['content-type'] ?? '';
  const written: Written[] = [];
  const writeOne = async (target: string, data: Readable): Promise<void> => {
    const path = absoluteGuestPath(target);
    await fs.prepareFile(sandbox, path);
    await backend.writeGuestFile(sandbox, path, data, { maxBytes });
    written.push({ path, name: posix.basename(path), type: 'file' });
  };

  if (/^application\/octet-stream\b/i.test(contentType)) {
    if (!queryPath) throw new EnvdHttpError(400, 'an octet-stream upload needs the path query parameter');
    const encoding = (req.headers['content-encoding'] ?? 'identity').toLowerCase();
    if (encoding !== 'identity' && encoding !== 'gzip')
      throw new EnvdHttpError(400, `content encoding '${encoding}' is not supported: send identity or gzip`);
    const body = encoding === 'gzip' ? req.pipe(createGunzip()) : req;
    await writeOne(queryPath, body);
  } else if (/^multipart\/form-data\b/i.test(contentType)) {
    await new Promise<void>((resolve, reject) => {
      let chain = Promise.resolve();
      let failed = false;
      const bb = Busboy({
        headers: { ...req.headers, 'content-type': contentType },
        preservePath: true,
        limits: { files: 1000, fields: 0, fileSize: maxBytes + 1 },
      });
      bb.on('file', (field, stream, filename) => {
        if (failed || field !== 'file') {
          stream.resume();
          return;
        }
        // Parts arrive in order; each is written (and its bytes consumed) before the next one starts.
        const hold = new PassThrough();
        stream.pipe(hold);
        chain = chain.then(async () => {
          if (failed) {
            hold.resume();
            return;
          }
          const target = queryPath ?? filename;
          if (!target) throw new EnvdHttpError(400, 'each file part needs a filename (its destination path) or the path query parameter');
          await writeOne(target, hold);
        });
        chain.catch((err: unknown) => {
          failed = true;
          hold.resume();
          reject(err instanceof Error ? err : new Error(String(err)));
        });
      });
      bb.on('error', (err: unknown) => reject(new EnvdHttpError(400, `malformed multipart body: ${(err as Error).message}`)));
      bb.on('finish', () => {
        chain.then(resolve, reject);
      });
      req.pipe(bb);
    });
    if (written.length === 0) throw new EnvdHttpError(400, 'the multipart body holds no part named "file"');
  } else {
    throw new EnvdHttpError(400, `upload as multipart/form-data or application/octet-stream, not '${contentType || 'nothing'}'`);
  }
  sendJson(res, 200, written);
}
