//! What build this is, for the `leasehold_build_info` metric of both binaries.

/// The release (the workspace version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The source commit, when the build was given one (`LEASEHOLD_GIT_COMMIT` at compile
/// time, as the container builds do); `None` for a plain `cargo build`.
pub const COMMIT: Option<&str> = option_env!("LEASEHOLD_GIT_COMMIT");

/// The labels of `leasehold_build_info`: `version`, and `commit` when known.
pub fn labels() -> Vec<(&'static str, &'static str)> {
    let mut labels = vec![("version", VERSION)];
    if let Some(commit) = COMMIT.filter(|c| !c.is_empty()) {
        labels.push(("commit", commit));
    }
    labels
}
