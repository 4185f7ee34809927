import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import { hasZodFastifySchemaValidationErrors, isResponseSerializationError } from 'fastify-type-provider-zod';
import { AppError, describeFields, type FieldError } from '@fleet/agent-protocol';

/** RFC 7807 problem document; `code` is the stable, machine-readable part. */
export interface Problem {
  type: string;
  title: string;
  status: number;
  code: string;
  detail: string;
  instance?: string;
  errors?: FieldError[];
  [extension: string]: unknown;
}

export function problem(status: number, code: string, detail: string, extra: Record<string, unknown> = {}): Problem {
  return {
    type: `https://fleet.dev/problems/${code.toLowerCase().replace(/_/g, '-')}`,
    title: titleFor(status),
    status,
    code,
    detail,
    ...extra,
  };
}

function titleFor(status: number): string {
  switch (status) {
    case 400:
      return 'Bad Request';
    case 401:
      return 'Unauthorized';
    case 403:
      return 'Forbidden';
    case 404:
      return 'Not Found';
    case 405:
      return 'Method Not Allowed';
    case 409:
      return 'Conflict';
    case 413:
      return 'Payload Too Large';
    case 415:
      return 'Unsupported Media Type';
    case 422:
      return 'Unprocessable Entity';
    case 429:
      return 'Too Many Requests';
    case 502:
      return 'Bad Gateway';
    case 503:
      return 'Service Unavailable';
    case 504:
      return 'Gateway Timeout';
    default:
      return status >= 500 ? 'Internal Server Error' : 'Error';
  }
}

/** Fastify's own client errors under our names: a framework upgrade must not change a code clients match on. */
const FASTIFY_CODES: Record<string, string> = {
  FST_ERR_CTP_INVALID_JSON_BODY: 'MALFORMED_JSON',
  FST_ERR_CTP_EMPTY_JSON_BODY: 'EMPTY_BODY',
  FST_ERR_CTP_INVALID_MEDIA_TYPE: 'UNSUPPORTED_MEDIA_TYPE',
  FST_ERR_CTP_BODY_TOO_LARGE: 'PAYLOAD_TOO_LARGE',
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: 'INVALID_CONTENT_LENGTH',
};

/**
 * The one error handler. Typed errors become their problem; fastify's own
 * client errors (bad JSON, wrong content type, body too large) keep their
 * 4xx status; anything else is logged in full and answered with a 500 that
 * says nothing of its insides.
 */
export function errorHandler(err: FastifyError | Error, req: FastifyRequest, reply: FastifyReply): void {
  const send = (p: Problem): void => {
    void reply
      .status(p.status)
      .type('application/problem+json')
      .send({ ...p, instance: req.url.split('?')[0] });
  };
  if (hasZodFastifySchemaValidationErrors(err)) {
    const where = (err as FastifyError).validationContext ?? 'request';
    const errors: FieldError[] = err.validation.map((v) => ({
      path: `${where}${v.instancePath ? v.instancePath.replace(/\//g, '.') : ''}`,
      message: v.message ?? 'invalid',
    }));
    send(problem(400, 'VALIDATION_FAILED', `invalid ${where}: ${describeFields(errors)}`, { errors }));
    return;
  }
  if (err instanceof AppError) {
    if (err.status >= 500) req.log.warn({ err: { code: err.code, message: err.message } }, 'request failed on a dependency');
    const fields = (err.details?.fields as FieldError[] | undefined) ?? undefined;
    const { fields: _omit, ...details } = err.details ?? {};
    send(
      problem(err.status, err.code, err.message, {
        ...(fields ? { errors: fields } : {}),
        ...(Object.keys(details).length ? { details } : {}),
      }),
    );
    return;
  }
  if (isResponseSerializationError(err)) {
    req.log.error({ err, issues: err.cause.issues }, 'response did not match its schema');
    send(problem(500, 'INTERNAL', 'internal error'));
    return;
  }
  const fe = err as FastifyError;
  if (typeof fe.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
    send(
      problem(
        fe.statusCode,
        (fe.code && FASTIFY_CODES[fe.code]) ?? (fe.code ? fe.code.replace(/^FST_ERR_/, '') : 'BAD_REQUEST'),
        fe.message,
      ),
    );
    return;
  }
  req.log.error({ err }, 'unhandled error');
  send(problem(500, 'INTERNAL', 'internal error'));
}
