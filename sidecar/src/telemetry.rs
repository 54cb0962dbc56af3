//! OpenTelemetry tracing: spans exported over OTLP (http/protobuf) when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and
//! the W3C trace context carried client → sidecar → peer sidecar → agent. Unset, no
//! exporter exists and nothing is extracted or injected: the client's `traceparent`
//! passes through as any other forwarded header.

use std::sync::atomic::{AtomicBool, Ordering};

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::TracerProvider as _,
    KeyValue,
};
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider, Resource};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Whether spans are exported (set once, at start).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The service name when `OTEL_SERVICE_NAME` does not give one.
pub const DEFAULT_SERVICE_NAME: &str = "leasehold-sidecar";

/// Why tracing could not be set up: the sidecar does not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL={0:?}: this sidecar exports http/protobuf only")]
    Protocol(String),
    #[error("the OTLP exporter")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// Whether an OTLP endpoint is configured (the standard variables).
pub fn configured(env: impl Fn(&str) -> Option<String>) -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .into_iter()
        .any(|name| env(name).is_some_and(|v| !v.trim().is_empty()))
}

/// The exporting tracer provider; flush it with [`Telemetry::shutdown`] before exit.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Build the exporter and provider from the standard `OTEL_*` variables (endpoint,
    /// headers, timeout, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
    /// `OTEL_TRACES_SAMPLER`/`_ARG`, `OTEL_BSP_*`), with `service.instance.id` = `node_id`.
    /// Call outside any async runtime (the exporter's HTTP client is a blocking one, run
    /// on the batch processor's own thread).
    pub fn start(node_id: &str) -> Result<Telemetry, TelemetryError> {
        let protocol = ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"]
            .into_iter()
            .find_map(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()));
        if let Some(protocol) = protocol.filter(|p| p.trim() != "http/protobuf") {
            return Err(TelemetryError::Protocol(protocol));
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build()?;
        let mut resource =
            Resource::builder().with_attribute(KeyValue::new("service.instance.id", node_id.to_owned()));
        if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.trim().is_empty()) {
            resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        ENABLED.store(true, Ordering::Relaxed);
        Ok(Telemetry { provider })
    }

    /// The tracing layer that turns spans into OpenTelemetry spans.
    pub fn layer<S>(&self) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer("leasehold-sidecar"))
    }

    /// Export what is still buffered, then stop. Call outside any async runtime.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("tracing: flushing the last spans failed: {e}");
        }
    }
}

/// Whether spans are exported.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

struct Extract<'a>(&'a HeaderMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct Inject<'a>(&'a mut HeaderMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(key), HeaderValue::try_from(value)) {
            self.0.insert(name, value);
        }
    }
}

/// Make `span` a child of the trace context in `headers` (`traceparent`,
/// `tracestate`), when there is one and spans are exported.
pub fn continue_from(span: &tracing::Span, headers: &HeaderMap) {
    if !enabled() || !headers.contains_key("traceparent") {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&Extract(headers));
    // Fails only for a span that already started a trace of its own: it is new here.
    let _ = span.set_parent(parent);
}

/// Put the current span's trace context into `headers` (replacing a client's
/// `traceparent` and `tracestate`), when spans are exported.
pub fn propagate(headers: &mut HeaderMap) {
    if !enabled() {
        return;
    }
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut Inject(headers));
}
