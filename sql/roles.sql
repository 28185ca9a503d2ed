-- Least-privilege roles for crest (the same as `crest db roles`): a read-only role for inference servers
-- and a writer role for ingest. Run as a role that may create roles, after `crest db upgrade`:
--
--   psql "$DSN" -v reader=crest_reader -v writer=crest_writer -f sql/roles.sql
--
-- Safe to run twice. Set passwords afterwards with psql's \password NAME (or use `crest db roles
-- --reader-password-env VAR --writer-password-env VAR`). The writer owns crest's tables and function (attaching
-- and dropping partitions needs ownership) and may create tables in schema public; the reader may SELECT crest's
-- tables, including those the writer creates later (store versions' partitions, crest_store_data), INSERT into
-- crest_learned's data columns (the log of served tokens and their requests' figures a server appends to), and
-- nothing else. Names are quoted with format('%I') and quote_ident.
\set ON_ERROR_STOP on
SELECT set_config('crest.reader', :'reader', false), set_config('crest.writer', :'writer', false);

DO $roles$
DECLARE
  reader text := current_setting('crest.reader');
  writer text := current_setting('crest.writer');
  item record;
BEGIN
  IF reader = writer THEN
    RAISE EXCEPTION 'the reader and writer roles must differ';
  END IF;
  FOR item IN SELECT unnest(ARRAY[reader, writer]) AS name LOOP
    IF lower(item.name) = 'public' OR lower(item.name) LIKE 'pg\_%' THEN
      RAISE EXCEPTION 'role name % is reserved by PostgreSQL', item.name;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = item.name AND (rolsuper OR rolcreatedb OR rolcreaterole
               OR rolreplication OR rolbypassrls OR rolname = current_user)) THEN
      RAISE EXCEPTION 'role % exists with rights crest''s roles do not hold (or is the role connected now): name another role',
        item.name;
    END IF;
    EXECUTE format(
      CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = item.name) THEN 'ALTER' ELSE 'CREATE' END
      || ' ROLE %I WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT', item.name);
  END LOOP;
  IF current_setting('server_version_num')::int < 150000 THEN
    REVOKE CREATE ON SCHEMA public FROM PUBLIC;  -- the default from PostgreSQL 15 on
  END IF;
  EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I, %I', current_database(), reader, writer);
  EXECUTE format('GRANT USAGE ON SCHEMA public TO %I', reader);
  EXECUTE format('GRANT USAGE, CREATE ON SCHEMA public TO %I', writer);
  EXECUTE format('REVOKE CREATE ON SCHEMA public FROM %I', reader);
  FOR item IN
    SELECT c.relname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
    WHERE ns.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname LIKE 'crest\_%' ORDER BY c.relname
  LOOP
    EXECUTE format('ALTER TABLE public.%I OWNER TO %I', item.relname, writer);
    EXECUTE format('REVOKE ALL ON TABLE public.%I FROM %I', item.relname, reader);
    EXECUTE format('GRANT SELECT ON TABLE public.%I TO %I', item.relname, reader);
  END LOOP;
  IF to_regclass('public.crest_learned') IS NOT NULL THEN
    EXECUTE format('GRANT INSERT (store, tokens, n_tokens, prompt_tokens, source, steps, new_tokens, draft_tokens,'
                   ' accepted_tokens, accepted_parts, dense_version, dense_first, dense) ON TABLE public.crest_learned'
                   ' TO %I', reader);  -- not id nor created_at: the log's order and times are the server's
  END IF;
  FOR item IN
    SELECT p.oid::regprocedure AS signature FROM pg_proc p JOIN pg_namespace ns ON ns.oid = p.pronamespace
    WHERE ns.nspname = 'public' AND p.proname LIKE 'crest\_%'
  LOOP
    EXECUTE format('ALTER FUNCTION %s OWNER TO %I', item.signature, writer);
  END LOOP;
  EXECUTE format('ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA public GRANT SELECT ON TABLES TO %I', writer, reader);
END
$roles$;
