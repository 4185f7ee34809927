import { createReadStream } from 'node:fs';
import { stat } from 'node:fs/promises';
import { Readable } from 'node:stream';
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { z } from 'zod';
import {
  AGENT_API_PREFIX,
  artifactFileNameSchema,
  artifactManifestQuerySchema,
  artifactManifestSchema,
  artifactMovedSchema,
  artifactMoveSchema,
  checkpointSchema,
  createCheckpointRequestSchema,
  createGrantRequestSchema,
  deleteCheckpointResponseSchema,
  grantResponseSchema,
  layerUsageResponseSchema,
  listCheckpointsResponseSchema,
} from '@fleet/agent-protocol';
import { AppError } from '@fleet/agent-protocol';
import { buildManifest, parseRange, pullArtifact, servableFile, toWireCheckpoint } from '../artifacts.js';
import { mintGrant, verifyGrant } from '../grants.js';
import { isCode, type AgentRouteContext } from './context.js';
import { bodyOf, checkpointId, paramOf, part, queryOf, sandboxName, type Answer, type RouteSchema } from './route-schema.js';

/** Each route's request parts and responses (route-schema.ts). */
export const schemas = {
  create: {
    params: { name: sandboxName },
    body: part(createCheckpointRequestSchema, 'checkpoint request', { absent: {} }),
    response: { 201: checkpointSchema },
  },
  layerUsage: { params: { name: sandboxName }, response: { 200: layerUsageResponseSchema } },
  list: { response: { 200: listCheckpointsResponseSchema } },
  get: { params: { id: checkpointId }, response: { 200: checkpointSchema } },
  delete: { params: { id: checkpointId }, response: { 200: deleteCheckpointResponseSchema } },
  grant: { body: part(createGrantRequestSchema, 'grant request'), response: { 201: grantResponseSchema } },
  manifest: {
    params: { id: checkpointId },
    querystring: part(artifactManifestQuerySchema, 'query'),
    response: { 200: artifactManifestSchema },
  },
  /** application/octet-stream, whole or a byte range (206); 416 with a problem body for a range past the end. */
  file: {
    params: { id: checkpointId, file: part(artifactFileNameSchema, 'file name') },
    response: { 200: z.instanceof(Readable), 206: z.instanceof(Readable) },
  },
  pull: { body: part(artifactMoveSchema, 'artifact move'), response: { 200: artifactMovedSchema } },
} satisfies Record<string, RouteSchema>;

