//! Errors of the operator, each with a short label for the `errors` metric.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API call failed: {context}")]
    Kube {
        context: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("lease store failed")]
    Store(#[from] leasehold_core::store::Error),
    #[error("object has no namespace")]
    NotNamespaced,
    #[error("secret {0} has no usable key {1}")]
    SecretValue(String, String),
    #[error("drain of pod {pod} failed")]
    Drain {
        pod: String,
        #[source]
        source: reqwest::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Label for `leasehold_operator_errors_total{error=...}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "kube",
            Error::Store(_) => "store",
            Error::NotNamespaced => "not_namespaced",
            Error::SecretValue(..) => "secret_value",
            Error::Drain { .. } => "drain",
        }
    }
}

/// The error and its causes on one line (for logs and condition messages): a store error
/// says "lease store failed" alone, its cause (a refused TLS certificate, say) is below it.
/// A cause whose text its parent already quoted is not repeated.
pub fn one_line(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line
}

impl Error {
    /// What to tell a user: for a refused API call, the call and the API server's own
    /// message (its reason and code too); otherwise the error with its causes.
    pub fn api_message(&self) -> String {
        match self {
            Error::Kube { context, source: kube::Error::Api(status) } => {
                format!("{context}: {} ({}, {})", status.message, status.reason, status.code)
            }
            other => {
                let mut text = other.to_string();
                let mut source = std::error::Error::source(other);
                while let Some(cause) = source {
                    text.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                text
            }
        }
    }
}

/// Attach the call's description to a kube error.
pub fn kube(context: &'static str) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Kube { context, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("inner: {0}")]
    struct Inner(#[source] std::io::Error);

    #[test]
    fn one_line_names_every_cause_once() {
        let e = Outer(Inner(std::io::Error::other("root cause")));
        // The io error's text is already in Inner's: not repeated.
        assert_eq!(one_line(&e), "outer: inner: root cause");
    }
}
