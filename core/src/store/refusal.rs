//! Why the database refused a connection, in words naming the setting to change. sqlx
//! reports a distrusted certificate as an I/O error ("invalid peer certificate:
//! UnknownIssuer") and a TLS-only server reached without TLS as a pg_hba error; the store's
//! errors carry one of these hints so the line a process logs names the cause.

use std::io;

use rustls::CertificateError;

/// A hint for a connection refused over TLS settings or a missing file, `None` for
/// anything else (a down server, a wrong password and the like explain themselves).
pub(crate) fn explain(error: &sqlx::Error) -> Option<&'static str> {
    match error {
        sqlx::Error::Io(e) => match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::InvalidCertificate(certificate)) => Some(certificate_hint(certificate)),
            Some(_) => None,
            // A connect that reads a file: sslrootcert (or PGSSLROOTCERT), sslcert, sslkey,
            // or the Unix socket of a `host=/path` URL.
            None if e.kind() == io::ErrorKind::NotFound => Some(
                "a file the connection needs does not exist: check sslrootcert (or PGSSLROOTCERT), \
                 sslcert, sslkey",
            ),
            None => None,
        },
        sqlx::Error::Database(e)
            if e.code().as_deref() == Some("28000") && e.message().contains("no encryption") =>
        {
            Some("the server accepts TLS connections only: use sslmode=verify-full (or require), not disable")
        }
        sqlx::Error::Tls(e) if e.to_string().contains("server does not support TLS") => Some(
            "the server does not offer TLS: sslmode=require, verify-ca and verify-full need ssl=on there",
        ),
        _ => None,
    }
}

fn certificate_hint(certificate: &CertificateError) -> &'static str {
    match certificate {
        CertificateError::UnknownIssuer | CertificateError::BadSignature => {
            "the server's TLS certificate is not signed by a CA this process trusts: name the CA that \
             signed it in sslrootcert (or PGSSLROOTCERT)"
        }
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
            "the server's TLS certificate does not list the host name of the URL: connect by a name \
             it lists (sqlx 0.8 checks the name under sslmode=verify-ca too)"
        }
        CertificateError::Expired
        | CertificateError::ExpiredContext { .. }
        | CertificateError::NotValidYet
        | CertificateError::NotValidYetContext { .. } => {
            "the server's TLS certificate is expired or not yet valid (or this host's clock is wrong)"
        }
        _ => "the server's TLS certificate was refused",
    }
}

/// `" (hint)"` after an error's own text, or nothing.
pub(crate) fn suffix(error: &sqlx::Error) -> String {
    explain(error).map(|hint| format!(" ({hint})")).unwrap_or_default()
}

/// [`suffix`] for a migration's error: its connection is made by the migrator.
pub(crate) fn migrate_suffix(error: &sqlx::migrate::MigrateError) -> String {
    match error {
        sqlx::migrate::MigrateError::Execute(e) | sqlx::migrate::MigrateError::ExecuteMigration(e, _) => {
            suffix(e)
        }
        _ => String::new(),
    }
}
