//! A real Postgres that accepts TLS connections only (`scripts/pg.sh start-tls`: `ssl=on`,
//! `hostssl` alone in pg_hba.conf, a CA and a server certificate for DNS:localhost made
//! with openssl in `<dir>/tls`, and `other-ca.crt`, a CA that signed nothing). Started by
//! the test itself, stopped by its PID (through `pg.sh stop`) on drop, pass or fail.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

pub struct TlsPostgres {
    dir: tempfile::TempDir,
    port: u16,
}

impl TlsPostgres {
    pub fn start() -> Self {
        let dir =
            tempfile::Builder::new().prefix("leasehold-pgtls.").tempdir().expect("a temporary directory");
        let out =
            Command::new(pg_script()).arg("start-tls").arg(dir.path()).output().expect("run scripts/pg.sh");
        assert!(out.status.success(), "pg.sh start-tls: {}", String::from_utf8_lossy(&out.stderr));
        let port = std::fs::read_to_string(dir.path().join("port")).expect("the port file");
        Self { port: port.trim().parse().expect("a port number"), dir }
    }

    /// A file of `<dir>/tls`: `ca.crt`, `other-ca.crt`.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join("tls").join(name)
    }

    /// A URL to `host` with these query parameters.
    pub fn url(&self, host: &str, query: &str) -> String {
        format!("postgres://postgres@{host}:{}/postgres?{query}", self.port)
    }

    /// `sslmode=<mode>&sslrootcert=<the CA file named>`.
    pub fn url_with_ca(&self, host: &str, mode: &str, ca: &str) -> String {
        self.url(host, &format!("sslmode={mode}&sslrootcert={}", self.file(ca).display()))
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let _ = Command::new(pg_script()).arg("stop").arg(self.dir.path()).status();
    }
}

fn pg_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/pg.sh")
}
