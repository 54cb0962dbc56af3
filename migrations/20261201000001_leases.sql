-- Session ownership in the shape of etcd leases with attached keys (CONTRACT §7):
-- liveness costs one row per sidecar process, not one per session.

-- One row per sidecar process (a "boot"). The heartbeat extends `expires_at`; drain and
-- revocation set it to now(), which makes every session attached to it claimable at once.
CREATE TABLE agent_nodes (
    owner       text        PRIMARY KEY,          -- '<node-id>/<boot-id>'
    node_id     text        NOT NULL,             -- stable pod name
    peer_addr   text        NOT NULL,             -- host:port other sidecars forward to
    started_at  timestamptz NOT NULL DEFAULT now(),
    renewed_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT agent_nodes_owner_names_node CHECK (starts_with(owner, node_id || '/'))
);

-- revoke_node(node_id) finds every live boot of a pod.
CREATE INDEX agent_nodes_node_id ON agent_nodes (node_id);

-- One row per session naming its owner. A lease is LIVE iff NOT released and its owner's
-- node row has expires_at > now(). Rows are never deleted: the epoch only grows per key.
CREATE TABLE agent_leases (
    agent_key   text        PRIMARY KEY,
    owner       text        NOT NULL,
    epoch       bigint      NOT NULL,
    released    boolean     NOT NULL DEFAULT false,
    acquired_at timestamptz NOT NULL,             -- when this epoch began
    updated_at  timestamptz NOT NULL,
    CONSTRAINT agent_leases_key_format CHECK (agent_key ~ '^[A-Za-z0-9._:@-]{1,200}$'),
    CONSTRAINT agent_leases_epoch_positive CHECK (epoch >= 1)
);

-- Leases held by one boot: /leases, lease counts per pod, pod-deletion-cost.
CREATE INDEX agent_leases_owner_held ON agent_leases (owner) WHERE NOT released;

-- The latest checkpoint of a session, written only through the lease-checked fence.
CREATE TABLE agent_checkpoints (
    agent_key   text        PRIMARY KEY,
    epoch       bigint      NOT NULL,
    data        bytea       NOT NULL,
    updated_at  timestamptz NOT NULL
);
