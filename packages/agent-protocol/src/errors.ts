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
