import { z } from 'zod';
import { ValidationError } from '../../domain/errors.js';

/** Opaque keyset cursors: base64url JSON of the last row's sort key. */
export function encodeCursor(key: unknown): string {
  return Buffer.from(JSON.stringify(key), 'utf8').toString('base64url');
}

export function decodeCursor<T>(cursor: string | undefined, schema: z.ZodType<T>): T | undefined {
  if (cursor === undefined || cursor === '') return undefined;
  try {
    return schema.parse(JSON.parse(Buffer.from(cursor, 'base64url').toString('utf8')));
  } catch {
    throw new ValidationError('cursor is not one this API issued: pass back next_cursor unchanged', [{ path: 'querystring.cursor', message: 'malformed' }], 'INVALID_CURSOR');
  }
}

export const pageQuery = {
  limit: z.coerce.number().int().min(1).max(500).default(50),
  cursor: z.string().max(512).optional(),
};
