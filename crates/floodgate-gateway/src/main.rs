//! `floodgate`: the rate limiting gateway (SPEC §6).
//!
//! `floodgate serve --config FILE` runs it; `floodgate check --config FILE` validates a file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use floodgate_gateway::{GatewayError, check, serve};

/// glibc's malloc takes an arena lock that the proxy's tasks contend on (a profile of the
/// gateway under load showed `__lll_lock_wait_private`); mimalloc's thread-local heaps do not.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// floodgate: a distributed HTTP rate limiter in front of your API.
#[derive(Parser)]
#[command(name = "floodgate", version, about)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (reverse proxy + admin API). SIGHUP reloads; SIGTERM/SIGINT drain and exit.
    Serve {
        /// The YAML configuration file (watched for changes).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a configuration file: exit 0 with a summary, or 2 with every error.
    Check {
        /// The YAML configuration file.
        #[arg(long, short)]
        config: PathBuf,
    },
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only for a terminal: written to a file or a log collector they are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Serve { config } => {
            init_logging(cli.log_format);
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    eprintln!("floodgate: cannot start the runtime: {error}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(serve(config.clone())) {
                Ok(()) => ExitCode::SUCCESS,
                Err(GatewayError::Invalid(errors)) => {
                    eprintln!(
                        "floodgate: {}: invalid configuration:\n{errors}",
                        config.display()
                    );
                    ExitCode::FAILURE
                }
                Err(error) => {
                    eprintln!("floodgate: {error}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
