/**
 * Typed errors with a stable string code and an HTTP status. Codes survive
 * process boundaries where `instanceof` does not: the host agent answers with
 * the same codes and the client maps them back (`errorFromAgent` in src/adapters/host-agent.client.ts).
 */
export class AppError extends Error {
  readonly code: string;
  readonly status: number;
  readonly details: Readonly<Record<string, unknown>> | undefined;

  constructor(code: string, status: number, message: string, details?: Record<string, unknown>, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
    this.status = status;
    this.details = details;
  }
}

/** One field that failed validation, as listed in a 400 problem response. */
export interface FieldError {
  readonly path: string;
  readonly message: string;
}

export class ValidationError extends AppError {
  readonly fields: readonly FieldError[];
  constructor(message: string, fields: readonly FieldError[] = [], code = 'VALIDATION_FAILED') {
    super(code, 400, message, { fields });
    this.fields = fields;
  }
}

/** What a failed zod parse reports (zod's own ZodError fits): kept structural so this module needs no zod import. */
export interface ZodIssues {
  readonly issues: ReadonlyArray<{ readonly path: ReadonlyArray<PropertyKey>; readonly message: string }>;
}

/** How an issue path is named in a message: `a.b.0` unless a caller names fields its own way. */
export type IssuePathFormat = (path: ReadonlyArray<PropertyKey>) => string;

export const dottedPath: IssuePathFormat = (path) => path.map(String).join('.');

/** One FieldError per zod issue. */
export function fieldsFromZod(error: ZodIssues, formatPath: IssuePathFormat = dottedPath): FieldError[] {
  return error.issues.map((i) => ({ path: formatPath(i.path), message: i.message }));
}

/** `path: message; path: message`; with `bareRoot`, an issue at the root is its message alone. */
export function describeFields(fields: readonly FieldError[], opts: { bareRoot?: boolean } = {}): string {
  return fields.map((f) => (opts.bareRoot && !f.path ? f.message : `${f.path}: ${f.message}`)).join('; ');
}

/** The one conversion of a failed zod parse into a 400: `invalid <what>: <every bad field>`, each field listed. */
export function validationErrorFrom(
  error: ZodIssues,
  what: string,
  opts: { code?: string; formatPath?: IssuePathFormat; bareRoot?: boolean } = {},
): ValidationError {
  const fields = fieldsFromZod(error, opts.formatPath);
  return new ValidationError(`invalid ${what}: ${describeFields(fields, opts)}`, fields, opts.code);
}

export class NotFoundError extends AppError {
  constructor(code: string, message: string, details?: Record<string, unknown>) {
    super(code, 404, message, details);
  }
}

export class ConflictError extends AppError {
  constructor(code: string, message: string, details?: Record<string, unknown>) {
    super(code, 409, message, details);
  }
}

export class UnauthorizedError extends AppError {
  constructor(message = 'a valid bearer token is required') {
    super('UNAUTHORIZED', 401, message);
  }
}

export class ForbiddenError extends AppError {
  constructor(message = 'this key may not do that') {
    super('FORBIDDEN', 403, message);
  }
}

/** A dependency (event store, database, host agent) could not be reached or answered wrongly. */
export class UnavailableError extends AppError {
  constructor(code: string, message: string, details?: Record<string, unknown>, options?: { cause?: unknown }) {
    super(code, 503, message, details, options);
  }
}
