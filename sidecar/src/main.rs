use std::process::ExitCode;

use clap::Parser;
use leasehold_sidecar::config::{Cli, Command};

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
    runtime::init_tracing(cli.log_format);
    let result = match cli.command {
        Some(Command::Migrate(args)) => runtime::block_on(1, runtime::migrate(&args.database_url)),
        Some(Command::Drain(args)) => runtime::block_on(1, runtime::drain(&args)),
        None => match cli.run.resolve(|name| std::env::var(name).ok()) {
            Ok(config) => runtime::block_on(usize::from(config.args.worker_threads), runtime::serve(config)),
            Err(e) => return runtime::fail(&format!("error: {e}")),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => runtime::fail(&format!("error: {e:#}")),
    }
}
