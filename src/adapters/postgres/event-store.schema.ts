import type { Migration } from './migrations.js';

/** NOTIFY channel the append function signals; payload empty (subscribers re-read, they never trust a payload). */
export const EVENTS_CHANNEL = 'es_events';

/** First key of the per-stream advisory lock (the second is hashtext(stream)). */
const STREAM_LOCK_CLASS = 0x45_53; // 'ES'

/**
 * Events live in `es_events`. An append takes a transaction-scoped advisory
 * lock on its stream's name (migration 002; 001 locked a row of `es_streams`,
 * which cost two extra tuple writes and their WAL per append), so appends to
 * one stream serialise while appends to different streams run in parallel.
 * The primary key (stream_id, revision) stays the last line of defence.
 *
 * Global order is (txid, seq): `seq` comes from a sequence, and sequence order
 * is not commit order (a slow transaction holding seq 10 can commit after the
 * one holding seq 11 became visible). Readers therefore only return rows whose
 * txid is below the xmin of their snapshot: every transaction that could still
 * commit has a txid >= xmin, so nothing can later appear before a position a
 * reader has passed.
 *
 * Data and metadata are `json`, not `jsonb`: the text we validated is stored
 * as is, so whatever JSON the port accepts (a "\u0000" in a string included,
 * which jsonb refuses) reads back the same.
 */
