//! Everything in `deploy/` parses, and the rules it ships are accepted by `floodgate check`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy_files() -> Vec<PathBuf> {
    fn walk(directory: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(directory).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else {
                files.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy"),
        &mut files,
    );
    files.sort();
    files
}

fn yaml_documents(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_saphyr::from_str_multiple::<serde_json::Value, _>(&text)
        .unwrap_or_else(|error| panic!("{} does not parse: {error}", path.display()))
}

fn check(rules: &str, name: &str) {
    let path = std::env::temp_dir().join(format!(
        "floodgate-deploy-{}-{name}.yaml",
        std::process::id()
    ));
    std::fs::write(&path, rules).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        output.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn every_deploy_file_parses() {
    let files = deploy_files();
    let mut parsed = 0;
    for path in &files {
        match path.extension().and_then(|extension| extension.to_str()) {
            Some("yaml" | "yml") => {
                assert!(!yaml_documents(path).is_empty(), "{}", path.display());
                parsed += 1;
            }
            Some("json") => {
                let text = std::fs::read_to_string(path).unwrap();
                serde_json::from_str::<serde_json::Value>(&text)
                    .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
                parsed += 1;
            }
            _ => {}
        }
    }
    assert!(parsed >= 8, "{parsed} files parsed: {files:?}");
}

#[test]
fn the_dockerfile_is_multi_stage() {
    let dockerfile = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/Dockerfile"),
    )
    .unwrap();
    assert_eq!(
        dockerfile
            .lines()
            .filter(|line| line.starts_with("FROM "))
            .count(),
        2
    );
    assert!(dockerfile.contains("COPY --from=build"));
    assert!(dockerfile.contains("USER floodgate"), "runs as non-root");
}

#[test]
fn the_shipped_rules_pass_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let configmap = yaml_documents(&root.join("kubernetes/floodgate.yaml"))
        .into_iter()
        .find(|document| document["kind"] == "ConfigMap")
        .expect("a ConfigMap of rules");
    check(
        configmap["data"]["floodgate.yaml"].as_str().unwrap(),
        "configmap",
    );
    check(
        &std::fs::read_to_string(root.join("compose/floodgate.yaml")).unwrap(),
        "compose",
    );
}

#[test]
fn the_dashboard_and_alerts_use_metrics_that_exist() {
    use floodgate::telemetry;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let alerts = std::fs::read_to_string(root.join("prometheus/alerts.yml")).unwrap();
    let dashboard = std::fs::read_to_string(root.join("grafana/floodgate-dashboard.json")).unwrap();
    for metric in [
        telemetry::LIMITED_RATIO_ANOMALY,
        telemetry::CHECK_DURATION_SECONDS,
        telemetry::BREAKER_STATE,
        "floodgate_config_reloads_total",
    ] {
        assert!(alerts.contains(metric), "alerts do not use {metric}");
    }
    for metric in [
        telemetry::DECISIONS_TOTAL,
        telemetry::CHECK_DURATION_SECONDS,
        telemetry::BREAKER_STATE,
        telemetry::LIMITED_RATIO,
        telemetry::NEAR_LIMIT_TOTAL,
        telemetry::STORE_ERRORS_TOTAL,
    ] {
        assert!(
            dashboard.contains(metric),
            "dashboard does not show {metric}"
        );
    }
    assert!(
        dashboard.contains("shadow_limited"),
        "shadow would-blocks panel"
    );
    // Every metric either file names is one the code records (a renamed metric would leave an
    // alert that never fires, or an empty panel). promtool evaluates the rules themselves.
    let known: std::collections::HashSet<&str> = telemetry::METRICS
        .iter()
        .chain(floodgate_gateway::GATEWAY_METRICS)
        .map(|metric| metric.name)
        .collect();
    for (file, text) in [("alerts.yml", &alerts), ("dashboard", &dashboard)] {
        for (start, _) in text.match_indices("floodgate_") {
            let name: String = text[start..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|base| known.contains(base))
                .unwrap_or(&name);
            assert!(
                known.contains(family),
                "{file} uses `{name}`, which nothing records"
            );
        }
    }
}

#[test]
fn the_rate_limit_service_example_passes_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let documents = yaml_documents(&root.join("kubernetes/envoy-ratelimit.yaml"));
    let configmap = |name: &str| {
        documents
            .iter()
            .find(|document| {
                document["kind"] == "ConfigMap" && document["metadata"]["name"] == name
            })
            .unwrap_or_else(|| panic!("no ConfigMap {name}"))
            .clone()
    };
    let directory =
        std::env::temp_dir().join(format!("floodgate-deploy-rls-{}", std::process::id()));
    let domains = directory.join("rls");
    std::fs::create_dir_all(&domains).unwrap();
    let config = configmap("floodgate-rls")["data"]["floodgate.yaml"]
        .as_str()
        .unwrap()
        .replace("/etc/floodgate/rls", "rls");
    std::fs::write(directory.join("floodgate.yaml"), config).unwrap();
    let files = configmap("floodgate-rls-domains");
    for (name, text) in files["data"].as_object().unwrap() {
        std::fs::write(domains.join(name), text.as_str().unwrap()).unwrap();
    }
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--config"])
        .arg(directory.join("floodgate.yaml"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&directory);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("rls: valid"));
}
