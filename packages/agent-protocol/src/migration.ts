import { z } from 'zod';
import { createVmRequestSchema, sha256HexSchema } from './agent-protocol.js';

/**
 * Native live migration between two host agents (qemu backend): the guest's
 * memory and disk stream from the source's QEMU to the target's over TCP,
 * in TLS with a pre-shared key the target mints for this one migration. The
 * control plane carries the key from the target to the source, so only the
 * target it granted can receive the stream, and only that source can feed
 * the target.
 *
 *   GET  /v1/vms/:name/migration/offer     (source) the machine the target must build
 *   POST /v1/migrations/incoming           (target) { vm, machine, ttl_s } -> { uri, psk, expires_at }
 *   POST /v1/vms/:name/migration/send      (source) { to: { uri, psk } } -> report; the source stays stopped
 *   POST /v1/vms/:name/migration/complete  (target) { keep_paused } -> the VM, running (or frozen)
 *   DELETE /v1/migrations/incoming/:name   (target) gives up one that has not completed -> { name, aborted }
 */

/** Opaque to the control plane: the source's machine (size, accelerator, QEMU build, image build), checked by the target. */
export const migrationMachineSchema = z.record(z.string(), z.unknown());

export const migrationOfferSchema = z.object({ name: z.string(), machine: migrationMachineSchema });
export type MigrationOffer = z.infer<typeof migrationOfferSchema>;

export const incomingMigrationRequestSchema = z.object({
  /** The VM as it is to exist on the target (its name, tenant, size, endpoints; its address is the target's). */
  vm: createVmRequestSchema,
  machine: migrationMachineSchema,
  /** The target gives up (and frees what it prepared) if no stream has landed by then. */
  ttl_s: z.number().int().min(10).max(3600).default(600),
  /** The source will switch to post-copy (send with lazy): the target must be set up for it before the stream starts. */
  lazy: z.boolean().default(false),
});
export type IncomingMigrationRequest = z.input<typeof incomingMigrationRequestSchema>;

/** A 256-bit pre-shared key, hex. */
export const migrationPskSchema = sha256HexSchema;
export const migrationUriSchema = z.string().regex(/^tcp:[A-Za-z0-9.-]{1,253}:\d{1,5}$/, 'tcp:<host>:<port>');

export const incomingMigrationSchema = z.object({
  name: z.string(),
  uri: migrationUriSchema,
  psk: migrationPskSchema,
  expires_at: z.string(),
});
export type IncomingMigration = z.infer<typeof incomingMigrationSchema>;

export const sendMigrationRequestSchema = z.object({
  to: z.object({ uri: migrationUriSchema, psk: migrationPskSchema }),
  /**
   * Post-copy (QEMU postcopy-ram): the guest runs on the target before all of
   * its memory has arrived and faults the rest in from the source. The answer
   * comes at the switch-over; until the source has sent the last page the
   * guest depends on it (destroying the source waits for that).
   */
  lazy: z.boolean().default(false),
});
export type SendMigrationRequest = z.infer<typeof sendMigrationRequestSchema>;

export const migrationReportSchema = z.object({
  /** How long the guest was stopped at the end of the copy (QEMU's own figure). */
  downtime_ms: z.number().nonnegative(),
  total_ms: z.number().nonnegative(),
  transferred_bytes: z.number().nonnegative(),
  /** Answered at the post-copy switch-over: pages still flow from the source. */
  lazy: z.boolean().optional(),
});
export type MigrationReport = z.infer<typeof migrationReportSchema>;

export const completeMigrationRequestSchema = z.object({
  /** Leave the guest frozen once its state has landed; POST /vms/:name/resume runs it (the caller owns doing so). */
  keep_paused: z.boolean().default(false),
});

/** `aborted: false`: nothing was waiting (never prepared, already expired, or landed: destroy that VM instead). */
export const abortedMigrationSchema = z.object({ name: z.string(), aborted: z.boolean() });
export type AbortedMigration = z.infer<typeof abortedMigrationSchema>;
