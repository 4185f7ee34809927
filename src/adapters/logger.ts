import { pino, type Logger, type LoggerOptions } from 'pino';

/**
 * JSON logs, pretty in a TTY. Secrets never reach a log line: every path
 * below is redacted wherever it appears (request headers, config dumps,
 * agent-client errors).
 */
export const REDACT_PATHS = [
  'token',
  '*.token',
  'authorization',
  '*.authorization',
  'req.headers.authorization',
  'headers.authorization',
  'password',
  '*.password',
  'apiKey',
  '*.apiKey',
  'tokenEncryptionKey',
  '*.tokenEncryptionKey',
  // A VM's secrets and what may carry credentials, should a request body or spec ever be logged.
  'secrets',
  '*.secrets',
  '*.*.secrets',
  'env',
  '*.env',
  'startup_script',
  '*.startup_script',
  '*.*.startup_script',
];

export function loggerOptions(level: string, name = 'fleet'): LoggerOptions {
  const options: LoggerOptions = {
    name,
    level,
    redact: { paths: REDACT_PATHS, censor: '[redacted]' },
  };
  if (process.stdout.isTTY && process.env.NODE_ENV !== 'production') {
    options.transport = { target: 'pino-pretty', options: { colorize: true, translateTime: 'SYS:HH:MM:ss.l', ignore: 'pid,hostname' } };
  }
  return options;
}

export function createLogger(level: string, name = 'fleet'): Logger {
  return pino(loggerOptions(level, name));
}

export type { Logger };
