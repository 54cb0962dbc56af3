//! The test's own database: created per test through the superuser URL, read directly
//! for histories, epochs and leases (tables of `migrations/`).

use std::time::Duration;

use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool, Row};

/// `url` with its database (path) replaced by `db`; query parameters are kept.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[authority_start..].find('/').map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{db}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// The user name of a Postgres URL (percent-decoded), if it names one.
pub fn url_user(url: &str) -> Option<String> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    let user = userinfo.split(':').next().filter(|u| !u.is_empty())?;
    Some(percent_decode(user))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            if let Some(Ok(b)) = s.get(i + 1..i + 3).map(|hex| u8::from_str_radix(hex, 16)) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A SQL identifier, quoted.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `CREATE DATABASE <name> OWNER <owner>` on the server of `admin_url`.
pub async fn create_database(admin_url: &str, name: &str, owner: Option<&str>) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(admin_url).await?;
    let mut sql = format!("CREATE DATABASE {}", quote_ident(name));
    if let Some(owner) = owner {
        sql.push_str(&format!(" OWNER {}", quote_ident(owner)));
    }
    sqlx::raw_sql(&sql).execute(&mut conn).await?;
    Ok(())
}

/// Drop the database, disconnecting whoever is still connected.
pub async fn drop_database(admin_url: &str, name: &str) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(admin_url).await?;
    sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(name)))
        .execute(&mut conn)
        .await?;
    Ok(())
}

/// A session's lease row, with its owner's liveness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub owner: String,
    pub epoch: i64,
    pub released: bool,
    /// The owner's node row is live and the lease not released.
    pub live: bool,
}

impl Lease {
    /// The node id (pod name) of the owner `<node-id>/<boot-id>`.
    pub fn node_id(&self) -> &str {
        node_of(&self.owner)
    }
}

/// The node id of an owner string `<node-id>/<boot-id>`.
pub fn node_of(owner: &str) -> &str {
    owner.rsplit_once('/').map_or(owner, |(node, _)| node)
}

/// One boot's node row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub owner: String,
    pub node_id: String,
    pub live: bool,
    /// `expires_at` is well before `renewed_at + ttl`: expired on purpose (hand-back or
    /// revocation), not lapsed.
    pub expired_on_purpose: bool,
    /// Milliseconds since the epoch of the last renewal (database clock).
    pub renewed_at_ms: i64,
}

/// The test's database, read (and, for the fence canary, tampered with) as superuser.
#[derive(Debug, Clone)]
pub struct Db {
    pub pool: PgPool,
}

impl Db {
    pub async fn connect(url: &str) -> anyhow::Result<Db> {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await?;
        Ok(Db { pool })
    }

    /// Whether the sidecars' migrations have created the tables yet.
    pub async fn migrated(&self) -> bool {
        sqlx::query_scalar::<_, Option<String>>("SELECT to_regclass('agent_checkpoints')::text")
            .fetch_one(&self.pool)
            .await
            .ok()
            .flatten()
            .is_some()
    }

    /// The checkpointed history of a session (the demo agent's `{"history":[...]}`).
    pub async fn history(&self, key: &str) -> Vec<String> {
        let data: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT data FROM agent_checkpoints WHERE agent_key = $1")
                .bind(key)
                .fetch_optional(&self.pool)
                .await
                .expect("read checkpoint");
        let Some(data) = data else { return Vec::new() };
        let state: serde_json::Value = serde_json::from_slice(&data).expect("checkpoint is JSON");
        state["history"]
            .as_array()
            .expect("checkpoint has a history")
            .iter()
            .map(|v| v.as_str().expect("history entries are strings").to_owned())
            .collect()
    }

    /// The epoch of a session's checkpoint.
    pub async fn checkpoint_epoch(&self, key: &str) -> Option<i64> {
        sqlx::query_scalar("SELECT epoch FROM agent_checkpoints WHERE agent_key = $1")
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .expect("read checkpoint epoch")
    }

    pub async fn lease(&self, key: &str) -> Option<Lease> {
        let row = sqlx::query(
            "SELECT l.owner, l.epoch, l.released,
                    (NOT l.released AND coalesce(n.expires_at > now(), false)) AS live
             FROM agent_leases l LEFT JOIN agent_nodes n ON n.owner = l.owner
             WHERE l.agent_key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .expect("read lease")?;
        Some(Lease {
            owner: row.get("owner"),
            epoch: row.get("epoch"),
            released: row.get("released"),
            live: row.get("live"),
        })
    }

    /// Every boot of the given node ids (pod names).
    pub async fn nodes(&self, node_ids: &[String], ttl: Duration) -> Vec<Node> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let rows = sqlx::query(
            "SELECT owner, node_id, expires_at > now() AS live,
                    expires_at < renewed_at + ($2 - 1000) * interval '1 millisecond' AS on_purpose,
                    (extract(epoch FROM renewed_at) * 1000)::bigint AS renewed_ms
             FROM agent_nodes WHERE node_id = ANY($1) ORDER BY started_at",
        )
        .bind(node_ids)
        .bind(ttl_ms)
        .fetch_all(&self.pool)
        .await
        .expect("read nodes");
        rows.into_iter()
            .map(|row| Node {
                owner: row.get("owner"),
                node_id: row.get("node_id"),
                live: row.get("live"),
                expired_on_purpose: row.get("on_purpose"),
                renewed_at_ms: row.get("renewed_ms"),
            })
            .collect()
    }

