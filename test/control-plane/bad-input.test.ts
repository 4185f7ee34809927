import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { eventually, startControlPlane, type ControlPlane, type RequestOptions } from '../support/control-plane.js';
import { startStubAgents, type StubAgents } from './stub-agent.js';

/**
 * Bad input on every route: a 4xx RFC 7807 problem with a stable code and a
 * detail saying what to fix — never a 500, never a change recorded. The host
 * behind the one running VM is the STUB AGENT test double (stub-agent.ts):
 * these requests are refused before any agent is called, so nothing here
 * depends on the agent, and a real sandbox would only slow the table down.
 */

interface Case {
  readonly name: string;
  readonly method: string;
  readonly url: string;
  readonly opts?: RequestOptions;
  readonly status: number;
  readonly code: string;
  /** A field the problem's `errors` must name, when the route validates fields. */
  readonly field?: RegExp;
}

const json = (body: string): RequestOptions => ({ rawBody: body, contentType: 'application/json' });
const VM = '{vm}';

function cases(): Case[] {
  const host = { id: 'h9', url: 'http://127.0.0.1:1', token: 'x'.repeat(20) };
  const spec = { image: 'base' };
  return [
    // auth, on a route of each family
    { name: 'no Authorization header', method: 'GET', url: '/v1/vms', opts: { as: 'none' }, status: 401, code: 'UNAUTHORIZED' },
    {
      name: 'not a bearer token',
      method: 'GET',
      url: '/v1/hosts',
      opts: { as: { authorization: 'Basic YWRtaW46eA==' } },
      status: 401,
      code: 'UNAUTHORIZED',
    },
    {
      name: 'unknown API key',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: { authorization: 'Bearer nope-nope-nope-nope' }, body: spec },
      status: 401,
      code: 'UNAUTHORIZED',
    },
    { name: 'tenant key on an admin route', method: 'DELETE', url: '/v1/hosts/h1', opts: { as: 'acme' }, status: 403, code: 'FORBIDDEN' },
    {
      name: 'tenant key registering a host',
      method: 'POST',
      url: '/v1/hosts',
      opts: { as: 'acme', body: host },
      status: 403,
      code: 'FORBIDDEN',
    },
    // unknown routes and methods
    { name: 'unknown route', method: 'GET', url: '/v1/nothing', status: 404, code: 'ROUTE_NOT_FOUND' },
    { name: 'unknown method on a known path', method: 'PATCH', url: '/v1/vms', status: 404, code: 'ROUTE_NOT_FOUND' },
    // POST /v1/hosts
    { name: 'hosts: malformed JSON', method: 'POST', url: '/v1/hosts', opts: json('{"id": "h9",'), status: 400, code: 'MALFORMED_JSON' },
    { name: 'hosts: body is not an object', method: 'POST', url: '/v1/hosts', opts: json('[1,2]'), status: 400, code: 'VALIDATION_FAILED' },
    {
      name: 'hosts: wrong type',
      method: 'POST',
      url: '/v1/hosts',
      opts: { body: { ...host, id: 42 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.id/,
    },
    {
      name: 'hosts: id not an id',
      method: 'POST',
      url: '/v1/hosts',
      opts: { body: { ...host, id: 'Bad_Id' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.id/,
    },
    {
      name: 'hosts: url not http',
      method: 'POST',
      url: '/v1/hosts',
      opts: { body: { ...host, url: 'ftp://x' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.url/,
    },
    {
      name: 'hosts: token too short',
      method: 'POST',
      url: '/v1/hosts',
      opts: { body: { ...host, token: 'short' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.token/,
    },
    {
      name: 'hosts: unknown backend',
      method: 'POST',
      url: '/v1/hosts',
      opts: { body: { ...host, backend: 'docker' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.backend/,
    },
    {
      name: 'hosts: unknown field',
      method: 'POST',
      url: '/v1/hosts',
      opts: { body: { ...host, tenant: 'acme' } },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    {
      name: 'hosts: text/plain body',
      method: 'POST',
      url: '/v1/hosts',
      opts: { rawBody: 'id=h9', contentType: 'text/plain' },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    {
      name: 'hosts: an unparsed media type',
      method: 'POST',
      url: '/v1/hosts',
      opts: { rawBody: '<host/>', contentType: 'application/xml' },
      status: 415,
      code: 'UNSUPPORTED_MEDIA_TYPE',
    },
    // GET /v1/hosts, /v1/hosts/:id
    { name: 'hosts list: limit 0', method: 'GET', url: '/v1/hosts?limit=0', status: 400, code: 'VALIDATION_FAILED', field: /limit/ },
    {
      name: 'hosts list: limit not a number',
      method: 'GET',
      url: '/v1/hosts?limit=lots',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /limit/,
    },
    {
      name: 'hosts list: limit above the maximum',
      method: 'GET',
      url: '/v1/hosts?limit=100000',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /limit/,
    },
    { name: 'hosts list: forged cursor', method: 'GET', url: '/v1/hosts?cursor=not-a-cursor', status: 400, code: 'INVALID_CURSOR' },
    {
      name: 'hosts list: cursor of the wrong shape',
      method: 'GET',
      url: `/v1/hosts?cursor=${Buffer.from('{"a":1}').toString('base64url')}`,
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'hosts list: bad after position',
      method: 'GET',
      url: '/v1/hosts?after=yesterday',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /after/,
    },
    {
      name: 'hosts list: include_deregistered not a boolean',
      method: 'GET',
      url: '/v1/hosts?include_deregistered=maybe',
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    {
      name: 'host get: id not an id',
      method: 'GET',
      url: '/v1/hosts/NOT%20AN%20ID',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /params\.id/,
    },
    { name: 'host get: unknown host', method: 'GET', url: '/v1/hosts/nope', status: 404, code: 'HOST_NOT_FOUND' },
    {
      name: 'host get: bad after position',
      method: 'GET',
      url: '/v1/hosts/h1?after=0-0',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /after/,
    },
    // cordon / uncordon / probe / deregister
    { name: 'cordon: malformed JSON', method: 'POST', url: '/v1/hosts/h1/cordon', opts: json('{'), status: 400, code: 'MALFORMED_JSON' },
    {
      name: 'cordon: reason of the wrong type',
      method: 'POST',
      url: '/v1/hosts/h1/cordon',
      opts: { body: { reason: 5 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /reason/,
    },
    {
      name: 'cordon: unknown field',
      method: 'POST',
      url: '/v1/hosts/h1/cordon',
      opts: { body: { force: true } },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    { name: 'cordon: unknown host', method: 'POST', url: '/v1/hosts/nope/cordon', status: 404, code: 'HOST_NOT_FOUND' },
    {
      name: 'uncordon: bad id',
      method: 'POST',
      url: '/v1/hosts/-x-/uncordon',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /params\.id/,
    },
    { name: 'probe: unknown host', method: 'POST', url: '/v1/hosts/nope/probe', status: 404, code: 'HOST_NOT_FOUND' },
    {
      name: 'deregister: force not a boolean',
      method: 'DELETE',
      url: '/v1/hosts/h1?force=yes-please',
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /force/,
    },
    { name: 'deregister: unknown host', method: 'DELETE', url: '/v1/hosts/nope', status: 404, code: 'HOST_NOT_FOUND' },
    // POST /v1/vms
    {
      name: 'vms: malformed JSON',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', ...json('{"image":') },
      status: 400,
      code: 'MALFORMED_JSON',
    },
    { name: 'vms: empty JSON body', method: 'POST', url: '/v1/vms', opts: { as: 'acme', ...json('') }, status: 400, code: 'EMPTY_BODY' },
    {
      name: 'vms: body is a string',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', ...json('"base"') },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    {
      name: 'vms: wrong type',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { cpus: 'two' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /cpus/,
    },
    {
      name: 'vms: fractional cpus',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { cpus: 1.5 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /cpus/,
    },
    {
      name: 'vms: unknown field',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { image: 'base', tenant_id: 'globex' } },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    {
      name: 'vms: cpus above the fleet maximum',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { cpus: 1000 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /cpus/,
    },
    {
      name: 'vms: ram below the minimum',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { ram_mb: 1 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /ram_mb/,
    },
    {
      name: 'vms: image and seed_snapshot_id',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { image: 'base', seed_snapshot_id: 'snap-1' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /seed_snapshot_id/,
    },
    {
      name: 'vms: gpu_kind without gpus',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { gpu_kind: 'a100' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /gpu_kind/,
    },
    {
      name: 'vms: gpu_profile without gpus',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { gpus: 0, gpu_profile: '1g.10gb' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /gpu_profile/,
    },
    {
      name: 'vms: startup script timeout above the fleet maximum',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { startup_script: 'true', startup_script_timeout_s: 3600 } },
      status: 400,
      code: 'STARTUP_SCRIPT_TIMEOUT_TOO_LARGE',
      field: /startup_script_timeout_s/,
    },
    {
      name: 'vms: startup timeout without a script',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { startup_script_timeout_s: 5 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /startup_script_timeout_s/,
    },
    {
      name: 'vms: file under /etc/fleet',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { files: { '/etc/fleet/token': 'eA==' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /files/,
    },
    {
      name: 'vms: file path walking into /etc/fleet',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { files: { '/etc/x/../fleet/token': 'eA==' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /files/,
    },
    {
      name: 'vms: relative file path',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { files: { 'tmp/x': 'eA==' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /files/,
    },
    {
      name: 'vms: file content not base64',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { files: { '/tmp/x': 'not base64!' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /files/,
    },
    {
      name: 'vms: agent file under /etc/fleet',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { agent: { command: 'sleep 1', files: { '/etc/fleet/agent': 'eA==' } } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /agent/,
    },
    {
      name: 'vms: expose port 0',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { expose: [{ port: 0, as: 'web' }] } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /expose/,
    },
    {
      name: 'vms: expose port 70000',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { expose: [{ port: 70000, as: 'web' }] } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /expose/,
    },
    {
      name: 'vms: expose protocol sctp',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { expose: [{ port: 80, as: 'web', protocol: 'sctp' }] } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /expose/,
    },
    {
      name: 'vms: expose label twice',
      method: 'POST',
      url: '/v1/vms',
      opts: {
        as: 'acme',
        body: {
          expose: [
            { port: 80, as: 'web' },
            { port: 81, as: 'web' },
          ],
        },
      },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /expose/,
    },
    {
      name: 'vms: host_id not an id',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { host_id: '../h1' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /host_id/,
    },
    {
      name: 'vms: healthcheck with both probes',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: { healthcheck: { http: { port: 80 }, exec: ['true'] } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /healthcheck/,
    },
    {
      name: 'vms: Idempotency-Key too long',
      method: 'POST',
      url: '/v1/vms',
      opts: { as: 'acme', body: spec, headers: { 'idempotency-key': 'k'.repeat(201) } },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    // GET /v1/vms
    {
      name: 'vms list: limit negative',
      method: 'GET',
      url: '/v1/vms?limit=-1',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /limit/,
    },
    {
      name: 'vms list: unknown state',
      method: 'GET',
      url: '/v1/vms?state=sleeping',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /state/,
    },
    {
      name: 'vms list: forged cursor',
      method: 'GET',
      url: '/v1/vms?cursor=%7B%7D',
      opts: { as: 'acme' },
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'vms list: a hosts cursor',
      method: 'GET',
      url: `/v1/vms?cursor=${Buffer.from('"h1"').toString('base64url')}`,
      opts: { as: 'acme' },
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'vms list: bad after position',
      method: 'GET',
      url: '/v1/vms?after=123',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /after/,
    },
    // one VM
    {
      name: 'vm get: unknown',
      method: 'GET',
      url: '/v1/vms/0123456789abcdef01234567',
      opts: { as: 'acme' },
      status: 404,
      code: 'VM_NOT_FOUND',
    },
    {
      name: 'vm get: id too long',
      method: 'GET',
      url: `/v1/vms/${'a'.repeat(65)}`,
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /params\.id/,
    },
    {
      name: 'vm get: bad after position',
      method: 'GET',
      url: `/v1/vms/${VM}?after=zz-zz`,
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /after/,
    },
    {
      name: 'vm delete: unknown',
      method: 'DELETE',
      url: '/v1/vms/does-not-exist',
      opts: { as: 'acme' },
      status: 404,
      code: 'VM_NOT_FOUND',
    },
    { name: 'vm delete: not an id', method: 'DELETE', url: '/v1/vms/UPPER_case', opts: { as: 'acme' }, status: 404, code: 'VM_NOT_FOUND' },
    {
      name: 'placement: unknown',
      method: 'GET',
      url: '/v1/vms/does-not-exist/placement',
      opts: { as: 'acme' },
      status: 404,
      code: 'VM_NOT_FOUND',
    },
    // exec
    {
      name: 'exec: malformed JSON',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', ...json('{"argv":[') },
      status: 400,
      code: 'MALFORMED_JSON',
    },
    {
      name: 'exec: empty argv',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: [] } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /argv/,
    },
    {
      name: 'exec: argv a string',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: 'ls -l' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /argv/,
    },
    {
      name: 'exec: bad env name',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: ['true'], env: { 'A-B': 'x' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /env/,
    },
    {
      name: 'exec: relative cwd',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: ['true'], cwd: 'tmp' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /cwd/,
    },
    {
      name: 'exec: negative timeout',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: ['true'], timeout_ms: -1 } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /timeout_ms/,
    },
    {
      name: 'exec: stdin not base64',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: ['cat'], stdin: '%%%' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /stdin/,
    },
    {
      name: 'exec: unknown field',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: ['true'], user: 'root' } },
      status: 400,
      code: 'VALIDATION_FAILED',
    },
    {
      name: 'exec: unknown VM',
      method: 'POST',
      url: '/v1/vms/does-not-exist/exec',
      opts: { as: 'acme', body: { argv: ['true'] } },
      status: 404,
      code: 'VM_NOT_FOUND',
    },
    {
      name: 'exec stream: not a websocket',
      method: 'GET',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme' },
      status: 400,
      code: 'WEBSOCKET_REQUIRED',
    },
    {
      name: 'attach: not a websocket',
      method: 'GET',
      url: `/v1/vms/${VM}/attach`,
      opts: { as: 'acme' },
      status: 400,
      code: 'WEBSOCKET_REQUIRED',
    },
    // files
    {
      name: 'upload: no path',
      method: 'PUT',
      url: `/v1/vms/${VM}/files`,
      opts: { as: 'acme', rawBody: 'x', contentType: 'application/octet-stream' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /path/,
    },
    {
      name: 'upload: relative path',
      method: 'PUT',
      url: `/v1/vms/${VM}/files?path=tmp/x`,
      opts: { as: 'acme', rawBody: 'x', contentType: 'application/octet-stream' },
      status: 400,
      code: 'INVALID_GUEST_PATH',
    },
    {
      name: 'upload: dot-dot path',
      method: 'PUT',
      url: `/v1/vms/${VM}/files?path=/tmp/../../x`,
      opts: { as: 'acme', rawBody: 'x', contentType: 'application/octet-stream' },
      status: 400,
      code: 'INVALID_GUEST_PATH',
    },
    {
      name: 'upload: under /etc/fleet',
      method: 'PUT',
      url: `/v1/vms/${VM}/files?path=/etc/fleet/token`,
      opts: { as: 'acme', rawBody: 'x', contentType: 'application/octet-stream' },
      status: 400,
      code: 'RESERVED_GUEST_PATH',
    },
    {
      name: 'upload: unknown VM',
      method: 'PUT',
      url: '/v1/vms/does-not-exist/files?path=/tmp/x',
      opts: { as: 'acme', rawBody: 'x', contentType: 'application/octet-stream' },
      status: 404,
      code: 'VM_NOT_FOUND',
    },
    {
      name: 'download: no path',
      method: 'GET',
      url: `/v1/vms/${VM}/files`,
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /path/,
    },
    {
      name: 'download: NUL in path',
      method: 'GET',
      url: `/v1/vms/${VM}/files?path=/tmp/a%00b`,
      opts: { as: 'acme' },
      status: 400,
      code: 'INVALID_GUEST_PATH',
    },
    // NUL (U+0000): Postgres refuses it in text and jsonb, so it must be refused before any query or append
    {
      name: 'vms list: NUL in a filter',
      method: 'GET',
      url: '/v1/vms?task_id=a%00b',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /querystring\.task_id/,
    },
    {
      name: 'vm get: NUL in the id',
      method: 'GET',
      url: '/v1/vms/a%00b',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /params\.id/,
    },
    {
      name: 'snapshots list: NUL in a filter',
      method: 'GET',
      url: '/v1/snapshots?name=a%00',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /querystring\.name/,
    },
    {
      name: 'layers: NUL in arch',
      method: 'GET',
      url: '/v1/layers/abc?arch=x%00',
      opts: { as: 'acme' },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /querystring\.arch/,
    },
    {
      name: 'snapshot create: NUL in the comment',
      method: 'POST',
      url: `/v1/vms/${VM}/snapshots`,
      opts: { as: 'acme', body: { comment: 'a\u0000b' } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.comment/,
    },
    {
      name: 'snapshot create: NUL in a metadata key',
      method: 'POST',
      url: `/v1/vms/${VM}/snapshots`,
      opts: { as: 'acme', body: { metadata: { 'a\u0000': 'b' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.metadata/,
    },
    {
      name: 'exec: NUL in an env value',
      method: 'POST',
      url: `/v1/vms/${VM}/exec`,
      opts: { as: 'acme', body: { argv: ['true'], env: { A: 'x\u0000' } } },
      status: 400,
      code: 'VALIDATION_FAILED',
      field: /body\.env\.A/,
    },
    // cursors: their values go to SQL, so a forged one must fail here, not there
    {
      name: 'vms list: cursor with a time the API never wrote',
      method: 'GET',
      url: `/v1/vms?cursor=${Buffer.from('{"created_at":"garbage","id":"x"}').toString('base64url')}`,
      opts: { as: 'acme' },
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'vms list: cursor with NUL in the id',
      method: 'GET',
      url: `/v1/vms?cursor=${Buffer.from('{"created_at":"2026-01-01T00:00:00.000Z","id":"a\\u0000"}').toString('base64url')}`,
      opts: { as: 'acme' },
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'snapshots list: cursor with a time the API never wrote',
      method: 'GET',
      url: `/v1/snapshots?cursor=${Buffer.from('{"created_at":"garbage","id":"x"}').toString('base64url')}`,
      opts: { as: 'acme' },
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'dead letters list: cursor with a time the API never wrote',
      method: 'GET',
      url: `/v1/dead-letters?cursor=${Buffer.from('{"last_seen_at":"garbage","id":"x"}').toString('base64url')}`,
      status: 400,
      code: 'INVALID_CURSOR',
    },
    {
      name: 'hosts list: cursor with NUL',
      method: 'GET',
      url: `/v1/hosts?cursor=${Buffer.from('"a\\u0000"').toString('base64url')}`,
      status: 400,
      code: 'INVALID_CURSOR',
    },
  ];
}

describe('bad input on every route: 4xx problem with a stable code, never a 500', { timeout: 120_000 }, () => {
  let cp: ControlPlane;
  let stub: StubAgents;
  let vmId = '';

  before(async () => {
    stub = await startStubAgents();
    cp = await startControlPlane();
    const { url, token } = stub.add('h1', { vm_count: 8 });
    const reg = await cp.request('POST', '/v1/hosts', { body: { id: 'h1', url, token } });
    assert.equal(reg.status, 201, JSON.stringify(reg.body));
    await cp.service.runner.waitFor(reg.body.position, 20_000);
    const vm = await cp.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base' } });
    assert.equal(vm.status, 201, JSON.stringify(vm.body));
    vmId = vm.body.id;
    // The create's last event is committed, but on Postgres a reader sees it only once older open
    // transactions end (xmin): wait until it is visible, so `head` below is really the head.
    await cp.service.runner.waitFor(vm.body.position, 20_000);
  });
  after(async () => {
    await cp?.close();
    await stub?.close();
  });

  it('every case of the table', async () => {
    const head = await cp.service.store.headPosition();
    const failures: string[] = [];
    for (const c of cases()) {
      const r = await cp.request(c.method, c.url.replace(VM, vmId), c.opts);
      const body = r.body as {
        type?: string;
        title?: string;
        status?: number;
        code?: string;
        detail?: string;
        errors?: Array<{ path: string }>;
      };
      const problems: string[] = [];
      if (r.status !== c.status) problems.push(`status ${r.status}, want ${c.status}`);
      if (!/application\/problem\+json/.test(String(r.headers['content-type'])))
        problems.push(`content-type ${String(r.headers['content-type'])}`);
      if (body?.code !== c.code) problems.push(`code ${body?.code}, want ${c.code}`);
      if (body?.status !== r.status || !body?.type || !body?.title || !body?.detail) problems.push('not a complete problem document');
      if (c.field && !(body.errors ?? []).some((e) => c.field!.test(e.path)) && !c.field.test(body.detail ?? ''))
        problems.push(`no error naming ${c.field}`);
      if (problems.length)
        failures.push(`${c.name} (${c.method} ${c.url}): ${problems.join('; ')} — ${JSON.stringify(r.body).slice(0, 300)}`);
    }
    assert.deepEqual(failures, []);
    // Nothing was recorded by any refused request.
    const recorded = await cp.service.store.readAll({ after: head });
    assert.deepEqual(
      recorded.map((e) => `${e.streamId} ${e.type} ${JSON.stringify(e.data).slice(0, 200)}`),
      [],
    );
  });

  it('a refused create leaves no VM behind and the stub saw no call', async () => {
    const calls = stub.calls.creates;
    const r = await cp.request('POST', '/v1/vms', { as: 'acme', body: { startup_script: 'true', startup_script_timeout_s: 3600 } });
    assert.equal(r.status, 400);
    assert.match(r.body.detail, /startup script timeout 3600s is above the fleet maximum of 50s/);
    assert.equal(stub.calls.creates, calls);
    const listed = await cp.request('GET', '/v1/vms', { as: 'acme' });
    assert.deepEqual(
      listed.body.vms.map((v: { id: string }) => v.id),
      [vmId],
    );
  });

  it('a NUL in what an agent says (quoted in a failure) is stored as U+FFFD, and the read models keep going', async () => {
    const h1 = stub.hosts.get('h1')!;
    h1.failCreateWith = 500;
    h1.failCreateMessage = 'disk said \u0000 and stopped';
    try {
      const r = await cp.request('POST', '/v1/vms', { as: 'acme', body: { image: 'base' } });
      assert.ok(r.status >= 400, JSON.stringify(r.body));
    } finally {
      h1.failCreateWith = undefined;
      h1.failCreateMessage = undefined;
    }
    // A read model stopped at the failure event would never show it. Not waitFor(headPosition()): the head is the
    // last event every reader can see, and the failure, committed, stays unseen while a transaction with an older
    // txid (a projection's, the host's release) is still open, so that head can be the one before it.
    const failed = await eventually(
      async () => {
        const listed = await cp.request('GET', '/v1/vms?state=failed', { as: 'acme' });
        return listed.body.vms.length > 0 && listed;
      },
      10_000,
      'the failed VM listed',
    );
    assert.equal(failed.body.vms.length, 1, JSON.stringify(failed.body));
    assert.match(failed.body.vms[0].error, /disk said \uFFFD and stopped/);
  });
});
