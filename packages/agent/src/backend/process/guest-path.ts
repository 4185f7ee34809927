import { lstat, readlink } from 'node:fs/promises';
import { AppError } from '@fleet/agent-protocol';
import { guestPathNotFound, invalidSpec, pathEscapes } from '../../backend.js';

const MAX_LINKS = 40;

/**
 * Resolves a guest path to a host path under `root` (the sandbox's root as
 * the host sees it), the way the guest would: symlinks are followed
 * component by component with absolute targets re-rooted at the sandbox
 * root. Any ".." that would climb above the root — written in the request
 * or inside a symlink's target — is refused rather than clamped: a path
 * that means to leave the sandbox is an error, not a request for "/".
 * The answer is free of symlinks and "..", so the host-side open that
 * follows cannot be redirected out (short of a race with the guest
 * replacing a component after this check, which needs a live attacker
 * inside the sandbox and only reaches what the agent's open reaches).
 */
export async function resolveInRoot(
  root: string,
  guestPath: string,
  /** parents (with forWrite): missing directories before the last component are fine too (the writer makes them). */
  opts: { forWrite: boolean; parents?: boolean },
): Promise<{ hostPath: string; guestPath: string }> {
  if (guestPath.length === 0 || guestPath.includes('\0')) {
    throw invalidSpec('a guest path must be non-empty and contain no NUL byte', [{ path: 'path', message: 'invalid path' }]);
  }
  const resolved: string[] = [];
  // Work list of components still to walk, front first.
  let pending = guestPath.split('/').filter((c) => c !== '' && c !== '.');
  let links = 0;
  // Depth of the first missing component (parents only), -1 while every component so far exists: nothing under a
  // missing one exists, so what follows it is taken literally, until a ".." climbs back above it: from there on
  // the components exist again and are checked (a symlink among them followed) as before.
  let missingAt = -1;
  for (let comp = pending.shift(); comp !== undefined; comp = pending.shift()) {
    if (comp === '..') {
      if (resolved.length === 0) throw pathEscapes(guestPath);
      resolved.pop();
      if (resolved.length <= missingAt) missingAt = -1;
      continue;
    }
    if (missingAt >= 0) {
      resolved.push(comp);
      continue;
    }
    const candidate = [...resolved, comp];
    const hostPath = `${root}/${candidate.join('/')}`;
    let st;
    try {
      st = await lstat(hostPath);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOENT' || code === 'ENOTDIR') {
        // A missing last component is fine for a write; a missing parent never is.
        if (opts.forWrite && pending.length === 0) {
          resolved.push(comp);
          break;
        }
        if (opts.forWrite && opts.parents && code === 'ENOENT') {
          missingAt = resolved.length;
          resolved.push(comp);
          continue;
        }
        throw guestPathNotFound(guestPath);
      }
      throw err;
    }
    if (st.isSymbolicLink()) {
      if (++links > MAX_LINKS)
        throw new AppError('GUEST_PATH_LOOP', 400, `too many symlinks resolving "${guestPath}"`, { path: guestPath });
      const target = await readlink(hostPath);
      const targetComps = target.split('/').filter((c) => c !== '' && c !== '.');
      if (target.startsWith('/')) resolved.length = 0;
      pending = [...targetComps, ...pending];
      continue;
    }
    if (pending.length > 0 && !st.isDirectory()) throw guestPathNotFound(guestPath);
    resolved.push(comp);
  }
  const rel = resolved.join('/');
  return { hostPath: rel ? `${root}/${rel}` : root, guestPath: `/${rel}` };
}
