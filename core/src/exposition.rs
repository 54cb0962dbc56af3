//! `/metrics` in the format the scraper asks for: OpenMetrics (what `prometheus-client`
//! writes) when the `Accept` header names it, as Prometheus itself does by default; the
//! classic Prometheus text format (0.0.4) otherwise, for every other reader (`curl`, older
//! agents, text-format parsers), which differs in three ways: a counter's `# HELP`/`# TYPE`
//! name carries its `_total` suffix, there is no `# UNIT` and no `# EOF`.

use std::collections::{BTreeSet, HashMap};

use http::{header, HeaderMap};

pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the request's `Accept` header asks for OpenMetrics.
pub fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|media| media.trim().starts_with("application/openmetrics-text"))
}

/// The `/metrics` answer for `openmetrics` (a registry's encoding), negotiated: the
/// content type and the body, for the caller's HTTP stack to send.
pub fn negotiate(headers: &HeaderMap, openmetrics: String) -> (&'static str, String) {
    if wants_openmetrics(headers) {
        (OPENMETRICS, openmetrics)
    } else {
        (PROMETHEUS_TEXT, to_prometheus_text(&openmetrics))
    }
}

/// Rewrite an OpenMetrics exposition as Prometheus text format 0.0.4.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    // Families whose samples carry a suffix the family name lacks, from `# TYPE` lines.
    let mut suffixes: HashMap<&str, &str> = HashMap::new();
    for line in openmetrics.lines() {
        match comment(line) {
            Some(("TYPE", name, "counter")) => suffixes.insert(name, "_total"),
            Some(("TYPE", name, "info")) => suffixes.insert(name, "_info"),
            _ => None,
        };
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        match comment(line) {
            Some(("EOF" | "UNIT", ..)) => continue,
            Some((keyword @ ("HELP" | "TYPE"), name, rest)) => {
                let suffix = suffixes.get(name).copied().unwrap_or("");
                let rest = match (keyword, rest) {
                    ("TYPE", "info") => "gauge",
                    ("TYPE", "unknown") => "untyped",
                    _ => rest,
                };
                out.push_str(&format!("# {keyword} {name}{suffix} {rest}"));
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Every series name a query may use for the families of an OpenMetrics exposition (from
/// its `# TYPE` lines, so families without a sample yet count too): a counter's `_total`,
/// a histogram's `_bucket`, `_sum` and `_count`, a gauge's own name.
pub fn series_names(openmetrics: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in openmetrics.lines() {
        let Some(("TYPE", name, kind)) = comment(line) else { continue };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            "summary" => &["", "_sum", "_count"],
            "info" => &["_info"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|suffix| format!("{name}{suffix}")));
    }
    names
}

/// The metric names starting with `prefix` that `text` (a rules file, a dashboard) uses:
/// each maximal `[a-zA-Z0-9_:]` run that begins with `prefix`.
pub fn names_used<'a>(text: &'a str, prefix: &str) -> BTreeSet<&'a str> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut used = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let starts_a_name = !rest[..at].chars().next_back().is_some_and(is_name);
        let tail = &rest[at..];
        let end = tail.find(|c: char| !is_name(c)).unwrap_or(tail.len());
        if starts_a_name {
            used.insert(&tail[..end]);
        }
        rest = &tail[end.max(1)..];
    }
    used
}

/// `# KEYWORD name rest` → (keyword, name, rest); `# EOF` → ("EOF", "", "").
fn comment(line: &str) -> Option<(&str, &str, &str)> {
    let body = line.strip_prefix("# ")?;
    let (keyword, tail) = body.split_once(' ').unwrap_or((body, ""));
    let (name, rest) = tail.split_once(' ').unwrap_or((tail, ""));
    Some((keyword, name, rest))
}

#[cfg(test)]
mod tests {
    use prometheus_client::{
        encoding::text::encode,
        metrics::{counter::Counter, family::Family, gauge::Gauge},
        registry::Registry,
    };

    use super::*;

    fn exposition() -> String {
        let mut registry = Registry::with_prefix("demo");
        let turns = Family::<Vec<(String, String)>, Counter>::default();
        turns.get_or_create(&vec![("path".into(), "local".into())]).inc_by(3);
        registry.register("turns", "Turns by path", turns);
        let held = Gauge::<i64>::default();
        held.set(7);
        registry.register("leases_held", "Sessions held", held);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn the_classic_format_names_counters_with_their_suffix_and_has_no_eof() {
        let openmetrics = exposition();
        assert!(openmetrics.contains("# TYPE demo_turns counter") && openmetrics.contains("# EOF"));
        let text = to_prometheus_text(&openmetrics);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "# HELP demo_turns_total Turns by path.",
                "# TYPE demo_turns_total counter",
                "demo_turns_total{path=\"local\"} 3",
                "# HELP demo_leases_held Sessions held.",
                "# TYPE demo_leases_held gauge",
                "demo_leases_held 7",
            ],
            "{text}"
        );
    }

    #[test]
    fn info_and_unknown_types_map_to_classic_ones() {
        let text = to_prometheus_text("# TYPE a info\na_info{v=\"1\"} 1\n# TYPE b unknown\nb 2\n# EOF\n");
        assert_eq!(text, "# TYPE a_info gauge\na_info{v=\"1\"} 1\n# TYPE b untyped\nb 2\n");
    }

    #[test]
    fn series_names_and_names_used() {
        let names = series_names(&exposition());
        let histogram = "# TYPE demo_seconds histogram\n";
        let names: BTreeSet<_> = names.into_iter().chain(series_names(histogram)).collect();
        assert_eq!(
            names.iter().map(String::as_str).collect::<Vec<_>>(),
            [
                "demo_leases_held",
                "demo_seconds_bucket",
                "demo_seconds_count",
                "demo_seconds_sum",
                "demo_turns_total"
            ]
        );
        let used = names_used(r#"rate(x_a_total[5m]) / x_b{c="x_d"} + max_x_e"#, "x_");
        assert_eq!(used.into_iter().collect::<Vec<_>>(), ["x_a_total", "x_b", "x_d"]);
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        let mut headers = HeaderMap::new();
        assert!(!wants_openmetrics(&headers), "no Accept: the classic text");
        headers.insert(header::ACCEPT, "text/plain;version=0.0.4;q=0.5,*/*;q=0.1".parse().unwrap());
        assert!(!wants_openmetrics(&headers));
        // What Prometheus sends by default.
        headers.insert(
            header::ACCEPT,
            "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
                .parse()
                .unwrap(),
        );
        assert!(wants_openmetrics(&headers));
    }
}
