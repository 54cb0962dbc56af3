-- Liveness by connection (core/src/store/liveness.rs): a boot may hold a session-level
-- advisory lock on the connection it renews its node lease from. Postgres releases it the
-- moment that connection closes (the process was killed, or its connection broke), and
-- peers then expire the boot's node row at once instead of waiting for its TTL. Only rows
-- that say they hold one are judged by it: boots of earlier versions, and boots started
-- with `--connection-liveness=false`, keep the TTL alone.
ALTER TABLE agent_nodes ADD COLUMN liveness_lock boolean NOT NULL DEFAULT false;
