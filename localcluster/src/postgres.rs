//! Postgres for a cluster: a database of its own on the shared test server, or a private
//! server the test can stop and restart (the "store goes away" fault).

use std::{path::PathBuf, process::Command};

use sqlx::{Connection, PgConnection};
use tempfile::TempDir;

fn pg_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/pg.sh")
}

fn run_script(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(pg_script()).args(args).output()?;
    anyhow::ensure!(out.status.success(), "pg.sh {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// Create a fresh database on the server at `admin_url`; returns its URL.
pub async fn fresh_database(admin_url: &str) -> anyhow::Result<String> {
    let name = format!("lh_{}", uuid::Uuid::new_v4().simple());
    let mut admin = PgConnection::connect(admin_url).await?;
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut admin).await?;
    let (base, query) = admin_url.split_once('?').unwrap_or((admin_url, ""));
    let (server, _) = base.rsplit_once('/').ok_or_else(|| anyhow::anyhow!("no database in {admin_url}"))?;
    Ok(if query.is_empty() { format!("{server}/{name}") } else { format!("{server}/{name}?{query}") })
}

/// A private Postgres server (scripts/pg.sh) in a temp dir; stopped when dropped.
#[derive(Debug)]
pub struct Postgres {
    dir: TempDir,
    url: String,
}

impl Postgres {
    pub fn start() -> anyhow::Result<Postgres> {
        let dir = tempfile::Builder::new().prefix("leasehold-pg.").tempdir()?;
        let url = run_script(&["start", &dir.path().to_string_lossy()])?;
        Ok(Postgres { dir, url })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Stop the server (fast shutdown): every connection breaks.
    pub fn stop(&self) -> anyhow::Result<()> {
        run_script(&["stop", &self.dir.path().to_string_lossy()]).map(drop)
    }

    /// Start it again on the same port with the same data.
    pub fn restart(&self) -> anyhow::Result<()> {
        run_script(&["start", &self.dir.path().to_string_lossy()]).map(drop)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
