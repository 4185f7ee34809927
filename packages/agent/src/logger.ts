import { pino, type Logger, type LoggerOptions } from 'pino';

/**
 * The agent's pino options. Request logs carry method, url and status only
 * (fastify's default serializers never log headers), and these paths are
 * redacted wherever a log object happens to carry them, so neither the
 * host token nor an artifact grant reaches a log line.
 */
export const AGENT_REDACT_PATHS = [
  'token',
  '*.token',
  'grant',
  '*.grant',
  'authorization',
  '*.authorization',
  'req.headers.authorization',
  'headers.authorization',
  'from.grant',
  '*.from.grant',
  'grantSecret',
  '*.grantSecret',
];

export function agentLoggerOptions(level: string): LoggerOptions {
  const options: LoggerOptions = { name: 'fleet-agent', level, redact: { paths: AGENT_REDACT_PATHS, censor: '[redacted]' } };
  if (process.stdout.isTTY && process.env.NODE_ENV !== 'production') {
    options.transport = { target: 'pino-pretty', options: { colorize: true, translateTime: 'SYS:HH:MM:ss.l', ignore: 'pid,hostname' } };
  }
  return options;
}

export function createAgentLogger(level: string): Logger {
  return pino(agentLoggerOptions(level));
}

export type { Logger };
