import type { FastifyRequest } from 'fastify';
import type { z } from 'zod';
import { checkpointIdSchema, vmNameSchema } from '@fleet/agent-protocol';
import { parse } from '../parse.js';

/**
 * A route's request and response schemas, declared once beside the route:
 * each request part with the name its 400 uses, each response by status.
 * The handler parses the parts itself, in the order it needs them (a
 * grant is checked between two params, a body is drained when its query
 * is refused), through the helpers below; responses type its answers.
 */
export interface RouteSchema {
  readonly params?: Readonly<Record<string, Part>>;
  readonly querystring?: Part;
  readonly body?: Part;
  readonly response: Readonly<Record<number, z.ZodType>>;
}

/** One request part: its schema, the name its errors use, and what an absent body counts as. */
export interface Part<S extends z.ZodType = z.ZodType> {
  readonly schema: S;
  readonly what: string;
  readonly absent?: z.input<S>;
}

export function part<S extends z.ZodType>(schema: S, what: string, opts: { absent?: z.input<S> } = {}): Part<S> {
  return { schema, what, ...opts };
}

/** The `:name` of every sandbox route. */
export const sandboxName = part(vmNameSchema, 'sandbox name');
/** The `:id` of every checkpoint and artifact route. */
export const checkpointId = part(checkpointIdSchema, 'checkpoint id');

/** One path parameter, parsed by its part. */
export function paramOf<P extends Readonly<Record<string, Part>>, K extends keyof P & string>(
  req: FastifyRequest,
  params: P,
  key: K,
): z.output<P[K]['schema']> {
  const p = params[key] as P[K];
  return parse<P[K]['schema']>(p.schema, (req.params as Record<string, unknown> | undefined)?.[key], p.what);
}

export function queryOf<Q extends Part>(req: FastifyRequest, q: Q): z.output<Q['schema']> {
  return parse<Q['schema']>(q.schema, req.query, q.what);
}

export function bodyOf<B extends Part>(req: FastifyRequest, b: B): z.output<B['schema']> {
  return parse<B['schema']>(b.schema, b.absent !== undefined ? (req.body ?? b.absent) : req.body, b.what);
}

/** What a route answers with `status` (a protocol schema's input: what the handler builds). */
export type Answer<R extends RouteSchema, S extends keyof R['response']> = z.input<R['response'][S]>;
