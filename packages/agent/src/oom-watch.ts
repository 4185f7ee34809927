import type { Backend, ExitStatus } from './backend.js';

/**
 * Whether a command died of an OOM kill: it ended with SIGKILL that the
 * agent did not send (no timeout, no hang-up) while the sandbox's oom_kill
 * counter rose. Two commands killed in the same instant by one OOM and by
 * someone else's SIGKILL are not told apart; the kernel log that could is
 * not readable here.
 */
export async function oomWatch(
  backend: Backend,
  name: string,
): Promise<{ killed(status: ExitStatus, killedByUs: () => boolean, argv0: string | undefined): Promise<boolean> }> {
  const observer = backend.observer;
  const before = observer ? await observer.oomKills(name).catch(() => null) : null;
  return {
    async killed(status, killedByUs, argv0) {
      if (!observer || before === null || killedByUs()) return false;
      if (status.signal !== 'SIGKILL' && status.exitCode !== 137) return false;
      const after = await observer.oomKills(name).catch(() => before);
      if (after <= before) return false;
      observer.noteKilledExec(name, argv0 ?? 'unknown');
      return true;
    },
  };
}
