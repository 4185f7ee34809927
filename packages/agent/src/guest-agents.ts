import { mkdir, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';

/**
 * What the agent must remember about a sandbox's in-guest agent beyond its
 * own lifetime: the drain command run on graceful destroy. Kept on disk, so
 * an agent restarted after a crash still drains before it destroys.
 */
export class GuestAgentStore {
  readonly #dir: string;

  constructor(dataDir: string) {
    this.#dir = join(dataDir, 'guest-agents');
  }

  async setDrainCommand(name: string, drainCommand: string): Promise<void> {
    await mkdir(this.#dir, { recursive: true, mode: 0o700 });
    const file = join(this.#dir, `${name}.json`);
    const tmp = `${file}.tmp`;
    await writeFile(tmp, JSON.stringify({ drain_command: drainCommand }));
    await rename(tmp, file);
  }

  async drainCommand(name: string): Promise<string> {
    try {
      const parsed = JSON.parse(await readFile(join(this.#dir, `${name}.json`), 'utf8')) as { drain_command?: unknown };
      return typeof parsed.drain_command === 'string' ? parsed.drain_command : '';
    } catch {
      return '';
    }
  }

  async forget(name: string): Promise<void> {
    await rm(join(this.#dir, `${name}.json`), { force: true });
  }

  /** Records of sandboxes no longer known; returns what was removed. */
  async prune(known: ReadonlySet<string>): Promise<string[]> {
    let names: string[];
    try {
      names = await readdir(this.#dir);
    } catch {
      return [];
    }
    const out: string[] = [];
    for (const file of names) {
      const name = file.replace(/\.json(\.tmp)?$/, '');
      if (known.has(name) && !file.endsWith('.tmp')) continue;
      await rm(join(this.#dir, file), { force: true });
      out.push(`guest-agent record ${name}`);
    }
    return out;
  }
}
