import type { IncomingMessage, ServerResponse } from 'node:http';
import { createContextValues } from '@connectrpc/connect';
import { connectNodeAdapter } from '@connectrpc/connect-node';
import type { FastifyInstance } from 'fastify';
import { AGENT_API_PREFIX } from '@fleet/agent-protocol';
import { downloadFile, sendFileError, sendJson, uploadFiles } from '../envd/files.js';
import { GuestFs } from '../envd/guest-fs.js';
import { ProcessTable } from '../envd/processes.js';
import { kSandbox, registerEnvdServices } from '../envd/services.js';
import { WatcherTable } from '../envd/watch.js';
import { nameParam, type AgentRouteContext } from './context.js';

/** Connect messages (not file uploads, which stream) larger than this are refused. */
const RPC_READ_MAX_BYTES = 16 * 1024 * 1024;

/**
 * envd — the in-sandbox API of the E2B SDK (process.Process and
 * filesystem.Filesystem over the Connect protocol, /files, /health) — served
 * per sandbox under `/v1/vms/:name/envd/`, behind the host token like every
 * agent route. The control plane (or its ingress) checks the caller's envd
 * access token and forwards here; the paths below the prefix are envd's own.
 */
export function registerEnvdRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, config } = ctx;
  const fs = new GuestFs(backend);
  const processes = new ProcessTable(backend);
  const watchers = new WatcherTable();
  const sandboxOfRequest = new WeakMap<IncomingMessage, string>();
  const rpc = connectNodeAdapter({
    routes: (router) => registerEnvdServices(router, { processes, fs, watchers }),
    contextValues: (req) => createContextValues().set(kSandbox, sandboxOfRequest.get(req as IncomingMessage) ?? ''),
    readMaxBytes: RPC_READ_MAX_BYTES,
    fallback: (_req, res) => sendJson(res as ServerResponse, 404, { code: 404, message: 'no such envd route' }),
  });

  void app.register((scope, _opts, done) => {
    // Bodies reach envd unread: Connect, multipart and raw uploads parse (and bound) their own.
    scope.removeAllContentTypeParsers();
    scope.addContentTypeParser('*', (_req, _payload, done) => done(null));
    scope.all(`${AGENT_API_PREFIX}/vms/:name/envd/*`, async (req, reply) => {
      const rest = `/${(req.params as { '*'?: string })['*'] ?? ''}`;
      const search = req.url.includes('?') ? req.url.slice(req.url.indexOf('?')) : '';
      const query = new URLSearchParams(search);
      const raw = req.raw;
      const res = reply.raw;
      reply.hijack();
      try {
        const name = nameParam(req);
        const info = await backend.get(name).catch(() => undefined);
        // What E2B's edge answers for a sandbox that is gone: the SDK reads 502 as "not running".
        if (info?.state !== 'running') {
          raw.resume();
          sendJson(res, 502, { code: 502, message: `sandbox ${name} is not running on this host` });
        } else if (rest === '/health') {
          raw.resume();
          res.writeHead(req.method === 'GET' || req.method === 'HEAD' ? 204 : 405).end();
        } else if (rest === '/files' && req.method === 'GET') {
          await downloadFile(backend, name, raw, res, query);
        } else if (rest === '/files' && req.method === 'POST') {
          await uploadFiles(backend, fs, name, raw, res, query, config.maxUploadBytes);
        } else {
          sandboxOfRequest.set(raw, name);
          raw.url = `${rest}${search}`;
          rpc(raw, res);
        }
      } catch (err) {
        raw.resume();
        sendFileError(res, err);
      }
    });
    done();
  });
}
