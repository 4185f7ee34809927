import { readFileSync } from 'node:fs';
import { AppError } from '@fleet/agent-protocol';
import type { Backend } from './backend.js';
import { AgentConfigError, imageDirFromEnv, loadAgentConfig, type AgentConfig } from './config.js';
import { buildImage, listImages } from './images.js';
import { createAgentLogger, type Logger } from './logger.js';
import { buildAgentApp } from './server.js';

/**
 * The host agent program: `serve` (default) listens until SIGTERM/SIGINT;
 * `image build NAME [--force]` and `image list` manage the image directory.
 */

const USAGE = `usage: fleet-agent [serve]
       fleet-agent image build NAME [--force] [--busybox PATH] [--backend process|qemu]
       fleet-agent image list [--backend process|qemu]
Configuration comes from AGENT_* environment variables (docs/host-agent.md).`;

const VERSION = (() => {
  try {
    return (JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')) as { version?: string }).version ?? '0';
  } catch {
    return '0';
  }
})();

async function openBackend(config: AgentConfig, logger: Logger): Promise<Backend> {
  if (config.backend === 'qemu') {
    const { QemuBackend } = await import('./backend/qemu/qemu-backend.js');
    return QemuBackend.open({
      dataDir: config.dataDir,
      imageDir: config.imageDir,
      subnet: config.subnet,
      bridgePrefix: config.bridgePrefix,
      maxSandboxes: config.maxVms,
      allowCrossTenant: config.allowCrossTenant,
      publishHost: config.publishHost,
      defaultImage: config.defaultImage,
      accel: config.qemuAccel,
      bootTimeoutMs: config.qemuBootTimeoutMs,
      sysfsRoot: config.sysfsRoot,
      devRoot: config.devRoot,
      consoleLogMaxBytes: config.consoleLogMaxBytes,
      logger: logger.child({ component: 'backend' }),
    });
  }
  // Loaded lazily: `image build` must work on a host where the backend's kernel features are missing.
  const { ProcessBackend } = await import('./backend/process/process-backend.js');
  return ProcessBackend.open({
    dataDir: config.dataDir,
    imageDir: config.imageDir,
    subnet: config.subnet,
    bridgePrefix: config.bridgePrefix,
    maxSandboxes: config.maxVms,
    allowCrossTenant: config.allowCrossTenant,
    publishHost: config.publishHost,
    defaultImage: config.defaultImage,
    uidBase: config.uidBase,
    consoleLogMaxBytes: config.consoleLogMaxBytes,
    metricsIntervalMs: config.metricsIntervalMs,
    metricsWindow: config.metricsWindow,
    oomPollMs: config.oomPollMs,
    logRetentionMs: config.logRetentionMs,
    egressProxyPort: config.egressProxyPort,
    egressAllowPrivate: config.egressAllowPrivate,
    egressDnsServers: config.egressDnsServers,
    diskPool: config.diskPool,
    diskPoolGb: config.diskPoolGb,
    lazyRestore: config.lazyRestore,
    logger: logger.child({ component: 'backend' }),
  });
}

async function serve(): Promise<void> {
  let config: AgentConfig;
  try {
    config = loadAgentConfig();
  } catch (err) {
    if (err instanceof AgentConfigError) {
      process.stderr.write(`${err.message}\n`);
      process.exit(2);
    }
    throw err;
  }
  const logger = createAgentLogger(config.logLevel);
  let backend: Backend;
  try {
    backend = await openBackend(config, logger);
  } catch (err) {
    logger.fatal({ err: describeErr(err) }, 'the sandbox backend could not start');
    process.exitCode = 1;
    await flush(logger);
    process.exit(1);
  }
  const app = await buildAgentApp({ backend, config, logger, version: VERSION });
  const url = await app.listen({ host: config.host, port: config.port });
  const { port } = app.server.address() as { port: number };
  // Always printed, whatever the level: supervisors and tests read the port from it.
  logger.child({}, { level: 'info' }).info({ url, port, backend: backend.kind, data_dir: config.dataDir }, 'host agent listening');

  let closing = false;
  const shutdown = (signal: string) => {
    if (closing) {
      logger.warn({ signal }, 'second signal: exiting now');
      process.exit(1);
    }
    closing = true;
    logger.info({ signal }, 'shutting down; sandboxes keep running');
    // Bounded: a stuck websocket or pull must not keep a stopping agent alive.
    setTimeout(() => process.exit(1), 10_000).unref();
    void (async () => {
      try {
        await app.close();
        await backend.close();
      } catch (err) {
        logger.error({ err: describeErr(err) }, 'shutdown failed');
        process.exitCode = 1;
      }
      await flush(logger);
      process.exit();
    })();
  };
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  // A stray rejection is a bug to see in the logs, not a reason to abandon the host's sandboxes' API.
  process.on('unhandledRejection', (reason) => logger.error({ err: describeErr(reason) }, 'unhandled promise rejection'));
  process.on('SIGINT', () => shutdown('SIGINT'));
}

async function image(args: string[]): Promise<void> {
  const [sub, name, ...flags] = args;
  const imageDir = imageDirFromEnv();
  const all = [name, ...flags].filter((f): f is string => f !== undefined);
  const bk = all.indexOf('--backend');
  const kind = bk >= 0 ? all[bk + 1] : (process.env.AGENT_BACKEND ?? 'process');
  if (kind !== 'process' && kind !== 'qemu') {
    process.stderr.write(`--backend must be process or qemu (got "${kind}")\n${USAGE}\n`);
    process.exit(2);
  }
  if (kind === 'qemu') {
    const { buildQemuImage, listQemuImages } = await import('./backend/qemu/image.js');
    if (sub === 'list') {
      for (const n of await listQemuImages(imageDir)) process.stdout.write(`${n}\n`);
      return;
    }
    if (sub === 'build' && name && name !== '--backend') {
      const bi = flags.indexOf('--busybox');
      const busybox = bi >= 0 ? flags[bi + 1] : undefined;
      const started = Date.now();
      const img = await buildQemuImage(imageDir, name, { force: flags.includes('--force'), ...(busybox ? { busybox } : {}) });
      process.stdout.write(`built VM image ${img.name} (kernel ${img.kernelVersion}) at ${img.dir} in ${Date.now() - started} ms\n`);
      return;
    }
    process.stderr.write(`${USAGE}\n`);
    process.exit(2);
  }
  if (sub === 'list') {
    for (const img of await listImages(imageDir)) process.stdout.write(`${img.name}\t${img.path}\n`);
    return;
  }
  if (sub === 'build' && name) {
    const bi = flags.indexOf('--busybox');
    const busybox = bi >= 0 ? flags[bi + 1] : undefined;
    const info = await buildImage(imageDir, name, { force: flags.includes('--force'), ...(busybox ? { busybox } : {}) });
    process.stdout.write(`built image ${info.name} at ${info.path}\n`);
    return;
  }
  process.stderr.write(`${USAGE}\n`);
  process.exit(2);
}

function describeErr(err: unknown): Record<string, unknown> {
  if (err instanceof AppError) return { code: err.code, message: err.message, details: err.details };
  const e = err as Partial<Error> | null | undefined;
  return { message: e?.message ?? String(err), stack: e?.stack };
}

function flush(logger: Logger): Promise<void> {
  return new Promise((resolve) => logger.flush(() => resolve()));
}

async function main(argv: string[]): Promise<void> {
  const [cmd, ...rest] = argv;
  if (cmd === undefined || cmd === 'serve') return serve();
  if (cmd === 'image') return image(rest);
  if (cmd === '--help' || cmd === '-h' || cmd === 'help') {
    process.stdout.write(`${USAGE}\n`);
    return;
  }
  process.stderr.write(`unknown command "${cmd}"\n${USAGE}\n`);
  process.exit(2);
}

main(process.argv.slice(2)).catch((err: unknown) => {
  if (err instanceof AppError) process.stderr.write(`${err.code}: ${err.message}\n`);
  else process.stderr.write(`${(err as Partial<Error> | null | undefined)?.stack ?? String(err)}\n`);
  process.exit(1);
});