export const eventStoreMigrations: readonly Migration[] = [
  {
    id: 'event-store/001-events',
    sql: `
CREATE TABLE es_streams (
  stream_id text PRIMARY KEY,
  revision  bigint NOT NULL
);

CREATE TABLE es_events (
  seq       bigint GENERATED ALWAYS AS IDENTITY,
  txid      xid8 NOT NULL,
  stream_id text NOT NULL,
  revision  bigint NOT NULL,
  event_id  uuid NOT NULL,
  type      text NOT NULL,
  data      json NOT NULL,
  metadata  json,
  created   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (stream_id, revision)
);
CREATE UNIQUE INDEX es_events_global_order ON es_events (txid, seq);
CREATE UNIQUE INDEX es_events_stream_event_id ON es_events (stream_id, event_id);

-- One round trip per append. p_expected: 'no_stream' | 'stream_exists' | 'any' | decimal revision.
-- One array element per event; data and metadata are JSON text (metadata NULL when absent): passed as
-- text, not inside one JSON document, because extracting from json de-escapes and rejects an escaped NUL character.
-- Returns one row:
--   status 'ok'          revision = new stream revision, (txid, seq) = last appended event
--   status 'idempotent'  every id already in the stream: revision and (txid, seq) of the last of them
--   status 'conflict'    revision = actual stream revision, NULL when the stream does not exist
--   status 'partial'     some ids, not all, are already in the stream; nothing written
CREATE FUNCTION es_append(p_stream text, p_expected text, p_ids uuid[], p_types text[], p_data text[], p_metadata text[], p_notify boolean DEFAULT true)
RETURNS TABLE (status text, revision bigint, txid text, seq bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  v_count    int := cardinality(p_ids);
  v_current  bigint;
  v_exists   boolean;
  v_found    int;
  v_txid     xid8;
  v_seq      bigint;
  v_rev      bigint;
BEGIN
  IF v_count = 0 OR cardinality(p_types) <> v_count OR cardinality(p_data) <> v_count OR cardinality(p_metadata) <> v_count THEN
    RAISE EXCEPTION 'es_append: the event arrays must be non-empty and of equal length' USING ERRCODE = '22023';
  END IF;
  LOOP
    SELECT s.revision INTO v_current FROM es_streams s WHERE s.stream_id = p_stream FOR UPDATE;
    IF FOUND THEN
      v_exists := true;
      EXIT;
    END IF;
    IF p_expected <> 'no_stream' AND p_expected <> 'any' THEN
      RETURN QUERY SELECT 'conflict'::text, NULL::bigint, NULL::text, NULL::bigint;
      RETURN;
    END IF;
    -- Claim the stream; the inserted row stays locked by us until commit.
    INSERT INTO es_streams (stream_id, revision) VALUES (p_stream, -1) ON CONFLICT DO NOTHING;
    IF FOUND THEN
      v_exists := false;
      v_current := -1;
      EXIT;
    END IF;
    -- Another writer created it meanwhile: loop to lock its row and check again.
  END LOOP;

  IF v_exists THEN
    SELECT count(*)::int, max(e.revision) INTO v_found, v_rev
      FROM es_events e
     WHERE e.stream_id = p_stream
       AND e.event_id = ANY(p_ids);
    IF v_found = v_count THEN
      RETURN QUERY SELECT 'idempotent'::text, e.revision, e.txid::text, e.seq
        FROM es_events e WHERE e.stream_id = p_stream AND e.revision = v_rev;
      RETURN;
    ELSIF v_found > 0 THEN
      RETURN QUERY SELECT 'partial'::text, v_current, NULL::text, NULL::bigint;
      RETURN;
    END IF;
    IF p_expected = 'no_stream' OR (p_expected ~ '^[0-9]+$' AND p_expected::bigint <> v_current) THEN
      RETURN QUERY SELECT 'conflict'::text, v_current, NULL::text, NULL::bigint;
      RETURN;
    END IF;
  END IF;

  v_txid := pg_current_xact_id();
  WITH ins AS (
    INSERT INTO es_events (txid, stream_id, revision, event_id, type, data, metadata)
    SELECT v_txid, p_stream, v_current + x.ord, x.id, x.type, x.data::json, x.metadata::json
      FROM unnest(p_ids, p_types, p_data, p_metadata) WITH ORDINALITY AS x(id, type, data, metadata, ord)
     ORDER BY x.ord
    RETURNING es_events.seq
  )
  SELECT max(ins.seq) INTO v_seq FROM ins;
  UPDATE es_streams SET revision = v_current + v_count WHERE stream_id = p_stream;
  IF p_notify THEN
    PERFORM pg_notify('${EVENTS_CHANNEL}', '');
  END IF;
  RETURN QUERY SELECT 'ok'::text, v_current + v_count, v_txid::text, v_seq;
END
$fn$;
`,
  },
  {
    id: 'event-store/002-append-advisory-lock',
    sql: `
CREATE OR REPLACE FUNCTION es_append(p_stream text, p_expected text, p_ids uuid[], p_types text[], p_data text[], p_metadata text[], p_notify boolean DEFAULT true)
RETURNS TABLE (status text, revision bigint, txid text, seq bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  v_count    int := cardinality(p_ids);
  v_current  bigint;
  v_found    int;
  v_txid     xid8;
  v_seq      bigint;
  v_rev      bigint;
BEGIN
  IF v_count = 0 OR cardinality(p_types) <> v_count OR cardinality(p_data) <> v_count OR cardinality(p_metadata) <> v_count THEN
    RAISE EXCEPTION 'es_append: the event arrays must be non-empty and of equal length' USING ERRCODE = '22023';
  END IF;
  -- Two-key advisory locks are their own space: no clash with runMigrations' one-key lock. A hash
  -- collision only makes two streams take turns.
  PERFORM pg_advisory_xact_lock(${STREAM_LOCK_CLASS}, hashtext(p_stream));
  -- A new statement, so a new snapshot: it sees whatever the previous holder of the lock committed.
  SELECT e.revision INTO v_current FROM es_events e WHERE e.stream_id = p_stream ORDER BY e.revision DESC LIMIT 1;

  IF v_current IS NOT NULL THEN
    SELECT count(*)::int, max(e.revision) INTO v_found, v_rev
      FROM es_events e
     WHERE e.stream_id = p_stream AND e.event_id = ANY(p_ids);
    IF v_found = v_count THEN
      RETURN QUERY SELECT 'idempotent'::text, e.revision, e.txid::text, e.seq
        FROM es_events e WHERE e.stream_id = p_stream AND e.revision = v_rev;
      RETURN;
    ELSIF v_found > 0 THEN
      RETURN QUERY SELECT 'partial'::text, v_current, NULL::text, NULL::bigint;
      RETURN;
    END IF;
    IF p_expected = 'no_stream' OR (p_expected ~ '^[0-9]+$' AND p_expected::bigint <> v_current) THEN
      RETURN QUERY SELECT 'conflict'::text, v_current, NULL::text, NULL::bigint;
      RETURN;
    END IF;
  ELSE
    IF p_expected <> 'no_stream' AND p_expected <> 'any' THEN
      RETURN QUERY SELECT 'conflict'::text, NULL::bigint, NULL::text, NULL::bigint;
      RETURN;
    END IF;
    v_current := -1;
  END IF;

  v_txid := pg_current_xact_id();
  WITH ins AS (
    INSERT INTO es_events (txid, stream_id, revision, event_id, type, data, metadata)
    SELECT v_txid, p_stream, v_current + x.ord, x.id, x.type, x.data::json, x.metadata::json
      FROM unnest(p_ids, p_types, p_data, p_metadata) WITH ORDINALITY AS x(id, type, data, metadata, ord)
     ORDER BY x.ord
    RETURNING es_events.seq
  )
  SELECT max(ins.seq) INTO v_seq FROM ins;
  IF p_notify THEN
    PERFORM pg_notify('${EVENTS_CHANNEL}', '');
  END IF;
  RETURN QUERY SELECT 'ok'::text, v_current + v_count, v_txid::text, v_seq;
END
$fn$;

DROP TABLE es_streams;
`,
  },
];
