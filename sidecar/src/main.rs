use std::process::ExitCode;

use clap::Parser;
use leasehold_sidecar::{
    config::{Cli, Command},
    telemetry::{self, Telemetry},
};

mod runtime;

/// Many small, short-lived allocations per request (headers, bodies, futures) on
/// several threads: mimalloc spends less time in them than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => return e.print().map_or(ExitCode::FAILURE, |()| ExitCode::SUCCESS),
        // Bad configuration: one clear line naming the flag.
        Err(e) => return runtime::fail(&runtime::one_line(&e.render().to_string())),
    };
    let result = match cli.command {
        Some(Command::Migrate(args)) => {
            runtime::init_tracing(cli.log_format, None);
            runtime::block_on(1, runtime::migrate(&args.database_url))
        }
        Some(Command::Drain(args)) => {
            runtime::init_tracing(cli.log_format, None);
            runtime::block_on(1, runtime::drain(&args))
        }
        None => {
            let config = match cli.run.resolve(|name| std::env::var(name).ok()) {
                Ok(config) => config,
                Err(e) => return runtime::fail(&format!("error: {e}")),
            };
            // Spans are exported only when an OTLP endpoint is configured; built before
            // the runtime, flushed after it.
            let telemetry = match telemetry::configured(|name| std::env::var(name).ok()) {
                true => match Telemetry::start(&config.node_id) {
                    Ok(telemetry) => Some(telemetry),
                    Err(e) => return runtime::fail(&format!("error: tracing: {e:#}")),
                },
                false => None,
            };
            runtime::init_tracing(cli.log_format, telemetry.as_ref());
            let served = runtime::block_on(usize::from(config.args.worker_threads), runtime::serve(config));
            if let Some(telemetry) = telemetry {
                telemetry.shutdown();
            }
            served
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => runtime::fail(&format!("error: {e:#}")),
    }
}
