import { AppError, type CreateFile } from '@fleet/agent-protocol';
import type { HostAgent } from '../../domain/host-agent.port.js';
import { RESERVED_GUEST_DIR, type VmSpec } from '../../domain/vm/spec.js';
import { copyToConsole } from './startup-console.js';

/** What a new VM's create call carries for its guest: the fleet's token (0600) and the caller's files. */
export function guestFiles(spec: VmSpec, token: string): CreateFile[] {
  return [
    { path: `${RESERVED_GUEST_DIR}/token`, content_b64: Buffer.from(token).toString('base64'), mode: '600' },
    ...Object.entries(spec.files ?? {}).map(([path, content_b64]) => ({ path, content_b64 })),
  ];
}

/**
 * A new VM's guest: the fleet's directory and token, the caller's files (unless the create call wrote
 * them: `filesWritten`), then its startup script.
 */
export async function setUpGuest(
  agent: HostAgent,
  name: string,
  spec: VmSpec,
  token: string,
  startupScriptTimeoutMs: number,
  opts: { readonly filesWritten?: boolean } = {},
): Promise<void> {
  if (!opts.filesWritten) await uploadGuestFiles(agent, name, spec, token);
  if (spec.startup_script) {
    const timeoutMs = spec.startup_script_timeout_s !== undefined ? spec.startup_script_timeout_s * 1000 : startupScriptTimeoutMs;
    await agent.upload(name, `${RESERVED_GUEST_DIR}/startup.sh`, Buffer.from(spec.startup_script), { mode: '0755' });
    const r = await agent.exec(
      name,
      { argv: ['/bin/sh', `${RESERVED_GUEST_DIR}/startup.sh`], timeout_ms: timeoutMs },
      { timeoutMs: timeoutMs + 10_000 },
    );
    await copyToConsole(agent, name, r, (text) => scrub(text, Object.values(spec.secrets ?? {})));
    if (r.timed_out) throw new AppError('STARTUP_SCRIPT_TIMEOUT', 504, `startup script did not finish within ${timeoutMs} ms`);
    if (r.exit_code !== 0) {
      throw new AppError('STARTUP_SCRIPT_FAILED', 422, `startup script exited with code ${r.exit_code}: ${tail(r.stderr || r.stdout)}`, {
        exit_code: r.exit_code,
      });
    }
  }
}

/** The calls an agent without create files needs: its directories, the token, each file. */
async function uploadGuestFiles(agent: HostAgent, name: string, spec: VmSpec, token: string): Promise<void> {
  const dirs = new Set([RESERVED_GUEST_DIR, ...Object.keys(spec.files ?? {}).map((p) => p.slice(0, p.lastIndexOf('/')) || '/')]);
  const mkdir = await agent.exec(name, { argv: ['mkdir', '-p', ...dirs], timeout_ms: 10_000 });
  if (mkdir.exit_code !== 0) throw new AppError('GUEST_SETUP_FAILED', 502, `could not create guest directories: ${tail(mkdir.stderr)}`);
  await agent.upload(name, `${RESERVED_GUEST_DIR}/token`, Buffer.from(token), { mode: '0600' });
  for (const [path, content] of Object.entries(spec.files ?? {})) {
    await agent.upload(name, path, Buffer.from(content, 'base64'));
  }
}

/** Every occurrence of a secret value replaced, longest first so a value containing another is not half-shown. */
export function scrub(text: string, values: readonly string[]): string {
  let out = text;
  for (const v of [...values].filter((x) => x.length > 0).sort((a, b) => b.length - a.length)) out = out.split(v).join('[sealed]');
  return out;
}

function tail(s: string, n = 500): string {
  return s.length > n ? `…${s.slice(-n)}` : s;
}
