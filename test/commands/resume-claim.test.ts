import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { bindAggregate, CommandHandler } from '../../src/commands/command-handler.js';
import { ResumeClaims } from '../../src/commands/vm/resume-claim.js';
import type { Actor } from '../../src/commands/vm/vm-commands.js';
import { resumeClaimAggregate } from '../../src/domain/vm/resume-claim.decider.js';
import { MemoryEventStore } from '../support/memory-event-store.js';

/**
 * The resume claim across two replicas (two command handlers on one store;
 * the in-memory store is a test double of the event store's expected-revision
 * append, which test/control-plane/vm-resume-replicas.test.ts exercises on
 * Postgres with real agents). Leases here are a few hundred ms.
 */
const actor: Actor = { correlationId: 't', actor: 'admin', tenantId: 'acme', admin: true };
const VM = 'aaaaaaaaaaaaaaaaaaaaaaaa';
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

describe('resume claims', () => {
  test('a resume that outlasts the lease keeps its claim (renewed): the other replica waits and sees its result', async () => {
    const store = new MemoryEventStore();
    const a = new ResumeClaims(new CommandHandler(store), 300, 20);
    const b = new ResumeClaims(new CommandHandler(store), 300, 20);
    let resumes = 0;
    let state: string | undefined;
    const resume = async (): Promise<string> => {
      resumes++;
      await sleep(1_200);
      state = 'running';
      return state;
    };
    const settled = (): Promise<string | undefined> => Promise.resolve(state);
    const first = a.run(VM, actor, resume, settled);
    await sleep(50);
    const second = b.run(VM, actor, resume, settled);
    assert.deepEqual(await Promise.all([first, second]), ['running', 'running']);
    assert.equal(resumes, 1, 'exactly one resume across the two replicas');
    const claims = (await store.readStream(`vmresume-${VM}`)).filter((e) => e.type === 'VmResumeClaimed');
    assert.ok(claims.length >= 3, `the holder renewed its claim: ${claims.length} claims recorded`);
  });

  test('a claimant that died (its claim never ended, never renewed) holds the VM for its lease only', async () => {
    const store = new MemoryEventStore();
    await bindAggregate(new CommandHandler(store), resumeClaimAggregate).handle(
      VM,
      { type: 'ClaimResume', data: { vm_id: VM, claim_id: 'dead', lease_ms: 300 } },
      actor,
    );
    const b = new ResumeClaims(new CommandHandler(store), 300, 20);
    const started = Date.now();
    assert.equal(
      await b.run(
        VM,
        actor,
        () => Promise.resolve('running'),
        () => Promise.resolve(undefined),
      ),
      'running',
    );
    const waited = Date.now() - started;
    assert.ok(waited >= 200, `waited for the dead claim's lease: ${waited} ms`);
  });
});
