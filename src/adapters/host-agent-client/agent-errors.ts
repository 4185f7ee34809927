import { AppError, ConflictError, NotFoundError, ValidationError, type FieldError } from '@fleet/agent-protocol';
import { HostAgentError, HostCapacityError } from '../../domain/host-agent.port.js';

/** Maps an agent's error answer back to the AppError subclass the control plane understands. */
export function errorFromAgent(
  status: number,
  body: { code: string; message: string; details?: Record<string, unknown> } | undefined,
  what: string,
  hostId: string,
): AppError {
  const code = body?.code;
  const message = body?.message ?? `HTTP ${status}`;
  const details: Record<string, unknown> = { ...(body?.details ?? {}), host_id: hostId };
  if (code === 'HOST_CAPACITY_EXHAUSTED') return new HostCapacityError(`host ${hostId} refused for capacity: ${message}`, details);
  if (status >= 500 || !code) {
    return new HostAgentError(`${what} failed with ${status}${code ? ` ${code}` : ''}: ${message}`, {
      ...details,
      agent_code: code,
      agent_status: status,
    });
  }
  // The agent refusing our token means the host is misregistered, not that the control plane's caller is unauthorized.
  if (status === 401 && code === 'UNAUTHORIZED') {
    return new HostAgentError(`${what} was refused: the host agent did not accept the control plane's token`, {
      ...details,
      agent_code: code,
      agent_status: status,
    });
  }
  if (status === 404) return new NotFoundError(code, message, details);
  if (status === 409) return new ConflictError(code, message, details);
  if (status === 400 && code === 'VALIDATION_FAILED') {
    const fields = Array.isArray(details.fields) ? (details.fields as FieldError[]) : [];
    return new ValidationError(message, fields, code);
  }
  return new AppError(code, status, message, details);
}

export function statusForCode(code: string): number {
  if (code.endsWith('_NOT_FOUND')) return 404;
  if (code === 'VM_NOT_RUNNING' || code === 'VM_EXISTS') return 409;
  if (code === 'HOST_CAPACITY_EXHAUSTED') return 409;
  if (code === 'AGENT_ERROR') return 500;
  return 400;
}

export function fileTooLarge(size: number, maxBytes: number): AppError {
  return new AppError(
    'FILE_TOO_LARGE',
    413,
    `the file is ${size} bytes, more than the ${maxBytes} bytes a transfer may move (FILE_MAX_BYTES)`,
    { size_bytes: size, max_bytes: maxBytes },
  );
}
