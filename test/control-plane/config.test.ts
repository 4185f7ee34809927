import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ConfigError, loadConfig } from '../../src/adapters/config.js';

/** A bad setting is named with what to fix, and a credential in it never reaches the message (which is printed at start). */
describe('control-plane config errors keep credentials out', () => {
  const messageOf = (env: NodeJS.ProcessEnv): string => {
    try {
      loadConfig(env);
    } catch (err) {
      assert.ok(err instanceof ConfigError, String(err));
      return err.message;
    }
    assert.fail('the configuration was accepted');
  };

  it('an EVENTSTORE_URL that is not esdb:// is named, its user:password is not shown', () => {
    const text = messageOf({ EVENTSTORE_URL: 'https://admin:hunter2-secret@es.example:2113' });
    assert.match(text, /EVENTSTORE_URL: must be an esdb:\/\/ or esdb\+discover:\/\/ connection string \(got <redacted>\)/);
    assert.doesNotMatch(text, /hunter2/);
  });

  it('an API_KEYS entry without a tenant is named by its place, not by its text', () => {
    const text = messageOf({ API_KEYS: 'acme:0123456789abcdef0123,sk-live-abcdefghijklmnop' });
    assert.match(text, /entry #2 must be tenant:key/);
    assert.doesNotMatch(text, /sk-live/);
    assert.match(messageOf({ API_KEYS: 'Acme:0123456789abcdef0123' }), /entry "Acme" must be tenant:key/);
  });
});
