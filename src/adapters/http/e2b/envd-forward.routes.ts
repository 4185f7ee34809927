import type { IncomingMessage, ServerResponse } from 'node:http';
import { pipeline } from 'node:stream/promises';
import type { FastifyInstance } from 'fastify';
import { AppError } from '@fleet/agent-protocol';
import type { VmCommands } from '../../../commands/vm/vm-commands.js';
import { E2B_ENVD_PREFIX, ENVD_PORT, type EnvdTokens } from './e2b-auth.js';

/**
 * E2B_SANDBOX_URL: the SDK sends every in-sandbox ("envd") request to one
 * address with `E2b-Sandbox-Id`, `E2b-Sandbox-Port: 49983` and the sandbox's
 * `X-Access-Token`. This checks the token and relays the exchange, streamed
 * both ways, to the envd of the sandbox's host agent. `forwardEnvd` is the
 * relay alone, for an ingress that routes the same headers.
 */

export interface EnvdForwardDeps {
  readonly vms: VmCommands;
  readonly tokens: EnvdTokens;
}

/** Request headers envd reads; everything else (cookies, the access token, our own) stays here. */
const FORWARDED = new Set([
  'content-type',
  'content-length',
  'content-encoding',
  'accept',
  'accept-encoding',
  'connect-protocol-version',
  'connect-timeout-ms',
  'connect-content-encoding',
  'connect-accept-encoding',
  'keepalive-ping-interval',
  'user-agent',
  'transfer-encoding',
]);
const HOP_BY_HOP = new Set(['connection', 'keep-alive', 'transfer-encoding', 'upgrade', 'proxy-connection', 'te', 'trailer']);

/** envd's error shape; for a Connect call the SDK reads the HTTP status (401 unauthenticated, 502 unavailable). */
function refuse(res: ServerResponse, status: number, message: string): void {
  if (res.headersSent) {
    res.destroy();
    return;
  }
  const body = JSON.stringify({ code: status, message });
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
  res.end(body);
}

/** Relays one envd exchange for a running VM whose access the caller has already checked. */
export async function forwardEnvd(
  vms: VmCommands,
  vmId: string,
  path: string,
  req: IncomingMessage,
  res: ServerResponse,
  correlationId: string,
): Promise<void> {
  let target;
  try {
    target = await vms.sandboxFor(vmId, { correlationId, actor: 'e2b-envd' });
  } catch (err) {
    req.resume();
    // A VM that ended or is not running yet is what E2B's edge calls a dead sandbox: 502, read by the SDK as "not running".
    if (err instanceof AppError && (err.status === 404 || err.status === 409)) {
      refuse(res, 502, `sandbox ${vmId} is not running`);
      return;
    }
    throw err;
  }
  const headers: Record<string, string> = {};
  for (const [k, v] of Object.entries(req.headers)) {
    if (v === undefined) continue;
    const value = Array.isArray(v) ? v.join(', ') : v;
    if (FORWARDED.has(k) || k.startsWith('x-metadata-')) headers[k] = value;
    // The agent's Authorization carries its host token; the SDK's (a Basic user name) travels beside it.
    else if (k === 'authorization') headers['x-e2b-authorization'] = value;
  }
  const abort = new AbortController();
  res.on('close', () => {
    if (!res.writableFinished) abort.abort();
  });
  const bodyless = req.method === 'GET' || req.method === 'HEAD';
  let answer;
  try {
    answer = await target.agent.envd(target.name, {
      method: req.method ?? 'GET',
      path,
      headers,
      body: bodyless ? undefined : req,
      signal: abort.signal,
    });
  } catch (err) {
    req.resume();
    refuse(res, 502, `the host of sandbox ${vmId} did not answer: ${(err as Error).message}`);
    return;
  }
  const out: Record<string, string | string[]> = {};
  for (const [k, v] of Object.entries(answer.headers)) if (!HOP_BY_HOP.has(k)) out[k] = v;
  res.writeHead(answer.status, out);
  res.flushHeaders();
  // A dropped client aborts the agent request (the signal above); a dropped agent ends the client's response.
  await pipeline(answer.body, res).catch(() => {
    abort.abort();
    res.destroy();
  });
}

