-- Migration of the idem-postgres schema from version 1 to version 2 (run by the store at
-- start, in the transaction and under the advisory lock of the schema step; a new
-- database gets version 1, then this). Every statement may run again. Version 2 adds:
--   * the per-tenant in-flight bound: idem_claim takes the bound as a 7th argument and
--     answers 'F' (full) instead of starting a run past it;
--   * record times: created_at (set by the claim that starts a run) and completed_at
--     (set by the completion), both on the database clock. Rows written by version 1
--     have neither (NULL: unknown).
-- Version 1's functions keep their signatures, so instances of the previous release
-- still running against the database go on working (without a bound) until restarted.

ALTER TABLE idem_records
    ADD COLUMN IF NOT EXISTS created_at   timestamptz,  -- database clock, when this run was claimed
    ADD COLUMN IF NOT EXISTS completed_at timestamptz;  -- database clock, when it completed

-- The in-flight records of a tenant, for the bound's count. On a large table, create it
-- beforehand with CREATE INDEX CONCURRENTLY under this name: the migration then skips it.
CREATE INDEX IF NOT EXISTS idem_records_in_flight
    ON idem_records (tenant, lease_until) WHERE state IN ('i', 'p');

-- Whether the tenant holds p_max live leases on records other than p_scope. First takes
-- the tenant's advisory lock for the rest of the transaction: claims that would start a
-- run of one tenant count and write one at a time, on every instance, and (READ
-- COMMITTED: each statement reads anew) the count sees every such claim committed before.
CREATE OR REPLACE FUNCTION idem_tenant_full(p_tenant bytea, p_scope bytea, p_max bigint)
RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
    n bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('idem_records'),
        ('x' || encode(substring(p_tenant FROM 1 FOR 4), 'hex'))::bit(32)::integer);
    SELECT count(*) INTO n FROM (
        SELECT 1 FROM idem_records
        WHERE tenant = p_tenant AND state IN ('i', 'p') AND lease_until > clock_timestamp()
          AND scope <> p_scope
        LIMIT p_max) AS held;
    RETURN n >= p_max;
END
$fn$;

-- Claims the record or reports what holds it, in one round trip. As version 1, plus:
-- p_max_in_flight (NULL: no bound) bounds the tenant's in-flight records; a claim that
-- would start a run (a new record, an expired or released one, or a takeover of a lease
-- that ended) past it gets o_tag 'F'. Replays, in-flight duplicates, mismatches and the
-- same claimant's re-claims are answered as before, at any count.
CREATE OR REPLACE FUNCTION idem_claim(
    p_scope bytea, p_tenant bytea, p_fingerprint bytea, p_claimant bytea,
    p_lease_us bigint, p_tombstone_us bigint, p_max_in_flight bigint,
    OUT o_tag text, OUT o_fence bigint, OUT o_takeover boolean,
    OUT o_lease_left_us bigint, OUT o_outcome_kind text, OUT o_outcome bytea)
LANGUAGE plpgsql AS $fn$
DECLARE
    r idem_records%ROWTYPE;
    lease interval := p_lease_us * interval '1 microsecond';
    keep interval := (p_lease_us + p_tombstone_us) * interval '1 microsecond';
    t timestamptz;
    found_row boolean;
    at_bound boolean;
BEGIN
    SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
    found_row := FOUND;
    IF NOT found_row AND p_max_in_flight IS NOT NULL THEN
        -- Count under the tenant's lock, then look again: the claim that held the lock
        -- before may have inserted this very scope (then this is a duplicate).
        at_bound := idem_tenant_full(p_tenant, p_scope, p_max_in_flight);
        SELECT * INTO r FROM idem_records WHERE scope = p_scope FOR UPDATE;
        found_row := FOUND;
        IF NOT found_row AND at_bound THEN
            o_tag := 'F';
            RETURN;
        END IF;
    END IF;
    IF NOT found_row THEN
        t := clock_timestamp();
        o_fence := nextval('idem_fence');
        INSERT INTO idem_records
            (scope, tenant, state, fence, fingerprint, claimant, lease_until, expires_at,
             created_at)
        VALUES (p_scope, p_tenant, 'i', o_fence, p_fingerprint, p_claimant, t + lease,
                t + keep, t)
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
        IF p_max_in_flight IS NOT NULL
            AND idem_tenant_full(p_tenant, p_scope, p_max_in_flight) THEN
            o_tag := 'F';
            RETURN;
        END IF;
        t := clock_timestamp();
        o_fence := nextval('idem_fence');
        UPDATE idem_records SET tenant = p_tenant, state = 'i', fence = o_fence,
            fingerprint = p_fingerprint, claimant = p_claimant, lease_until = t + lease,
            outcome_kind = NULL, outcome = NULL, watched = false, expires_at = t + keep,
            created_at = t, completed_at = NULL
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
    -- The lease ended (a crash, a long pause): take over with a new fence. The run
    -- keeps its created_at: the record was claimed then.
    IF p_max_in_flight IS NOT NULL
        AND idem_tenant_full(p_tenant, p_scope, p_max_in_flight) THEN
        o_tag := 'F';
        RETURN;
    END IF;
    t := clock_timestamp();
    o_fence := nextval('idem_fence');
    UPDATE idem_records SET state = 'i', fence = o_fence, claimant = p_claimant,
        lease_until = t + lease, watched = false, expires_at = t + keep
    WHERE scope = p_scope;
    o_tag := 'A';
    o_takeover := true;
END
$fn$;

-- Version 1's claim, for instances of the previous release: no bound.
CREATE OR REPLACE FUNCTION idem_claim(
    p_scope bytea, p_tenant bytea, p_fingerprint bytea, p_claimant bytea,
    p_lease_us bigint, p_tombstone_us bigint,
    OUT o_tag text, OUT o_fence bigint, OUT o_takeover boolean,
    OUT o_lease_left_us bigint, OUT o_outcome_kind text, OUT o_outcome bytea)
LANGUAGE sql AS $fn$
    SELECT * FROM idem_claim($1, $2, $3, $4, $5, $6, NULL::bigint)
$fn$;

-- As version 1, and records when the run completed.
CREATE OR REPLACE FUNCTION idem_complete(
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
        expires_at = t + p_ttl_us * interval '1 microsecond', completed_at = t
    WHERE scope = p_scope;
    IF r.watched THEN
        -- Delivered at commit, to the store instances that listen.
        PERFORM pg_notify('idem_done', encode(p_scope, 'hex'));
    END IF;
    o_ok := true;
END
$fn$;

-- As version 1; a release after the handler's writes committed completes the record,
-- and records when.
CREATE OR REPLACE FUNCTION idem_release(
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
            expires_at = t + p_tombstone_us * interval '1 microsecond', completed_at = t
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

UPDATE idem_schema_version SET version = 2;
