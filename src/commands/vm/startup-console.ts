import type { ExecResult } from '@fleet/agent-protocol';
import type { HostAgent } from '../../domain/host-agent.port.js';

/**
 * The startup script runs as an exec (its answer decides the boot), so its
 * output is not on the console by itself: it is written there afterwards,
 * from inside the sandbox (the console is the init's stdout, open to the
 * sandbox's root through /proc/1/fd/1, and bounded like any console
 * output), with sealed secrets already scrubbed by the caller. Best effort:
 * a console that cannot be written must not fail a boot.
 */
export async function copyToConsole(agent: HostAgent, name: string, r: ExecResult, scrub: (s: string) => string): Promise<void> {
  const text = `${r.stdout}${r.stderr}`;
  if (text.length === 0) return;
  const body = scrub(
    `[fleet: startup script output]\n${text}${text.endsWith('\n') ? '' : '\n'}[fleet: startup script exited ${r.exit_code}]\n`,
  );
  await agent
    .exec(name, { argv: ['/bin/sh', '-c', 'cat >> /proc/1/fd/1'], stdin: Buffer.from(body).toString('base64'), timeout_ms: 10_000 })
    .catch(() => undefined);
}
