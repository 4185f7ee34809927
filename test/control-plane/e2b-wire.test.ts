import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import Fastify from 'fastify';
import { AppError, ValidationError } from '@fleet/agent-protocol';
import { EnvdTokens } from '../../src/adapters/http/e2b/e2b-auth.js';
import { e2bErrorHandler, parseMetadataQuery } from '../../src/adapters/http/e2b/e2b.routes.js';
import { e2bShellExports } from '../../src/adapters/http/e2b/e2b-shell.js';

/** The pieces of the E2B layer a client cannot easily drive from the SDK: error mapping, query decoding, tokens, start-up lines. */
describe('e2b wire details', () => {
  it('errors are E2B-shaped: no room is 503 (ServiceBusyError), a 5xx tells nothing of its insides', async () => {
    const app = Fastify({ logger: false });
    app.setErrorHandler(e2bErrorHandler);
    app.get('/capacity', () => {
      throw new AppError('CAPACITY_EXHAUSTED', 409, 'no host has 1 CPU free');
    });
    app.get('/bad', () => {
      throw new ValidationError('timeout: too long', [{ path: 'body.timeout', message: 'too long' }]);
    });
    app.get('/boom', () => {
      throw new Error('secret internal detail');
    });
    const capacity = await app.inject('/capacity');
    assert.equal(capacity.statusCode, 503);
    assert.deepEqual(capacity.json(), { code: 503, message: 'no host has 1 CPU free', error_code: 'CAPACITY_EXHAUSTED' });
    const bad = await app.inject('/bad');
    assert.equal(bad.statusCode, 400);
    assert.equal(bad.json().code, 400);
    const boom = await app.inject('/boom');
    assert.equal(boom.statusCode, 500);
    assert.ok(!boom.body.includes('secret internal detail'));
    await app.close();
  });

  it('metadata filters arrive encoded twice, as the SDK sends them', () => {
    // What Sandbox.list({query: {metadata: {'a b': 'x&y', plain: 'v'}}}) puts in the query, once the server decoded it.
    const pairs = { [encodeURIComponent('a b')]: encodeURIComponent('x&y'), plain: 'v' };
    assert.deepEqual(parseMetadataQuery(new URLSearchParams(pairs).toString()), { 'a b': 'x&y', plain: 'v' });
    assert.equal(parseMetadataQuery(''), undefined);
    assert.throws(() => parseMetadataQuery('a=%E0%A4%A'), /metadata/);
  });

  it('envd access tokens: per VM, per key, checked in constant time', () => {
    const t = new EnvdTokens(Buffer.alloc(32, 1));
    const other = new EnvdTokens(Buffer.alloc(32, 2));
    const token = t.tokenFor('vm-a');
    assert.equal(t.verify('vm-a', token), true);
    assert.equal(t.verify('vm-b', token), false, "another VM's token");
    assert.equal(other.verify('vm-a', token), false, 'another key');
    assert.equal(t.verify('vm-a', undefined), false);
    assert.equal(t.verify('vm-a', `${token}x`), false);
  });

  it('npm start prints the lines a shell takes', () => {
    assert.equal(
      e2bShellExports('http://127.0.0.1:8080'),
      'export E2B_API_URL=http://127.0.0.1:8080/e2b\nexport E2B_SANDBOX_URL=http://127.0.0.1:8080/e2b/envd\n',
    );
    assert.equal(
      e2bShellExports('http://0.0.0.0:9000', 'demo-key'),
      'export E2B_API_URL=http://127.0.0.1:9000/e2b\nexport E2B_SANDBOX_URL=http://127.0.0.1:9000/e2b/envd\nexport E2B_API_KEY=demo-key\n',
    );
    // With an ingress in this process, envd goes through it.
    assert.equal(
      e2bShellExports('http://0.0.0.0:9000', undefined, 'http://0.0.0.0:9001'),
      'export E2B_API_URL=http://127.0.0.1:9000/e2b\nexport E2B_SANDBOX_URL=http://127.0.0.1:9001\n',
    );
  });
});
