import type { ProcessHandle } from '../../packages/agent/src/backend.js';

/** What a sandbox process printed and how it ended. */
export interface Ran {
  exitCode: number | null;
  signal: string | null;
  stdout: string;
  stderr: string;
}

/** Collects a backend process's output until it exits; SIGKILL after `timeoutMs`. */
export async function collect(h: ProcessHandle, timeoutMs = 15_000): Promise<Ran> {
  let stdout = '';
  let stderr = '';
  h.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d));
  h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
  const timer = setTimeout(() => h.kill('SIGKILL'), timeoutMs);
  try {
    const st = await h.wait();
    return { exitCode: st.exitCode, signal: st.signal, stdout, stderr };
  } finally {
    clearTimeout(timer);
  }
}
