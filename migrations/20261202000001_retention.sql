-- Retention (CONTRACT §7): sessions idle past a retention, and node rows of boots dead for
-- a day, are deleted in small batches (core/src/store/retention.rs). These indexes let a
-- batch find the oldest candidates without scanning every row.
--
-- A deleted session may be created again. No writer of its earlier incarnation can ever
-- write to it: every write is fenced on owner AND epoch, and a key created anew starts
-- one above the highest epoch retention has ever deleted (`agent_epoch_floor`), so no
-- epoch of an earlier incarnation is issued again, to anyone. A database that never
-- collected anything keeps the floor at 0: new keys start at epoch 1.
CREATE INDEX agent_leases_updated_at ON agent_leases (updated_at);
CREATE INDEX agent_nodes_expires_at ON agent_nodes (expires_at);

CREATE TABLE agent_epoch_floor (
    one   boolean PRIMARY KEY DEFAULT true CHECK (one),
    floor bigint  NOT NULL CHECK (floor >= 0)
);
INSERT INTO agent_epoch_floor (one, floor) VALUES (true, 0);
