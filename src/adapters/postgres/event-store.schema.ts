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
  {
    id: 'event-store/003-append-batch',
    sql: `
-- Group commit: every append of one flush in one transaction, each with its own outcome.
-- Per append (1-based, in the order the writer queued them): p_streams, p_expected, p_counts.
-- Per event, flattened in append order: p_event_append (its append's index), p_event_pos (1-based
-- within its append), then the same columns as es_append. The caller never puts two appends of one
-- stream that share an event id in one flush (the second goes in the next), so "already there" is
-- decided against committed rows only.
-- Returns one row per append: ord, then status/revision/txid/seq exactly as es_append would have
-- answered had the appends run one after another in that order.
CREATE FUNCTION es_append_batch(p_streams text[], p_expected text[], p_counts int[], p_event_append int[], p_event_pos int[],
                                p_ids uuid[], p_types text[], p_data text[], p_metadata text[], p_notify boolean DEFAULT false)
RETURNS TABLE (ord int, status text, revision bigint, txid text, seq bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  n        int := cardinality(p_streams);
  v_total  int := cardinality(p_ids);
  v_names  text[];
  v_heads  bigint[];
  v_found  int[];
  v_frev   bigint[];
  v_status text[] := array_fill(NULL::text, ARRAY[n]);
  v_rev    bigint[] := array_fill(NULL::bigint, ARRAY[n]);
  v_base   bigint[] := array_fill(NULL::bigint, ARRAY[n]);
  v_any_ok boolean := false;
  v_txid   xid8;
  k        int;
  cur      bigint;
BEGIN
  IF n = 0 OR cardinality(p_expected) <> n OR cardinality(p_counts) <> n
     OR v_total = 0 OR cardinality(p_event_append) <> v_total OR cardinality(p_event_pos) <> v_total
     OR cardinality(p_types) <> v_total OR cardinality(p_data) <> v_total OR cardinality(p_metadata) <> v_total
     OR (SELECT sum(c) FROM unnest(p_counts) c) <> v_total THEN
    RAISE EXCEPTION 'es_append_batch: inconsistent array lengths' USING ERRCODE = '22023';
  END IF;
  -- The same per-stream locks as es_append, taken in one fixed order so two flushes cannot deadlock.
  PERFORM pg_advisory_xact_lock(${STREAM_LOCK_CLASS}, l.k)
     FROM (SELECT DISTINCT hashtext(s) AS k FROM unnest(p_streams) s ORDER BY 1 OFFSET 0) l;
  -- New statements, so a snapshot that sees what the previous holders of those locks committed.
  SELECT array_agg(d.s ORDER BY d.s),
         array_agg((SELECT e.revision FROM es_events e WHERE e.stream_id = d.s ORDER BY e.revision DESC LIMIT 1) ORDER BY d.s)
    INTO v_names, v_heads
    FROM (SELECT DISTINCT s FROM unnest(p_streams) s) d;
  -- Each probe a LATERAL ... LIMIT 1, which the planner cannot flatten into a join: this function's plans are
  -- cached per connection, and a generic plan made while the table was small would otherwise go on hashing all of it.
  SELECT array_agg(coalesce(f.cnt, 0) ORDER BY a.o), array_agg(f.maxrev ORDER BY a.o)
    INTO v_found, v_frev
    FROM generate_subscripts(p_streams, 1) a(o)
    LEFT JOIN (SELECT x.a, count(e.revision)::int AS cnt, max(e.revision) AS maxrev
                 FROM unnest(p_event_append, p_ids) x(a, id)
                 CROSS JOIN LATERAL (SELECT e.revision FROM es_events e WHERE e.stream_id = p_streams[x.a] AND e.event_id = x.id LIMIT 1) e
                GROUP BY x.a) f ON f.a = a.o;

  FOR i IN 1..n LOOP
    k := array_position(v_names, p_streams[i]);
    cur := v_heads[k];
    IF cur IS NOT NULL AND v_found[i] = p_counts[i] THEN
      v_status[i] := 'idempotent';
      v_rev[i] := v_frev[i];
    ELSIF cur IS NOT NULL AND v_found[i] > 0 THEN
      v_status[i] := 'partial';
      v_rev[i] := cur;
    ELSIF cur IS NOT NULL AND (p_expected[i] = 'no_stream' OR (p_expected[i] ~ '^[0-9]+$' AND p_expected[i]::bigint <> cur)) THEN
      v_status[i] := 'conflict';
      v_rev[i] := cur;
    ELSIF cur IS NULL AND p_expected[i] <> 'no_stream' AND p_expected[i] <> 'any' THEN
      v_status[i] := 'conflict';
    ELSE
      v_status[i] := 'ok';
      v_base[i] := coalesce(cur, -1);
      v_heads[k] := v_base[i] + p_counts[i];
      v_rev[i] := v_heads[k];
      v_any_ok := true;
    END IF;
  END LOOP;

  IF v_any_ok THEN
    v_txid := pg_current_xact_id();
    IF p_notify THEN
      PERFORM pg_notify('${EVENTS_CHANNEL}', '');
    END IF;
  END IF;
  RETURN QUERY
    WITH ins AS (
      INSERT INTO es_events (txid, stream_id, revision, event_id, type, data, metadata)
      SELECT v_txid, p_streams[x.a], v_base[x.a] + x.pos, x.id, x.type, x.data::json, x.metadata::json
        FROM unnest(p_event_append, p_event_pos, p_ids, p_types, p_data, p_metadata) WITH ORDINALITY AS x(a, pos, id, type, data, metadata, o)
       WHERE v_status[x.a] = 'ok'
       ORDER BY x.o
      RETURNING es_events.stream_id, es_events.revision, es_events.seq
    )
    SELECT a.o, v_status[a.o], v_rev[a.o],
           CASE v_status[a.o] WHEN 'ok' THEN v_txid::text WHEN 'idempotent' THEN old.txid::text END,
           CASE v_status[a.o] WHEN 'ok' THEN ins.seq WHEN 'idempotent' THEN old.seq END
      FROM generate_subscripts(p_streams, 1) a(o)
      LEFT JOIN ins ON v_status[a.o] = 'ok' AND ins.stream_id = p_streams[a.o] AND ins.revision = v_rev[a.o]
      -- a primary-key probe per idempotent append (LATERAL ... LIMIT 1, as above)
      LEFT JOIN LATERAL (SELECT e.txid, e.seq FROM es_events e
                          WHERE v_status[a.o] = 'idempotent' AND e.stream_id = p_streams[a.o] AND e.revision = v_rev[a.o] LIMIT 1) old ON true
     ORDER BY a.o;
END
$fn$;
`,
  },
];
