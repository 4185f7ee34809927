import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ConfigError, loadConfig } from '../../src/adapters/config.js';
import { parseAgentEnv } from '../../packages/agent/src/config.js';

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

  it('CHECKPOINT_INTERVAL_MS: 0 (off) by default; below 1 s, negative or not a number is named', () => {
    assert.equal(loadConfig({}).CHECKPOINT_INTERVAL_MS, 0);
    assert.equal(loadConfig({ CHECKPOINT_INTERVAL_MS: '60000' }).CHECKPOINT_INTERVAL_MS, 60_000);
    for (const bad of ['500', '-1', 'soon', '1.5'])
      assert.match(messageOf({ CHECKPOINT_INTERVAL_MS: bad }), /CHECKPOINT_INTERVAL_MS/, `refused: ${bad}`);
  });
});

describe('defaults that must agree across the control plane and the agent', () => {
  const toInt = (ip: string): number => ip.split('.').reduce((n, o) => n * 256 + Number(o), 0);
  const range = (cidr: string): [number, number] => {
    const [ip, len] = cidr.split('/') as [string, string];
    const start = toInt(ip);
    return [start, start + 2 ** (32 - Number(len)) - 1];
  };

  it("the default NETWORK_POOL lies inside the agent's default AGENT_SUBNET, so networks work on the embedded default", () => {
    const pool = range(loadConfig({}).NETWORK_POOL);
    const subnet = range(parseAgentEnv({ AGENT_TOKEN: 't'.repeat(32) }).AGENT_SUBNET);
    assert.ok(pool[0] >= subnet[0] && pool[1] <= subnet[1], `${loadConfig({}).NETWORK_POOL} outside the agent's subnet`);
    assert.ok(pool[1] - pool[0] < subnet[1] - subnet[0], 'a slice of it, not all of it');
  });
});
