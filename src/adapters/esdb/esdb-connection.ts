import {
  AccessDeniedError,
  CancelledError,
  DeadlineExceededError,
  InvalidArgumentError,
  NotLeaderError,
  UnavailableError,
} from '@eventstore/db-client';
import { ValidationError } from '@fleet/agent-protocol';

export function isUnavailable(err: unknown): boolean {
  if (
    err instanceof UnavailableError ||
    err instanceof DeadlineExceededError ||
    err instanceof CancelledError ||
    err instanceof NotLeaderError
  )
    return true;
  const code = (err as { code?: unknown } | null)?.code;
  if (code === 14 || code === 4) return true; // raw gRPC UNAVAILABLE / DEADLINE_EXCEEDED
  return err instanceof Error && /discover|ECONNREFUSED|ENOTFOUND|no connection|no answer within/i.test(err.message);
}

export function isFatal(err: unknown): boolean {
  return err instanceof AccessDeniedError || err instanceof InvalidArgumentError;
}

export function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/** Options the client understands (lowercase), minus those that would change the adapter's contract. */
const KNOWN_OPTIONS = new Set(
  [
    'connectionName',
    'defaultDeadline',
    'discoveryInterval',
    'dnsDiscover',
    'gossipTimeout',
    'keepAliveInterval',
    'keepAliveTimeout',
    'maxDiscoverAttempts',
    'nodePreference',
    'tls',
    'tlsCAFile',
    'tlsVerifyCert',
    'userCertFile',
    'userKeyFile',
  ].map((k) => k.toLowerCase()),
);

/**
 * The client only warns about an unknown option, and its warning prints the
 * whole connection string, password included; so unknown options are refused
 * here, by name. `throwOnAppendFailure=false` would turn conflicts into
 * silent non-appends.
 */
export function checkOptionKeys(connectionString: string): void {
  const query = connectionString.split('?')[1];
  if (query === undefined) return;
  for (const pair of query.split('&')) {
    const key = pair.split('=')[0] ?? '';
    if (key === '') continue;
    if (key.toLowerCase() === 'throwonappendfailure')
      throw invalidUrl('the option throwOnAppendFailure is not supported: the adapter needs conflicts as errors');
    if (!KNOWN_OPTIONS.has(key.toLowerCase())) throw invalidUrl(`unknown option ${JSON.stringify(key.slice(0, 40))}`);
  }
}

export function invalidUrl(why: string): ValidationError {
  return new ValidationError(
    `EVENTSTORE_URL is not a valid EventStoreDB connection string: ${why}; expected esdb://host:2113?tls=false or esdb+discover://host1:2113,host2:2113`,
    [{ path: 'EVENTSTORE_URL', message: why }],
    'INVALID_EVENTSTORE_URL',
  );
}

export function redactCredentials(message: string, connectionString: string): string {
  const userinfo = /^esdb(?:\+discover)?:\/\/([^@/]*)@/.exec(connectionString)?.[1];
  if (!userinfo) return message;
  let out = message;
  for (const secret of [userinfo, ...userinfo.split(':')]) if (secret.length >= 3) out = out.split(secret).join('***');
  return out;
}

/** host:port list of a connection string, without credentials or query. */
export function describeEndpoint(connectionString: string): string {
  const match = /^esdb(?:\+discover)?:\/\/(?:[^@/]*@)?([^/?]+)/.exec(connectionString);
  return match?.[1] ?? '(unparsable EVENTSTORE_URL)';
}