    /// The live boot (`<node-id>/<boot-id>`) of a pod, if any.
    pub async fn live_owner(&self, node_id: &str) -> Option<String> {
        sqlx::query_scalar(
            "SELECT owner FROM agent_nodes WHERE node_id = $1 AND expires_at > now()
             ORDER BY started_at DESC LIMIT 1",
        )
        .bind(node_id)
        .fetch_optional(&self.pool)
        .await
        .expect("read live node")
    }

    /// Live leases whose owner is a boot of one of `node_ids`: `(key, owner)`.
    pub async fn live_leases_of(&self, node_ids: &[String]) -> Vec<(String, String)> {
        let rows = sqlx::query(
            "SELECT l.agent_key, l.owner FROM agent_leases l JOIN agent_nodes n ON n.owner = l.owner
             WHERE NOT l.released AND n.expires_at > now() AND n.node_id = ANY($1) ORDER BY 1",
        )
        .bind(node_ids)
        .fetch_all(&self.pool)
        .await
        .expect("read live leases");
        rows.into_iter().map(|row| (row.get("agent_key"), row.get("owner"))).collect()
    }

    /// Expire a boot's node lease WITHOUT the ownership notification (triggers off for
    /// this transaction): the boot itself is not told, exactly as if it had missed the
    /// notification; it still believes it is live until its next heartbeat.
    pub async fn silently_expire_node(&self, owner: &str) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::raw_sql("SET LOCAL session_replication_role = replica").execute(&mut *tx).await?;
        let done =
            sqlx::query("UPDATE agent_nodes SET expires_at = now() WHERE owner = $1 AND expires_at > now()")
                .bind(owner)
                .execute(&mut *tx)
                .await?;
        anyhow::ensure!(done.rows_affected() == 1, "node {owner} was not live");
        tx.commit().await?;
        Ok(())
    }

    /// Move a session's lease to `new_owner` at the next epoch, as that owner's takeover
    /// would, WITHOUT the ownership notification: the previous owner is not told.
    /// Returns the new epoch.
    pub async fn silently_take_over(&self, key: &str, new_owner: &str) -> anyhow::Result<i64> {
        let mut tx = self.pool.begin().await?;
        sqlx::raw_sql("SET LOCAL session_replication_role = replica").execute(&mut *tx).await?;
        let epoch: i64 = sqlx::query_scalar(
            "UPDATE agent_leases SET owner = $2, epoch = epoch + 1, released = false,
                    acquired_at = now(), updated_at = now()
             WHERE agent_key = $1 RETURNING epoch",
        )
        .bind(key)
        .bind(new_owner)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_or_appended_keeping_the_query() {
        assert_eq!(with_database("postgres://u:p@h:5432", "db1"), "postgres://u:p@h:5432/db1");
        assert_eq!(with_database("postgres://u:p@h:5432/", "db1"), "postgres://u:p@h:5432/db1");
        assert_eq!(with_database("postgres://u@h/postgres", "e2e-x"), "postgres://u@h/e2e-x");
        assert_eq!(
            with_database("postgres://u@h/postgres?sslmode=disable", "d"),
            "postgres://u@h/d?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h?sslmode=disable", "d"), "postgres://u@h/d?sslmode=disable");
    }

    #[test]
    fn user_is_read_from_the_url() {
        assert_eq!(url_user("postgres://leasehold:pw@10.88.0.1:5432").as_deref(), Some("leasehold"));
        assert_eq!(url_user("postgres://a%40b@h/db").as_deref(), Some("a@b"));
        assert_eq!(url_user("postgres://h:5432/db"), None);
        assert_eq!(url_user("postgres://u:p%2F@h/x?y=@z").as_deref(), Some("u"));
    }

    #[test]
    fn identifiers_are_quoted_and_owners_parsed() {
        assert_eq!(quote_ident("e2e-a\"b"), "\"e2e-a\"\"b\"");
        assert_eq!(node_of("agents-5f7-abc/0f3e"), "agents-5f7-abc");
        assert_eq!(node_of("plain"), "plain");
    }
}
