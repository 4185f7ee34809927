import type { z } from 'zod';
import { validationErrorFrom } from '@fleet/agent-protocol';

/** Parses a request part (body, query, param, websocket frame) or throws one ValidationError naming every bad field. */
export function parse<S extends z.ZodType>(schema: S, value: unknown, what: string): z.output<S> {
  const r = schema.safeParse(value);
  if (r.success) return r.data;
  throw validationErrorFrom(r.error, what, { bareRoot: true });
}