/** The access check, then the relay: what both the E2B_SANDBOX_URL route and an ingress port handler do. */
export async function serveEnvd(
  deps: EnvdForwardDeps,
  vmId: string,
  path: string,
  req: IncomingMessage,
  res: ServerResponse,
  correlationId: string,
): Promise<void> {
  const token = req.headers['x-access-token'];
  if (!deps.tokens.verify(vmId, typeof token === 'string' ? token : undefined)) {
    req.resume();
    refuse(res, 401, 'a valid X-Access-Token for this sandbox is required (the envdAccessToken of its create or connect answer)');
    return;
  }
  await forwardEnvd(deps.vms, vmId, path, req, res, correlationId);
}

/**
 * envd as a port handler of the ingress (branch `ingress`): register it with
 * `handlers.setPortHandler(ENVD_PORT, envdIngressHandler(deps), { auth: 'handler' })`,
 * since envd is authorised by the sandbox's access token, not its traffic token.
 */
export function envdIngressHandler(deps: EnvdForwardDeps): {
  request(target: { readonly vmId: string }, req: IncomingMessage, res: ServerResponse): Promise<void>;
  gone(vmId: string, req: IncomingMessage, res: ServerResponse): void;
} {
  return {
    // As the API's relay answers: the token first (nothing said to a stranger), then E2B's 502 for a sandbox not running.
    gone(vmId, req, res) {
      req.resume();
      const token = req.headers['x-access-token'];
      if (!deps.tokens.verify(vmId, typeof token === 'string' ? token : undefined))
        refuse(res, 401, 'a valid X-Access-Token for this sandbox is required (the envdAccessToken of its create or connect answer)');
      else refuse(res, 502, `sandbox ${vmId} is not running`);
    },
    async request(target, req, res) {
      try {
        await serveEnvd(deps, target.vmId, req.url ?? '/', req, res, `ingress-envd-${target.vmId}`);
      } catch {
        req.resume();
        refuse(res, 502, 'the sandbox could not be reached');
      }
    },
  };
}

export function envdForwardRoutes(deps: EnvdForwardDeps) {
  return async (root: FastifyInstance): Promise<void> => {
    await root.register((scope, _opts, done) => {
      // Bodies are relayed unread, whatever their type.
      scope.removeAllContentTypeParsers();
      scope.addContentTypeParser('*', (_req, _payload, done) => {
        done(null);
      });
      const handler = async (req: import('fastify').FastifyRequest, reply: import('fastify').FastifyReply): Promise<void> => {
        const raw = req.raw;
        const res = reply.raw;
        reply.hijack();
        try {
          const id = req.headers['e2b-sandbox-id'];
          const port = req.headers['e2b-sandbox-port'];
          if (typeof id !== 'string' || !/^[a-z0-9-]{1,64}$/.test(id)) {
            raw.resume();
            refuse(res, 400, 'the E2b-Sandbox-Id header must name a sandbox');
            return;
          }
          if (port !== undefined && port !== String(ENVD_PORT)) {
            raw.resume();
            refuse(res, 502, `port ${String(port)}: only envd (${ENVD_PORT}) is served at this address`);
            return;
          }
          await serveEnvd(deps, id, req.url.slice(E2B_ENVD_PREFIX.length) || '/', raw, res, req.id);
        } catch (err) {
          req.log.warn({ err: { message: (err as Error).message } }, 'envd relay failed');
          raw.resume();
          refuse(res, 502, 'the sandbox could not be reached');
        }
      };
      scope.all(E2B_ENVD_PREFIX, handler);
      scope.all(`${E2B_ENVD_PREFIX}/*`, handler);
      done();
    });
  };
}
