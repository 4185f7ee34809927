import { randomBytes } from 'node:crypto';
import { mkdir, rename, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { Logger } from 'pino';
import { sleep } from './exec-util.js';
import { DISK_IMAGE, formatImage, mountNewDisk } from './storage.js';

/**
 * A few sandbox disks formatted ahead of time, so a create with the pool's
 * storage_gb renames one into its directory and mounts it instead of running
 * fallocate and mkfs.ext4 on its own path (about a third of the agent's
 * create on a quiet 2-core host, more under load: mkfs is CPU-bound).
 *
 *   <dataDir>/disk-pool/ready-<random>.img   formatted, preallocated, never mounted
 *   <dataDir>/disk-pool/tmp-<random>.img     being made (garbage after a crash)
 *
 * What makes it safe to hand a pooled disk to any tenant:
 * - a pooled image depends on nothing but its size: an empty ext4 made the
 *   way createDisk makes one, never mounted, so it holds no state of anyone;
 * - take() removes it from the list before anything awaits, and the create
 *   renames the file away: one image, one sandbox, ever. A disk goes back to
 *   no pool: destroy deletes it as before;
 * - the pool holds no kernel objects (no loop device, no mount, no link):
 *   an agent killed with a full pool leaves only files in its data directory,
 *   which the next start deletes (and close() on a clean shutdown).
 * The refill runs in the background, one image at a time, and waits while a
 * create is in flight so it never competes with one for a core.
 */
export interface DiskPoolStatus {
  /** Images the pool keeps ready (0: off). */
  readonly size: number;
  /** storage_gb of each. */
  readonly gb: number;
  readonly ready: number;
  /** Creates served from the pool, and creates with this size that found it empty. */
  readonly taken: number;
  readonly missed: number;
}

export const DISK_POOL_DIR = 'disk-pool';

export class DiskPool {
  readonly dir: string;
  private readonly ready: string[] = [];
  private filling: Promise<void> | null = null;
  private closed = false;
  private taken = 0;
  private missed = 0;

  constructor(
    dataDir: string,
    readonly size: number,
    readonly gb: number,
    /** True while a create is in flight: the refill waits for it. */
    private readonly busy: () => boolean,
    private readonly log: Logger | undefined,
  ) {
    this.dir = join(dataDir, DISK_POOL_DIR);
  }

  /**
   * Deletes whatever a previous agent left (a run killed mid-fill, or with a
   * full pool: images of the old run are never trusted, whatever their name)
   * and starts filling.
   */
  async start(): Promise<void> {
    await rm(this.dir, { recursive: true, force: true });
    await mkdir(this.dir, { recursive: true, mode: 0o700 });
    this.refill();
  }

  status(): DiskPoolStatus {
    return { size: this.size, gb: this.gb, ready: this.ready.length, taken: this.taken, missed: this.missed };
  }

  /** GiB the ready images hold: free space placement may count (the next creates get them). */
  heldGb(): number {
    return this.ready.length * this.gb;
  }

  /**
   * Gives `<sandboxDir>/disk.img` a formatted image from the pool and mounts
   * it as createDisk would; false when the pool has none of that size (the
   * caller makes one). Synchronous up to the rename: two creates never get
   * the same image.
   */
  async provide(sandboxDir: string, storageGb: number): Promise<boolean> {
    if (this.closed || storageGb !== this.gb || this.size === 0) return false;
    const img = this.ready.shift();
    if (img === undefined) {
      this.missed++;
      this.refill();
      return false;
    }
    this.taken++;
    this.refill();
    try {
      await rename(img, join(sandboxDir, DISK_IMAGE));
    } catch (err) {
      // EXDEV (sandboxes/ on another filesystem) or a vanished file: the caller formats one of its own.
      this.log?.warn({ err, image: img }, 'a pooled disk could not be moved into the sandbox');
      await rm(img, { force: true });
      return false;
    }
    await mountNewDisk(sandboxDir);
    return true;
  }

  private refill(): void {
    if (this.filling || this.closed || this.ready.length >= this.size) return;
    this.filling = this.fill()
      .catch((err: unknown) => this.log?.warn({ err }, 'the disk pool could not refill'))
      .finally(() => {
        this.filling = null;
      });
  }

  private async fill(): Promise<void> {
    // `closed` flips while this awaits: read through a call, not a narrowed field.
    const open = (): boolean => !this.closed;
    while (open() && this.ready.length < this.size) {
      // Creates first: a refill shares two cores with them.
      for (let i = 0; i < 500 && this.busy() && open(); i++) await sleep(10);
      if (!open()) return;
      const id = randomBytes(8).toString('hex');
      const tmp = join(this.dir, `tmp-${id}.img`);
      try {
        await formatImage(tmp, this.gb);
        if (!open()) throw new Error('the disk pool closed');
        const img = join(this.dir, `ready-${id}.img`);
        await rename(tmp, img);
        this.ready.push(img);
      } catch (err) {
        await rm(tmp, { force: true });
        if (!open()) return;
        throw err;
      }
    }
  }

  /** Stops the refill and deletes every image the pool holds (a take in progress has renamed its own already). */
  async close(): Promise<void> {
    this.closed = true;
    await this.filling;
    this.ready.splice(0);
    await rm(this.dir, { recursive: true, force: true });
  }
}
