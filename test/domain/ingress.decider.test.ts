import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ingressDecider, type IngressStreamEvent } from '../../src/domain/vm/ingress.decider.js';
import { ingressEventSchema } from '../../src/domain/vm/ingress.events.js';
import { given, T0 } from './gwt.js';

const at = T0.toISOString();
const sha = 'a'.repeat(64);
const published: IngressStreamEvent = {
  type: 'IngressPublished',
  data: {
    vm_id: 'vm1',
    tenant_id: 'acme',
    host_id: 'h1',
    routes: [
      { as: 'web', port: 8080, public: false, target: 'http://127.0.0.1:40001' },
      { as: 'open', port: 8081, public: true, target: 'http://127.0.0.1:40002' },
    ],
    token_sha256: sha,
    token_encrypted: 'sealed',
    at,
  },
};
const publish = {
  type: 'PublishRoutes' as const,
  data: { vm_id: 'vm1', tenant_id: 'acme', host_id: 'h1', routes: published.data.routes, token_sha256: sha, token_encrypted: 'sealed' },
};

describe('ingress decider', () => {
  it('publishes once: a retried publish keeps the first token', () => {
    given(ingressDecider).when(publish).then([published]);
    given(ingressDecider, [published])
      .when({ ...publish, data: { ...publish.data, token_sha256: 'b'.repeat(64) } })
      .then([]);
  });

  it('never publishes for a VM whose end is recorded, whatever came first', () => {
    const ended: IngressStreamEvent = { type: 'VmDestroyRequested', data: { vm_id: 'vm1', reason: 'client', at } };
    given(ingressDecider, [ended]).when(publish).thenThrows('VM_INVALID_STATE', 409);
  });

  it('adopt moves every route to the new host by name, keeping port and public flag; routes the host no longer publishes go', () => {
    const events = given(ingressDecider, [published])
      .when({ type: 'AdoptRoutes', data: { vm_id: 'vm1', host_id: 'h2', targets: [{ as: 'open', target: 'http://127.0.0.1:50002' }] } })
      .events();
    assert.deepEqual(events, [
      {
        type: 'IngressAdopted',
        data: {
          vm_id: 'vm1',
          adopt_from: { vm_id: 'vm1', host_id: 'h1' },
          host_id: 'h2',
          routes: [{ as: 'open', port: 8081, public: true, target: 'http://127.0.0.1:50002' }],
          at,
        },
      },
    ]);
    // Read back through the schema: events parse back.
    assert.deepEqual(ingressEventSchema.parse(events[0]), events[0]);
  });

  it('adopting the same targets again changes nothing; a VM never published has nothing to adopt', () => {
    const same = published.data.routes.map((r) => ({ as: r.as, target: r.target }));
    given(ingressDecider, [published])
      .when({ type: 'AdoptRoutes', data: { vm_id: 'vm1', host_id: 'h1', targets: same } })
      .then([]);
    given(ingressDecider)
      .when({ type: 'AdoptRoutes', data: { vm_id: 'vm1', host_id: 'h2', targets: same } })
      .then([]);
  });

  it('unpublish is recorded once', () => {
    given(ingressDecider, [published])
      .when({ type: 'UnpublishRoutes', data: { vm_id: 'vm1' } })
      .then([{ type: 'IngressUnpublished', data: { vm_id: 'vm1', at } }]);
    given(ingressDecider, [published, { type: 'IngressUnpublished', data: { vm_id: 'vm1', at } }])
      .when({ type: 'UnpublishRoutes', data: { vm_id: 'vm1' } })
      .then([]);
  });
});
