-- One notification per ownership change (never per event), on channel
-- `leasehold_ownership`, so every sidecar learns promptly where a session now runs:
--   {"key": "...", "epoch": n, "owner": "<node>/<boot>" | null}  a lease was claimed,
--                                                               taken over or released;
--   {"node": "<node>/<boot>"}                                    a boot's node lease was
--                                                               expired on purpose (drain
--                                                               hand-back, revocation):
--                                                               all its sessions moved.
-- Renewals and extensions change neither owner nor epoch and notify nothing.

CREATE FUNCTION leasehold_notify_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT'
       OR NEW.epoch <> OLD.epoch OR NEW.owner <> OLD.owner OR NEW.released <> OLD.released THEN
        PERFORM pg_notify('leasehold_ownership', json_build_object(
            'key', NEW.agent_key,
            'epoch', NEW.epoch,
            'owner', CASE WHEN NEW.released THEN NULL ELSE NEW.owner END)::text);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER agent_leases_notify AFTER INSERT OR UPDATE ON agent_leases
    FOR EACH ROW EXECUTE FUNCTION leasehold_notify_lease();

CREATE FUNCTION leasehold_notify_node() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.expires_at <= now() AND OLD.expires_at > now() THEN
        PERFORM pg_notify('leasehold_ownership', json_build_object('node', NEW.owner)::text);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER agent_nodes_notify AFTER UPDATE ON agent_nodes
    FOR EACH ROW EXECUTE FUNCTION leasehold_notify_node();
