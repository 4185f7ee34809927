import { z } from 'zod';
import { ValidationError } from '@fleet/agent-protocol';
import { nulPath } from './common.js';

/** Opaque keyset cursors: base64url JSON of the last row's sort key. */
export function encodeCursor(key: unknown): string {
  return Buffer.from(JSON.stringify(key), 'utf8').toString('base64url');
}

export function decodeCursor<T>(cursor: string | undefined, schema: z.ZodType<T>): T | undefined {
  if (cursor === undefined || cursor === '') return undefined;
  const invalid = new ValidationError(
    'cursor is not one this API issued: pass back next_cursor unchanged',
    [{ path: 'querystring.cursor', message: 'malformed' }],
    'INVALID_CURSOR',
  );
  let key: T;
  try {
    key = schema.parse(JSON.parse(Buffer.from(cursor, 'base64url').toString('utf8')));
  } catch {
    throw invalid;
  }
  // Its strings go to SQL as they are: Postgres refuses a NUL in text.
  if (nulPath(key, 'cursor')) throw invalid;
  return key;
}

/** A time in a cursor, exactly as the API writes it (toISOString of a stored time): anything else would fail in SQL, not here. */
export const cursorTime = z.string().refine((v) => {
  const d = new Date(v);
  return !Number.isNaN(d.getTime()) && d.getUTCFullYear() >= 1 && d.toISOString() === v;
});

export const pageQuery = {
  limit: z.coerce.number().int().min(1).max(500).default(50),
  cursor: z.string().max(512).optional(),
};
