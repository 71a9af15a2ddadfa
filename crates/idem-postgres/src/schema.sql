-- The idem-postgres schema, version 1. Every name here starts with the table prefix
-- (default shown); the store creates this on its first start and records the version.

CREATE TABLE idem_schema_version (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version   integer NOT NULL
);

-- Fences for every scope come from one sequence, so they grow across release, takeover
-- and expiry. It starts at the database clock in microseconds: a schema dropped and
-- created again still hands out fences above the old ones (far fewer than a million
-- claims a second are made, so the sequence never catches up with the clock).
CREATE SEQUENCE idem_fence AS bigint;
SELECT setval('idem_fence', (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);

-- One row per record. state: 'i' in flight, 'p' in flight with the handler's writes
-- committed (its response not recorded yet), 'c' completed, 'r' released (tombstone).
-- A row whose expires_at has passed counts as absent; the sweeper deletes it later.
CREATE TABLE idem_records (
    scope        bytea       PRIMARY KEY,   -- 32-byte digest of (tenant, method, key)
    tenant       bytea       NOT NULL,      -- 16-byte tenant digest
    state        text        NOT NULL,
    fence        bigint      NOT NULL,
    fingerprint  bytea,                     -- 32 bytes (in flight, completed)
    claimant     bytea,                     -- 16 bytes (in flight)
    lease_until  timestamptz,               -- database clock (in flight)
    outcome_kind text,                      -- 'r' response kept, 'n' not retained
    outcome      bytea,                     -- the encoded response (completed)
    watched      boolean     NOT NULL DEFAULT false,  -- a waiter listens: notify on change
    expires_at   timestamptz NOT NULL
);
CREATE INDEX idem_records_expires_at ON idem_records (expires_at);

-- Claims the record or reports what holds it, in one round trip.
-- o_tag: 'A' acquired (o_fence, o_takeover), 'C' completed (o_outcome_kind, o_outcome),
-- 'I' in flight (o_lease_left_us), 'M' fingerprint mismatch.
CREATE FUNCTION idem_claim(
    p_scope bytea, p_tenant bytea, p_fingerprint bytea, p_claimant bytea,
    p_lease_us bigint, p_tombstone_us bigint,
    OUT o_tag text, OUT o_fence bigint, OUT o_takeover boolean,
    OUT o_lease_left_us bigint, OUT o_outcome_kind text, OUT o_outcome bytea)
LANGUAGE plpgsql AS $fn$
DECLARE
    r idem_records%ROWTYPE;
    lease interval := p_lease_us * interval '1 microsecond';
    keep interval := (p_lease_us + p_tombstone_us) * interval '1 microsecond';
    t timestamptz;
BEGIN
    SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
    IF NOT FOUND THEN
        t := clock_timestamp();
        o_fence := nextval('idem_fence');
        INSERT INTO idem_records
            (scope, tenant, state, fence, fingerprint, claimant, lease_until, expires_at)
        VALUES (p_scope, p_tenant, 'i', o_fence, p_fingerprint, p_claimant, t + lease, t + keep)
        ON CONFLICT (scope) DO NOTHING;
        IF FOUND THEN
            o_tag := 'A';
            o_takeover := false;
            RETURN;
        END IF;
        -- A concurrent claim inserted it first: answer from its row.
        o_fence := NULL;
        SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idem: record vanished during claim' USING ERRCODE = '40001';
        END IF;
    END IF;
    -- Judged after the row lock is held, on the database clock.
    t := clock_timestamp();
    IF r.expires_at <= t OR r.state = 'r' THEN
        -- Expired (not swept yet) or released: a new run, with a new fence.
        o_fence := nextval('idem_fence');
        UPDATE idem_records SET tenant = p_tenant, state = 'i', fence = o_fence,
            fingerprint = p_fingerprint, claimant = p_claimant, lease_until = t + lease,
            outcome_kind = NULL, outcome = NULL, watched = false, expires_at = t + keep
        WHERE scope = p_scope;
        o_tag := 'A';
        o_takeover := false;
        RETURN;
    END IF;
    IF r.state NOT IN ('i', 'p', 'c') OR r.fence < 1 OR r.fingerprint IS NULL
        OR length(r.fingerprint) <> 32 OR (r.state <> 'c' AND r.lease_until IS NULL) THEN
        RAISE EXCEPTION 'idem: malformed record (state %, fence %)', r.state, r.fence
            USING ERRCODE = 'IC001';
    END IF;
    IF r.fingerprint <> p_fingerprint THEN
        o_tag := 'M';
        RETURN;
    END IF;
    IF r.state = 'c' THEN
        o_tag := 'C';
        o_fence := r.fence;
        o_outcome_kind := r.outcome_kind;
        o_outcome := r.outcome;
        RETURN;
    END IF;
    IF r.lease_until > t THEN
        IF r.claimant = p_claimant THEN
            -- The same claim sent again (its reply was lost): same fence, lease extended.
            UPDATE idem_records SET lease_until = greatest(lease_until, t + lease),
                expires_at = greatest(expires_at, t + keep)
            WHERE scope = p_scope;
            o_tag := 'A';
            o_fence := r.fence;
            o_takeover := false;
            RETURN;
        END IF;
        o_tag := 'I';
        o_lease_left_us := ceil(extract(epoch FROM r.lease_until - t) * 1000000)::bigint;
        RETURN;
    END IF;
    IF r.state = 'p' THEN
        -- The handler's writes were committed, but its process ended before recording
        -- the response: done, and never run again.
        o_tag := 'C';
        o_fence := r.fence;
        o_outcome_kind := 'n';
        RETURN;
    END IF;
    -- The lease ended (a crash, a long pause): take over with a new fence.
    o_fence := nextval('idem_fence');
    UPDATE idem_records SET state = 'i', fence = o_fence, claimant = p_claimant,
        lease_until = t + lease, watched = false, expires_at = t + keep
    WHERE scope = p_scope;
    o_tag := 'A';
    o_takeover := true;
END
$fn$;

-- The fenced steps. Each succeeds only on an in-flight record with the presented fence;
-- otherwise o_ok is false and o_current is the record's fence (null: no record).
CREATE FUNCTION idem_renew(
    p_scope bytea, p_fence bigint, p_lease_us bigint, p_tombstone_us bigint,
    OUT o_ok boolean, OUT o_current bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
    r idem_records%ROWTYPE;
    t timestamptz;
BEGIN
    o_ok := false;
    SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
    t := clock_timestamp();
    IF NOT FOUND OR r.expires_at <= t THEN
        RETURN;
    END IF;
    o_current := r.fence;
    IF r.state NOT IN ('i', 'p') OR r.fence <> p_fence THEN
        RETURN;
    END IF;
    UPDATE idem_records SET lease_until = t + p_lease_us * interval '1 microsecond',
        expires_at = greatest(expires_at,
                              t + (p_lease_us + p_tombstone_us) * interval '1 microsecond')
    WHERE scope = p_scope;
    o_ok := true;
END
$fn$;

CREATE FUNCTION idem_complete(
    p_scope bytea, p_fence bigint, p_outcome_kind text, p_outcome bytea, p_ttl_us bigint,
    OUT o_ok boolean, OUT o_current bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
    r idem_records%ROWTYPE;
    t timestamptz;
BEGIN
    o_ok := false;
    SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
    t := clock_timestamp();
    IF NOT FOUND OR r.expires_at <= t THEN
        RETURN;
    END IF;
    o_current := r.fence;
    IF r.state NOT IN ('i', 'p') OR r.fence <> p_fence THEN
        RETURN;
    END IF;
    UPDATE idem_records SET state = 'c', claimant = NULL, lease_until = NULL,
        outcome_kind = p_outcome_kind, outcome = p_outcome, watched = false,
        expires_at = t + p_ttl_us * interval '1 microsecond'
    WHERE scope = p_scope;
    IF r.watched THEN
        -- Delivered at commit, to the store instances that listen.
        PERFORM pg_notify('idem_done', encode(p_scope, 'hex'));
    END IF;
    o_ok := true;
END
$fn$;

CREATE FUNCTION idem_release(
    p_scope bytea, p_fence bigint, p_tombstone_us bigint,
    OUT o_ok boolean, OUT o_current bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
    r idem_records%ROWTYPE;
    t timestamptz;
BEGIN
    o_ok := false;
    SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
    t := clock_timestamp();
    IF NOT FOUND OR r.expires_at <= t THEN
        RETURN;
    END IF;
    o_current := r.fence;
    IF r.state NOT IN ('i', 'p') OR r.fence <> p_fence THEN
        RETURN;
    END IF;
    IF r.state = 'p' THEN
        -- Its writes were committed: something was done. Completed, response not kept.
        UPDATE idem_records SET state = 'c', claimant = NULL, lease_until = NULL,
            outcome_kind = 'n', outcome = NULL, watched = false,
            expires_at = t + p_tombstone_us * interval '1 microsecond'
        WHERE scope = p_scope;
    ELSE
        -- Nothing was done: the row goes. Fences come from one sequence, so the next
        -- claim's fence is higher without a tombstone, and rejected calls leave nothing.
        DELETE FROM idem_records WHERE scope = p_scope;
    END IF;
    IF r.watched THEN
        PERFORM pg_notify('idem_done', encode(p_scope, 'hex'));
    END IF;
    o_ok := true;
END
$fn$;

-- A waiter's first read: marks an in-flight record as watched (so complete and release
-- notify) and reports its state, fence and lease time left.
CREATE FUNCTION idem_watch(
    p_scope bytea, OUT o_state text, OUT o_fence bigint, OUT o_lease_left_us bigint)
LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE idem_records SET watched = true
    WHERE scope = p_scope AND state IN ('i', 'p') AND NOT watched AND expires_at > clock_timestamp();
    SELECT state, fence,
           greatest(0, ceil(extract(epoch FROM lease_until - clock_timestamp()) * 1000000))::bigint
      INTO o_state, o_fence, o_lease_left_us
      FROM idem_records WHERE scope = p_scope AND expires_at > clock_timestamp();
END
$fn$;

-- Transactional completion: called by a handler inside its own transaction, after its
-- writes. Checks the fence of the in-flight record and marks it 'p' (writes committed)
-- with the lease extended; the row stays locked until that transaction ends, so the
-- writes commit only with a current fence, and the mark only with the writes.
CREATE FUNCTION idem_commit(
    p_scope bytea, p_fence bigint, p_lease_us bigint, p_tombstone_us bigint,
    OUT o_ok boolean, OUT o_current bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
    r idem_records%ROWTYPE;
    t timestamptz;
BEGIN
    o_ok := false;
    SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
    t := clock_timestamp();
    IF NOT FOUND OR r.expires_at <= t THEN
        RETURN;
    END IF;
    o_current := r.fence;
    IF r.state NOT IN ('i', 'p') OR r.fence <> p_fence THEN
        RETURN;
    END IF;
    UPDATE idem_records SET state = 'p',
        lease_until = greatest(lease_until, t + p_lease_us * interval '1 microsecond'),
        expires_at = greatest(expires_at,
                              t + (p_lease_us + p_tombstone_us) * interval '1 microsecond')
    WHERE scope = p_scope;
    o_ok := true;
END
$fn$;

INSERT INTO idem_schema_version (version) VALUES (1);
