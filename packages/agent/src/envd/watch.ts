import { randomUUID } from 'node:crypto';
import { posix } from 'node:path';
import { Code, ConnectError } from '@connectrpc/connect';
import { EventType } from './gen/filesystem_pb.js';
import type { GuestEntry, GuestFs } from './guest-fs.js';

/**
 * Directory watches by polling from inside the sandbox: the base image has no
 * inotify tool, and an inotify watch placed from the host on a path a guest
 * can re-point with a symlink could watch a host directory. A poll compares
 * two listings, so a rename shows as remove + create and several writes
 * between two polls as one write.
 */

export type Snapshot = ReadonlyMap<string, GuestEntry>;

export async function snapshotOf(fs: GuestFs, sandbox: string, dir: string, recursive: boolean, signal?: AbortSignal): Promise<Snapshot> {
  const entries = await fs.list(sandbox, dir, recursive ? 0 : 1, signal);
  return new Map(entries.map((e) => [e.path, e]));
}

export interface WatchEvent {
  readonly name: string;
  readonly type: EventType;
}

export function diffSnapshots(dir: string, before: Snapshot, after: Snapshot): WatchEvent[] {
  const events: WatchEvent[] = [];
  const rel = (p: string): string => posix.relative(dir, p);
  for (const [path, e] of after) {
    const old = before.get(path);
    if (!old) events.push({ name: rel(path), type: EventType.CREATE });
    else if (old.stamp !== e.stamp) {
      const contentChanged = old.size !== e.size || old.mtime.seconds !== e.mtime.seconds || old.mtime.nanos !== e.mtime.nanos;
      events.push({ name: rel(path), type: contentChanged ? EventType.WRITE : EventType.CHMOD });
    }
  }
  for (const path of before.keys()) if (!after.has(path)) events.push({ name: rel(path), type: EventType.REMOVE });
  return events;
}

interface Watcher {
  readonly dir: string;
  readonly recursive: boolean;
  snapshot: Snapshot;
  lastUsed: number;
}

const MAX_WATCHERS_PER_SANDBOX = 64;
/** A watcher nobody has polled for this long is dropped (its client is gone). */
const WATCHER_IDLE_MS = 10 * 60_000;

/** CreateWatcher / GetWatcherEvents / RemoveWatcher: each poll diffs against the previous one. */
export class WatcherTable {
  readonly #bySandbox = new Map<string, Map<string, Watcher>>();

  create(sandbox: string, dir: string, recursive: boolean, snapshot: Snapshot): string {
    const now = Date.now();
    // Watchers of clients (or sandboxes) long gone are dropped here, on every sandbox.
    for (const [name, watchers] of this.#bySandbox) {
      for (const [id, w] of watchers) if (now - w.lastUsed > WATCHER_IDLE_MS) watchers.delete(id);
      if (watchers.size === 0) this.#bySandbox.delete(name);
    }
    const table = this.#bySandbox.get(sandbox) ?? new Map<string, Watcher>();
    if (table.size >= MAX_WATCHERS_PER_SANDBOX)
      throw new ConnectError(`at most ${MAX_WATCHERS_PER_SANDBOX} watchers per sandbox: remove one first`, Code.ResourceExhausted);
    const id = randomUUID();
    table.set(id, { dir, recursive, snapshot, lastUsed: now });
    this.#bySandbox.set(sandbox, table);
    return id;
  }

  get(sandbox: string, id: string): Watcher {
    const w = this.#bySandbox.get(sandbox)?.get(id);
    if (!w) throw new ConnectError(`watcher ${id} not found`, Code.NotFound);
    w.lastUsed = Date.now();
    return w;
  }

  remove(sandbox: string, id: string): void {
    const table = this.#bySandbox.get(sandbox);
    if (!table?.delete(id)) throw new ConnectError(`watcher ${id} not found`, Code.NotFound);
    if (table.size === 0) this.#bySandbox.delete(sandbox);
  }
}
