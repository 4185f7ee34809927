import { loadConfig, ConfigError } from '../adapters/config.js';
import { parseAsOf, redactSealed, toAuditEntry, vmAsOf, type AuditEntry } from '../adapters/http/audit.routes.js';
import { createLogger } from '../adapters/logger.js';
import { readSecrets, secretsFile } from '../adapters/secrets.js';
import { resolve } from 'node:path';
import { AppError } from '@fleet/agent-protocol';
import { assertStreamName, type JsonValue } from '../domain/event-store.port.js';
import { connectForCli } from './connect.js';

const USAGE = `usage: npm run fleet -- audit <stream> [--as-of <time|position>] [--json]
       npm run fleet -- vm <id> --as-of <time|position> [--json]
       npm run fleet -- keys [--json]

audit   the full history of one stream (vm-<id>, host-<id>, snapshot-<id>, tenant-<id>):
        time, type, revision, position, actor, correlation and causation ids, data
        (sealed fields stay sealed); --as-of stops at that time or position
vm      the VM as it was at that time or position, folded from its own events
keys    the keys the embedded default generated (DATA_DIR/secrets.json): the admin key and the
        demo tenant's key; the service prints them only on the start that generates them
--as-of an ISO-8601 time (2026-01-01T12:00:00Z) or a position as the API returns it`;

function flag(args: string[], name: string): string | undefined {
  const i = args.indexOf(name);
  if (i < 0) return undefined;
  const v = args[i + 1];
  if (v === undefined || v.startsWith('--')) throw new AppError('USAGE', 2, `${name} needs a value\n${USAGE}`);
  args.splice(i, 2);
  return v;
}

function short(data: unknown): string {
  const text = JSON.stringify(data);
  return text.length > 240 ? `${text.slice(0, 237)}...` : text;
}

function printEntry(e: AuditEntry): void {
  process.stdout.write(
    `#${e.revision.padStart(4)}  ${e.time}  ${e.type}${e.end_reason ? `  reason ${e.end_reason}` : ''}\n` +
      `       position ${e.position}  actor ${e.actor ?? '-'}  tenant ${e.tenant_id ?? '-'}\n` +
      `       correlation ${e.correlation_id ?? '-'}  causation ${e.causation_id ?? '-'}\n` +
      `       ${short(e.data)}\n`,
  );
}

async function main(argv: string[]): Promise<number> {
  const args = [...argv];
  const cmd = args.shift();
  if (!cmd || cmd === '--help' || cmd === '-h') {
    process.stdout.write(`${USAGE}\n`);
    return cmd ? 0 : 2;
  }
  if (cmd === 'keys') return keys(args);
  if (cmd !== 'audit' && cmd !== 'vm') {
    process.stderr.write(`unknown command ${JSON.stringify(cmd)}\n${USAGE}\n`);
    return 2;
  }
  const asOfText = flag(args, '--as-of');
  const json = args.includes('--json');
  const [target, ...extra] = args.filter((a) => a !== '--json');
  if (!target || extra.length > 0) {
    process.stderr.write(`${cmd} takes exactly one ${cmd === 'audit' ? 'stream' : 'VM id'}\n${USAGE}\n`);
    return 2;
  }
  if (cmd === 'vm' && asOfText === undefined) {
    process.stderr.write(`vm needs --as-of (the live VM is at GET /v1/vms/<id>)\n${USAGE}\n`);
    return 2;
  }
  const config = loadConfig();
  const logger = createLogger(process.env.LOG_LEVEL ?? 'warn', 'fleet-cli');
  const conn = await connectForCli(config, logger);
  try {
    const asOf = asOfText !== undefined ? parseAsOf(conn.store, asOfText) : undefined;
    if (cmd === 'audit') {
      assertStreamName(target);
      let events = (await conn.store.readStream(target)).map(toAuditEntry);
      if (asOf)
        events = events.filter((e) => ('position' in asOf ? e.position <= asOf.position : Date.parse(e.time) <= asOf.time.getTime()));
      if (events.length === 0) {
        process.stderr.write(`stream ${target} has no events${asOfText ? ` up to ${asOfText}` : ''}\n`);
        return 1;
      }
      if (json) process.stdout.write(`${JSON.stringify({ stream: target, events }, null, 2)}\n`);
      else {
        process.stdout.write(`${target}: ${events.length} event(s)${asOfText ? ` up to ${asOfText}` : ''}\n`);
        for (const e of events) printEntry(e);
      }
      return 0;
    }
    // `vm` without --as-of was refused above.
    if (!asOf) return 2;
    const then = await vmAsOf(conn.store, target, asOf);
    if (!then) {
      process.stderr.write(`vm ${target} did not exist at ${asOfText}\n`);
      return 1;
    }
    const s = then.state;
    if (json) {
      process.stdout.write(`${JSON.stringify(redactSealed(JSON.parse(JSON.stringify(s)) as JsonValue), null, 2)}\n`);
      return 0;
    }
    const lines: Array<[string, string | undefined]> = [
      ['vm', s.vm_id],
      ['as of', `${asOfText} (${then.events} event(s) folded)`],
      ['state', s.status],
      ['tenant', s.tenant_id],
      ['task', s.task_id],
      ['host', s.host_id],
      ['url', s.url],
      ['requested', s.requested_at],
      ['last change', s.transitioned_at],
      ['boot', s.boot_ms !== undefined ? `${s.boot_ms} ms` : undefined],
      [
        'spec',
        `${s.spec.cpus} CPU, ${s.spec.ram_mb} MB RAM, ${s.spec.storage_gb} GB disk${s.spec.gpus > 0 ? `, ${s.spec.gpus} GPU ${s.spec.gpu_kind ?? ''}` : ''}`,
      ],
      ['reason', s.status === 'destroyed' || s.status === 'failed' ? s.reason : s.status === 'destroying' ? s.destroy_reason : undefined],
      ['error', s.status === 'failed' ? `${s.error}${s.error_code ? ` (${s.error_code})` : ''} during ${s.phase}` : undefined],
    ];
    for (const [k, v] of lines) if (v !== undefined) process.stdout.write(`${k.padEnd(12)} ${v}\n`);
    return 0;
  } finally {
    await conn.close();
  }
}

async function keys(args: string[]): Promise<number> {
  const config = loadConfig();
  const dataDir = resolve(config.DATA_DIR);
  const secrets = await readSecrets(dataDir);
  if (!secrets) {
    process.stderr.write(`${secretsFile(dataDir)} does not exist: the keys are generated by the first npm start on this DATA_DIR\n`);
    return 1;
  }
  const shown = {
    admin_api_key: config.ADMIN_API_KEY ? '(ADMIN_API_KEY is set in the environment)' : secrets.admin_api_key,
    demo_api_key: secrets.demo_api_key,
  };
  if (args.includes('--json')) process.stdout.write(`${JSON.stringify(shown, null, 2)}\n`);
  else
    process.stdout.write(
      `admin key:       ${shown.admin_api_key}\ndemo tenant key: ${shown.demo_api_key}\n(from ${secretsFile(dataDir)})\n`,
    );
  return 0;
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err: unknown) => {
    if (err instanceof AppError && err.code === 'USAGE') {
      process.stderr.write(`${err.message}\n`);
      process.exit(2);
    }
    process.stderr.write(
      `${err instanceof ConfigError ? err.message : err instanceof AppError ? `${err.code}: ${err.message}` : err instanceof Error ? err.message : String(err)}\n`,
    );
    process.exit(1);
  },
);
