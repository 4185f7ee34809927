import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { ValidationError } from '@fleet/agent-protocol';
import {
  DEFAULT_SPEC_LIMITS,
  publicSpec,
  formatIssuePath,
  guestPathProblem,
  placementRequestOf,
  RESERVED_GUEST_DIR,
  toStoredSpec,
  validateVmSpec,
  validationErrorFromZod,
  vmSpecSchema,
  storedVmSpecSchema,
} from '../../src/domain/vm/spec.js';

const b64 = (s: string): string => Buffer.from(s).toString('base64');

function invalid(input: unknown, limits = DEFAULT_SPEC_LIMITS): ValidationError {
  try {
    validateVmSpec(input, limits);
  } catch (e) {
    assert.ok(e instanceof ValidationError, String(e));
    assert.equal(e.status, 400);
    return e;
  }
  assert.fail('expected a ValidationError');
}

const paths = (e: ValidationError): string[] => e.fields.map((f) => f.path);

describe('vm spec', () => {
  test('a minimal spec gets defaults, and expose protocol defaults to tcp', () => {
    const spec = validateVmSpec({ expose: [{ port: 8080, as: 'http' }] });
    assert.equal(spec.cpus, 1);
    assert.equal(spec.ram_mb, 512);
    assert.equal(spec.storage_gb, 1);
    assert.equal(spec.gpus, 0);
    assert.deepEqual(spec.expose, [{ port: 8080, as: 'http', protocol: 'tcp' }]);
  });

  test('a full spec passes and maps to a placement request', () => {
    const spec = validateVmSpec({
      name: 'job-1',
      cpus: 4,
      ram_mb: 8192,
      storage_gb: 20,
      region: 'eu',
      arch: 'arm64',
      gpus: 1,
      gpu_kind: 'a100',
      gpu_profile: '1g.10gb',
      host_id: 'h1',
      labels: { zone: 'a' },
      max_runtime_s: 3600,
      idle_timeout_s: 600,
      image: 'ubuntu-24.04',
      backend: 'qemu',
      startup_script: 'echo hi',
      startup_script_timeout_s: 20,
      files: { '/srv/app/config.json': b64('{}') },
      agent: {
        command: '/usr/local/bin/agent',
        drain_command: 'kill -TERM 1',
        files: { '/opt/agent/cfg': b64('x') },
        expose: [{ port: 9000, as: 'agent', protocol: 'udp' }],
      },
      expose: [{ port: 443, as: 'https' }],
      healthcheck: { http: { port: 8080, path: '/healthz' }, interval_seconds: 5 },
    });
    assert.deepEqual(placementRequestOf(spec), {
      cpus: 4,
      ram_mb: 8192,
      storage_gb: 20,
      gpus: 1,
      gpu_kind: 'a100',
      gpu_profile: '1g.10gb',
      arch: 'arm64',
      backend: 'qemu',
      region: 'eu',
      labels: { zone: 'a' },
      host_id: 'h1',
      pinned_host_id: undefined,
    });
  });

  test('CPUs, RAM and storage are checked against the limits passed in', () => {
    const e = invalid({ cpus: 0, ram_mb: 64, storage_gb: 5000 });
    assert.equal(e.code, 'VALIDATION_FAILED');
    assert.deepEqual(paths(e), ['cpus', 'ram_mb', 'storage_gb']);
    assert.match(e.message, /cpus: must be between 1 and 64 \(got 0\)/);
    const tight = { ...DEFAULT_SPEC_LIMITS, maxCpus: 2 };
    assert.deepEqual(paths(invalid({ cpus: 3 }, tight)), ['cpus']);
    assert.deepEqual(paths(invalid({ cpus: 1.5 })), ['cpus']);
  });

  test('image and seed_snapshot_id are mutually exclusive', () => {
    const e = invalid({ image: 'ubuntu', seed_snapshot_id: 'snap-1', pinned_host_id: 'h1' });
    assert.deepEqual(paths(e), ['seed_snapshot_id']);
    assert.match(e.message, /mutually exclusive/);
    validateVmSpec({ seed_snapshot_id: 'snap-1', pinned_host_id: 'h1' });
  });

  test('gpu_kind and gpu_profile only with gpus > 0', () => {
    assert.deepEqual(paths(invalid({ gpu_kind: 'a100' })), ['gpu_kind']);
    assert.deepEqual(paths(invalid({ gpus: 0, gpu_profile: '1g.10gb' })), ['gpu_profile']);
    assert.deepEqual(paths(invalid({ gpus: 9 })), ['gpus']);
  });

  test('a startup-script timeout above the fleet maximum is STARTUP_SCRIPT_TIMEOUT_TOO_LARGE', () => {
    const limits = { ...DEFAULT_SPEC_LIMITS, maxStartupScriptTimeoutMs: 50_000 };
    const e = invalid({ startup_script: 'sleep 1', startup_script_timeout_s: 51 }, limits);
    assert.equal(e.code, 'STARTUP_SCRIPT_TIMEOUT_TOO_LARGE');
    assert.deepEqual(paths(e), ['startup_script_timeout_s']);
    assert.match(e.message, /above the fleet maximum of 50s/);
    validateVmSpec({ startup_script: 'sleep 1', startup_script_timeout_s: 50 }, limits);
    // The code stays stable when other fields are wrong too; every field is still listed.
    const both = invalid({ cpus: 0, startup_script: 'x', startup_script_timeout_s: 999 }, limits);
    assert.equal(both.code, 'STARTUP_SCRIPT_TIMEOUT_TOO_LARGE');
    assert.deepEqual(paths(both), ['cpus', 'startup_script_timeout_s']);
  });

  test(`caller files under ${RESERVED_GUEST_DIR} are refused, in files and agent.files`, () => {
    const e = invalid({
      files: { '/etc/fleet/agent.json': b64('x'), '/etc/fleet': b64('x'), '/etc/fleetx/ok': b64('x') },
      agent: { command: 'a', files: { '/etc/fleet/token': b64('x') } },
    });
    assert.deepEqual(paths(e), ['files["/etc/fleet/agent.json"]', 'files["/etc/fleet"]', 'agent.files["/etc/fleet/token"]']);
    assert.match(e.message, /reserved/);
  });

  test('file paths must be absolute and normalised, so the reserved check cannot be walked around', () => {
    for (const bad of ['relative/x', '/srv/../etc/fleet/x', '/etc//fleet/x', '/etc/./fleet/x', '/srv/dir/', '/']) {
      assert.ok(guestPathProblem(bad), bad);
      assert.deepEqual(paths(invalid({ files: { [bad]: b64('x') } })), [`files[${JSON.stringify(bad)}]`], bad);
    }
    assert.equal(guestPathProblem('/srv/app/main.py'), undefined);
    assert.deepEqual(paths(invalid({ files: { '/srv/x': 'not base64!' } })), ['files["/srv/x"]']);
  });

  test('total file bytes are bounded', () => {
    const limits = { ...DEFAULT_SPEC_LIMITS, maxFilesBytes: 10 };
    assert.deepEqual(paths(invalid({ files: { '/a': b64('123456') }, agent: { command: 'x', files: { '/b': b64('123456') } } }, limits)), [
      'files',
    ]);
  });

  test('expose: ports 1–65535, protocol tcp or udp, labels unique across expose and agent.expose', () => {
    assert.deepEqual(
      paths(
        invalid({
          expose: [
            { port: 0, as: 'a' },
            { port: 65536, as: 'b' },
          ],
        }),
      ),
      ['expose[0].port', 'expose[1].port'],
    );
    assert.deepEqual(paths(invalid({ expose: [{ port: 80, as: 'a', protocol: 'sctp' }] })), ['expose[0].protocol']);
    assert.deepEqual(
      paths(
        invalid({
          expose: [
            { port: 80, as: 'web' },
            { port: 81, as: 'web' },
          ],
        }),
      ),
      ['expose[1].as'],
    );
    assert.deepEqual(paths(invalid({ expose: [{ port: 80, as: 'web' }], agent: { command: 'x', expose: [{ port: 81, as: 'web' }] } })), [
      'agent.expose[0].as',
    ]);
  });

  test('healthcheck takes exactly one of http or exec', () => {
    assert.deepEqual(paths(invalid({ healthcheck: {} })), ['healthcheck']);
    assert.deepEqual(paths(invalid({ healthcheck: { http: { port: 80 }, exec: ['true'] } })), ['healthcheck']);
    validateVmSpec({ healthcheck: { exec: ['true'] } });
  });

  test('unknown fields and wrong types are listed, each by path', () => {
    const e = invalid({ cpus: 'two', colour: 'red', labels: { ok: 1 } });
    assert.deepEqual(paths(e).sort(), ['(body)', 'cpus', 'labels.ok'].sort());
  });

  test('validationErrorFromZod lists each bad field', () => {
    const r = vmSpecSchema.safeParse({ cpus: 'x', expose: [{ port: 0, as: 'A' }] });
    assert.ok(!r.success);
    const e = validationErrorFromZod(r.error, 'vm spec');
    assert.equal(e.code, 'VALIDATION_FAILED');
    assert.deepEqual(paths(e), ['cpus', 'expose[0].port', 'expose[0].as']);
    assert.equal(formatIssuePath([]), '(body)');
    assert.equal(formatIssuePath(['files', '/a b', 0]), 'files["/a b"][0]');
  });

  test('the stored spec keeps file paths, never file contents', () => {
    const spec = validateVmSpec({
      files: { '/srv/b': b64('secret'), '/srv/a': b64('x') },
      agent: { command: 'run', files: { '/opt/c': b64('token') } },
    });
    const stored = toStoredSpec(spec, { agent_command: 'sealed-run' });
    assert.deepEqual(stored.file_paths, ['/srv/a', '/srv/b']);
    assert.deepEqual(stored.agent, { command_encrypted: 'sealed-run', file_paths: ['/opt/c'] });
    assert.ok(!JSON.stringify(stored).includes(b64('secret')));
    assert.deepEqual(storedVmSpecSchema.parse(JSON.parse(JSON.stringify(stored))), stored);
  });

  test('credential-bearing fields are stored only sealed: an unsealed one is refused, not kept in clear', () => {
    const spec = validateVmSpec({
      startup_script: 'export K=hunter2',
      secrets: { API_KEY: 'hunter3' },
      agent: { command: 'run --token hunter4' },
    });
    assert.throws(() => toStoredSpec(spec), /startup_script must be sealed/);
    assert.throws(() => toStoredSpec(spec, { startup_script: 'c1', agent_command: 'c2' }), /secrets must be sealed/);
    const stored = toStoredSpec(spec, { startup_script: 'c1', agent_command: 'c2', secrets: 'c3' });
    assert.ok(!/hunter/.test(JSON.stringify(stored)), JSON.stringify(stored));
    assert.equal(stored.startup_script_encrypted, 'c1');
    assert.equal(stored.secrets_encrypted, 'c3');
    assert.equal(stored.agent?.command_encrypted, 'c2');
    assert.deepEqual(publicSpec(stored), {
      ...publicSpec({ ...stored, startup_script_encrypted: undefined, secrets_encrypted: undefined, agent: undefined }),
      startup_script: '[sealed]',
      agent: { command: '[sealed]' },
    });
  });

  test('secrets: env-style names, bounded count and size, and the 400 never quotes a value', () => {
    assert.deepEqual(validateVmSpec({ secrets: { A_1: 'x', _B: '' } }).secrets, { A_1: 'x', _B: '' });
    for (const bad of [
      { '1A': 'hunter2' },
      { 'A-B': 'hunter2' },
      { A: 'hunter2'.repeat(10_000) },
      Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`K${i}`, 'hunter2'])),
    ]) {
      const e = invalid({ secrets: bad });
      assert.equal(e.code, 'VALIDATION_FAILED');
      assert.ok(!e.message.includes('hunter2'), e.message);
    }
  });

  test('a spec from an event written before sealing still parses, and reads show it sealed', () => {
    const old = storedVmSpecSchema.parse({
      cpus: 1,
      ram_mb: 256,
      storage_gb: 1,
      gpus: 0,
      startup_script: 'export PW=hunter2',
      agent: { command: 'run hunter2', drain_command: 'bye hunter2', expose: [] },
    });
    assert.equal(old.startup_script, 'export PW=hunter2');
    const shown = publicSpec(old);
    assert.equal(shown.startup_script, '[sealed]');
    assert.deepEqual(shown.agent, { expose: [], command: '[sealed]', drain_command: '[sealed]' });
    assert.deepEqual(
      publicSpec({ ...old, agent: { command: 'run', drain_command: '' } }).agent,
      { command: '[sealed]', drain_command: '' },
      'an empty drain command is nothing to hide',
    );
    assert.ok(!JSON.stringify(shown).includes('hunter2'));
  });

  test('a network member may ask for a process or qemu host, never a firecracker one (no agent builds its bridge there)', () => {
    const net = 'n'.repeat(24);
    assert.equal(validateVmSpec({ network_id: net, backend: 'qemu' }).network_id, net);
    assert.equal(validateVmSpec({ network_id: net, backend: 'process' }).network_id, net);
    assert.deepEqual(paths(invalid({ network_id: net, backend: 'firecracker' })), ['network_id']);
  });
});
