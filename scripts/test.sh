#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test of the workspace.
# Installs what the tests need when it is missing (as root, from Debian's packages),
# or stops with a clear message.
set -euo pipefail
cd "$(dirname "$0")/.."

need_package() { # command package
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test.sh: installing $2 (needed by the tests)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null; }
    fi
    command -v "$1" >/dev/null 2>&1 || {
        echo "test.sh: '$1' is missing and could not be installed; install Debian's '$2' package (apt-get install $2) and rerun." >&2
        exit 1
    }
}

need_package cargo cargo
need_package redis-server redis-server
# Creating the Redis Cluster of the cluster tests.
need_package redis-cli redis-tools
# The status page test loads the page in a real (headless) browser.
need_package chromium chromium
# The alert rules are evaluated by Prometheus's own rule tester.
need_package promtool prometheus

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The library without its default features (no axum, no Redis) must build on its own.
cargo clippy -p floodgate --no-default-features --lib --locked -- -D warnings
# The documentation builds without broken links (the library's and the gateway's).
RUSTDOCFLAGS="-D warnings" cargo doc -p floodgate --no-deps --locked --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p floodgate-gateway --lib --no-deps --locked --quiet
# The crate as crates.io would get it: self-contained (the Lua scripts live in it), and it builds.
cargo package -p floodgate --locked --allow-dirty --quiet
# The alert rules parse, and fire (or stay silent) as their unit tests say.
promtool check rules deploy/prometheus/alerts.yml
promtool test rules deploy/prometheus/alerts_test.yml
cargo test --workspace --locked
