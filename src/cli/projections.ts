import { loadConfig, ConfigError } from '../adapters/config.js';
import { createLogger } from '../adapters/logger.js';
import { runMigrations } from '../adapters/postgres/migrations.js';
import { PROJECTIONS } from '../adapters/service.js';
import { rebuildProjection } from '../projections/rebuild.js';
import { CHECKPOINTS_MIGRATION } from '../projections/runner.js';
import { connectForCli } from './connect.js';

const USAGE = `usage: npm run projections -- rebuild [NAME ...] [--verify]
       npm run projections -- status

rebuild           drop and rebuild read models from position zero (all when no NAME)
rebuild --verify  rebuild into a shadow copy and compare it row by row with the live
                  tables, without touching them; exits 1 when any drift is found
status            each read model's checkpoint and event count
read models: ${PROJECTIONS.map((p) => p.name).join(', ')}`;

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  if (!cmd || cmd === '--help' || cmd === '-h') {
    process.stdout.write(`${USAGE}\n`);
    return cmd ? 0 : 2;
  }
  const config = loadConfig();
  const logger = createLogger(process.env.LOG_LEVEL ?? 'warn', 'fleet-cli');
  const conn = await connectForCli(config, logger);
  try {
    await runMigrations(conn.pool, [CHECKPOINTS_MIGRATION, ...PROJECTIONS.flatMap((p) => p.migrations)], { logger });
    if (cmd === 'status') {
      const { rows } = await conn.pool.query<{ name: string; position: string | null; events_applied: string; last_event_at: Date | null }>(
        'SELECT name, position, events_applied, last_event_at FROM projection_checkpoints ORDER BY name',
      );
      for (const r of rows)
        process.stdout.write(
          `${r.name.padEnd(16)} position ${r.position ?? '(start)'}  events ${r.events_applied}  last event ${r.last_event_at?.toISOString() ?? '-'}\n`,
        );
      return 0;
    }
    if (cmd !== 'rebuild') {
      process.stderr.write(`unknown command ${JSON.stringify(cmd)}\n${USAGE}\n`);
      return 2;
    }
    const verify = rest.includes('--verify');
    const names = rest.filter((a) => !a.startsWith('--'));
    const unknown = names.filter((n) => !PROJECTIONS.some((p) => p.name === n));
    if (unknown.length > 0) {
      process.stderr.write(`unknown read model(s): ${unknown.join(', ')}; known: ${PROJECTIONS.map((p) => p.name).join(', ')}\n`);
      return 2;
    }
    let drifted = false;
    for (const p of PROJECTIONS.filter((x) => names.length === 0 || names.includes(x.name))) {
      process.stdout.write(`${verify ? 'verifying' : 'rebuilding'} ${p.name}…\n`);
      let last = 0;
      const report = await rebuildProjection(conn.store, conn.pool, p, {
        verify,
        onProgress: (n) => {
          if (n - last >= 10_000) {
            last = n;
            process.stdout.write(`  ${p.name}: ${n} events\n`);
          }
        },
      });
      const rate = report.seconds > 0 ? Math.round(report.events / report.seconds) : report.events;
      process.stdout.write(`  ${p.name}: ${report.events} events in ${report.seconds.toFixed(2)} s (${rate}/s), ${report.mode}\n`);
      for (const d of report.drift) {
        const ok = d.onlyLive === 0 && d.onlyRebuilt === 0;
        if (!ok) drifted = true;
        process.stdout.write(
          `  ${d.table}: ${ok ? 'no drift' : `DRIFT: ${d.onlyLive} live-only row(s), ${d.onlyRebuilt} rebuilt-only row(s), e.g. ${d.sampleKeys.join(', ')}`}\n`,
        );
      }
    }
    return drifted ? 1 : 0;
  } finally {
    await conn.close();
  }
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(`${err instanceof ConfigError ? err.message : err instanceof Error ? err.message : String(err)}\n`);
    process.exit(1);
  },
);
