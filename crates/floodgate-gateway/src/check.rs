//! `floodgate check`: validates a configuration file (and the rate limit service's rules it
//! names) and says what `serve` would run, without binding or calling anything (SPEC §6).

use std::path::Path;
use std::process::ExitCode;

use crate::config::{self, Backend};

/// Validates the file at `path`: a summary and exit 0, or every error and exit 2.
pub fn check(path: &Path) -> ExitCode {
    match config::load(path) {
        Ok(config) => {
            let limits: usize = config.per_ip.len()
                + config
                    .plans
                    .values()
                    .map(|plan| plan.limits.len())
                    .sum::<usize>();
            let store = store_summary(&config.store);
            if config.serves_proxy {
                println!(
                    "{}: valid. listen {}, admin {}, upstream {}://{}, store {store}, {} plans, {limits} client limits, {} routes",
                    path.display(),
                    config.listen,
                    config.admin_listen,
                    config.upstream.scheme,
                    config.upstream.authority,
                    config.plans.len(),
                    config.redacted["routes"].as_array().map_or(0, Vec::len),
                );
            } else {
                // What `serve` runs: neither the proxy's `listen` nor its upstream, nor plans.
                println!(
                    "{}: valid. proxy: off (rls only: no upstream nor routes), admin {}, store {store}",
                    path.display(),
                    config.admin_listen,
                );
            }
            for warning in config.warnings(crate::admin::token_from_env().is_some()) {
                println!("  warning: {warning}");
            }
            if let Some(rls) = &config.rls {
                let directory = rls.directory(path);
                match crate::rls::rules::load_dir(&directory, rls.merge_domains) {
                    Ok(rules) => println!(
                        "rls: valid. grpc {}, http {}, {} domains ({}) from {} files in {}",
                        rls.listen,
                        rls.http_listen.map_or_else(
                            || "off".to_owned(),
                            |address| format!("{address} (POST /json)")
                        ),
                        rules.domain_count(),
                        listed(&rules.domain_names()),
                        rules.files.len(),
                        directory.display()
                    ),
                    Err(errors) => {
                        eprintln!(
                            "{}: invalid rate limit service rules ({}):",
                            directory.display(),
                            count_of_errors(errors.len())
                        );
                        for error in &errors {
                            eprintln!("  {error}");
                        }
                        return ExitCode::from(2);
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!(
                "{}: invalid configuration ({}):",
                path.display(),
                count_of_errors(errors.0.len())
            );
            for error in &errors.0 {
                eprintln!("  {error}");
            }
            ExitCode::from(2)
        }
    }
}

/// The store `floodgate check` reports: its backend (URLs redacted) and how it decides.
fn store_summary(store: &config::StoreSettings) -> String {
    let backend = match &store.backend {
        Backend::Memory => "memory".to_owned(),
        Backend::Redis { url, .. } => format!("redis ({})", config::redact_url(url)),
        Backend::RedisSentinel {
            master, sentinels, ..
        } => format!(
            "redis via sentinel ({master}, {} sentinels)",
            sentinels.len()
        ),
        Backend::RedisCluster { nodes, .. } => {
            format!("redis_cluster ({} seed nodes)", nodes.len())
        }
        Backend::RedisSharded { nodes, .. } => {
            format!("redis_sharded ({} nodes)", nodes.len())
        }
    };
    let mode = match (
        store.backend.is_shared(),
        store.sync_interval,
        store.global_sync_interval,
    ) {
        (false, _, _) => String::new(),
        (true, Some(interval), _) => format!(", batched every {interval:?}"),
        (true, None, Some(interval)) => {
            format!(", exact (global ceilings batched every {interval:?})")
        }
        (true, None, None) => ", exact".to_owned(),
    };
    let region = store.region.as_ref().map_or_else(String::new, |region| {
        let settings = &region.settings;
        format!(
            ", region {} of {} (fixed share 1/{}, traded every {:?} through {}, leases of {:?})",
            settings.name,
            settings.regions.join("/"),
            settings.regions.len(),
            settings.sync_interval,
            config::redact_url(&settings.global_url),
            settings.lease_lifetime,
        )
    });
    format!("{backend}{mode}{region}")
}

/// Names joined by commas, the first ten and a count of the rest.
fn listed(names: &[&str]) -> String {
    const SHOWN: usize = 10;
    let mut text = names
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

/// "1 error", "3 errors".
fn count_of_errors(count: usize) -> String {
    if count == 1 {
        "1 error".to_owned()
    } else {
        format!("{count} errors")
    }
}