/** Checkpoints of sandboxes and the artifact moves between hosts (grant-authenticated downloads, pulls). */
export function registerCheckpointRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, config, now, activePulls } = ctx;
  // ---- checkpoints ----------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/vms/:name/checkpoints`, async (req, reply) => {
    const name = paramOf(req, schemas.create.params, 'name');
    const body = bodyOf(req, schemas.create.body);
    const cp = await backend.checkpoint(name, {
      comment: body.comment,
      live: body.live,
      ...(body.id ? { id: body.id } : {}),
      ...(body.max_bytes ? { maxBytes: body.max_bytes } : {}),
    });
    return reply.code(201).send(toWireCheckpoint(cp, name) satisfies Answer<typeof schemas.create, 201>);
  });

  app.get(`${AGENT_API_PREFIX}/vms/:name/layer-usage`, async (req): Promise<Answer<typeof schemas.layerUsage, 200>> =>
    backend.layerUsage(paramOf(req, schemas.layerUsage.params, 'name')),
  );

  app.get(`${AGENT_API_PREFIX}/checkpoints`, async (): Promise<Answer<typeof schemas.list, 200>> => ({
    checkpoints: (await backend.listCheckpoints()).map((c) => toWireCheckpoint(c)),
  }));

  app.get(`${AGENT_API_PREFIX}/checkpoints/:id`, async (req): Promise<Answer<typeof schemas.get, 200>> =>
    toWireCheckpoint(await backend.getCheckpoint(paramOf(req, schemas.get.params, 'id'))),
  );

  app.delete(`${AGENT_API_PREFIX}/checkpoints/:id`, async (req): Promise<Answer<typeof schemas.delete, 200>> => {
    const id = paramOf(req, schemas.delete.params, 'id');
    const existed = await backend.getCheckpoint(id).then(
      () => true,
      (err: unknown) => {
        if (isCode(err, 'CHECKPOINT_NOT_FOUND')) return false;
        throw err;
      },
    );
    await backend.deleteCheckpoint(id);
    return { id, deleted: existed };
  });

  // ---- artifacts --------------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/artifacts/grants`, async (req, reply) => {
    const body = bodyOf(req, schemas.grant.body);
    await backend.getCheckpoint(body.snapshot_id);
    const expiresAt = now() + body.ttl_s * 1000;
    return reply.code(201).send({
      snapshot_id: body.snapshot_id,
      grant: mintGrant(config.grantSecret, body.snapshot_id, expiresAt),
      expires_at: new Date(expiresAt).toISOString(),
    } satisfies Answer<typeof schemas.grant, 201>);
  });

  const checkGrant = (req: FastifyRequest, id: string): void => {
    const m = /^Bearer ([^\s]+)$/.exec(req.headers.authorization ?? '');
    if (!m) throw new AppError('GRANT_INVALID', 401, 'present an artifact grant as "Authorization: Bearer <grant>"');
    const check = verifyGrant(config.grantSecret, m[1] as string, id, now());
    if (check.ok) return;
    if (check.reason === 'expired')
      throw new AppError('GRANT_EXPIRED', 403, 'the artifact grant has expired; ask the source host for a new one');
    if (check.reason === 'wrong_snapshot') throw new AppError('GRANT_INVALID', 403, `the artifact grant is not for snapshot "${id}"`);
    throw new AppError('GRANT_INVALID', 403, 'the artifact grant is not valid for this host');
  };

  app.get(
    `${AGENT_API_PREFIX}/artifacts/:id/manifest`,
    { config: { auth: 'grant' } },
    async (req): Promise<Answer<typeof schemas.manifest, 200>> => {
      const id = paramOf(req, schemas.manifest.params, 'id');
      checkGrant(req, id);
      return buildManifest(backend, id, queryOf(req, schemas.manifest.querystring).chunks === '1');
    },
  );

  app.get(`${AGENT_API_PREFIX}/artifacts/:id/files/:file`, { config: { auth: 'grant' } }, async (req, reply) => {
    const id = paramOf(req, schemas.file.params, 'id');
    checkGrant(req, id);
    const file = paramOf(req, schemas.file.params, 'file');
    const path = await servableFile(backend, id, file);
    const size = (await stat(path)).size;
    void reply.header('accept-ranges', 'bytes').type('application/octet-stream');
    const range = parseRange(req.headers.range, size);
    if (range === 'unsatisfiable') {
      return reply
        .code(416)
        .header('content-range', `bytes */${size}`)
        .send({ code: 'RANGE_NOT_SATISFIABLE', message: `the file is ${size} bytes` });
    }
    if (range) {
      return reply
        .code(206)
        .header('content-range', `bytes ${range.start}-${range.end}/${size}`)
        .header('content-length', range.end - range.start + 1)
        .send(createReadStream(path, { start: range.start, end: range.end, highWaterMark: 1024 * 1024 }));
    }
    return reply.header('content-length', size).send(createReadStream(path, { highWaterMark: 1024 * 1024 }));
  });

  app.post(`${AGENT_API_PREFIX}/artifacts/pull`, async (req): Promise<Answer<typeof schemas.pull, 200>> => {
    const move = bodyOf(req, schemas.pull.body);
    return pullArtifact(backend, {
      snapshotId: move.snapshot_id,
      sourceSnapshotId: move.source_snapshot_id ?? move.snapshot_id,
      digest: move.digest,
      fromUrl: move.from.url,
      grant: move.from.grant,
      files: move.files,
      timeoutMs: config.pullTimeoutMs,
      active: activePulls,
      baseSnapshotId: move.base_snapshot_id,
    });
  });
}
