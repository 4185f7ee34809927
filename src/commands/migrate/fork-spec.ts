import type { StoredVmSpec } from '../../domain/vm/spec.js';
import type { GuestInputs } from '../vm/vm-commands.js';

/** A fork's spec: the source's shape, seeded from the snapshot; what the disk already carries is not replayed. */
export function forkSpec(src: StoredVmSpec, snapshotId: string, guest: GuestInputs): Record<string, unknown> {
  const {
    image: _i,
    file_paths: _f,
    startup_script: _s,
    startup_script_encrypted: _se,
    secrets_encrypted: _sec,
    startup_script_timeout_s: _t,
    host_id: _h,
    pinned_host_id: _p,
    seed_snapshot_id: _seed,
    name: _n,
    agent,
    ...rest
  } = src;
  const out: Record<string, unknown> = { ...rest, seed_snapshot_id: snapshotId };
  // The copy runs the same guest: it gets the source's secrets, sealed again under its own id.
  if (Object.keys(guest.secrets).length > 0) out.secrets = guest.secrets;
  if (agent) {
    const { file_paths: _af, command_encrypted: _ce, command: _c, drain_command: _d, drain_command_encrypted: _de, ...a } = agent;
    out.agent = { ...a, command: guest.agentCommand, ...(guest.drainCommand ? { drain_command: guest.drainCommand } : {}) };
  }
  return out;
}
