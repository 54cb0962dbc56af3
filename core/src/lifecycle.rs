//! Timing the operator and the sidecar agree on for a pod's exit.

use std::time::Duration;

/// Longest a sidecar takes to exit after its drain has completed (its wait for clients to
/// stop sending, then closing its listeners). The operator's termination grace period
/// covers the drain timeout plus more than this; each side checks its part in a test.
pub const MAX_EXIT_AFTER_DRAIN: Duration = Duration::from_secs(9);

/// Every listener of a sidecar keeps an idle keep-alive connection this long: longer than
/// clients keep idle connections pooled (Go's transport in the API server's proxy,
/// reqwest and hyper-util 90 s, AWS's ALB 60 s, Google Cloud's load balancers 600 s), so
/// the client retires a connection before the server does and no request is sent into a
/// close. A sidecar's own pool to its peers reuses a connection for at most half of it.
pub const IDLE_CONNECTION: Duration = Duration::from_secs(620);
