use clap::Parser;
use leasehold_operator::{args::Args, run::run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::new(&args.log_level);
    tracing_subscriber::fmt().with_env_filter(filter).json().init();
    let client = kube::Client::try_default().await?;
    run(args, client).await
}
