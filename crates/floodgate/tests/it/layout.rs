//! The suite stays one binary: a new file directly in `tests/` would be linked as a binary of
//! its own (minutes of CI time), and a file in `tests/it/` that `main.rs` does not declare would
//! never run.

use std::collections::BTreeSet;
use std::path::Path;

/// The files in `tests/` that are binaries of their own, each for a reason its `[[test]]` entry
/// in `Cargo.toml` gives.
const OWN_BINARIES: [&str; 4] = [
    "memory_eviction.rs",
    "prometheus.rs",
    "quiet_lookups.rs",
    "redis_processes.rs",
];

fn names_in(directory: &Path) -> BTreeSet<String> {
    std::fs::read_dir(directory)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect()
}

#[test]
fn only_the_process_wide_tests_have_a_binary_of_their_own() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut expected: BTreeSet<String> = OWN_BINARIES.iter().map(|name| name.to_string()).collect();
    expected.insert("it".to_string());
    let found: BTreeSet<String> = names_in(&tests)
        .into_iter()
        .filter(|name| name != "proptest-regressions")
        .collect();
    assert_eq!(found, expected, "add a test as a module of tests/it/");

    let main = std::fs::read_to_string(tests.join("it/main.rs")).unwrap();
    for file in names_in(&tests.join("it")) {
        let module = file.strip_suffix(".rs").unwrap();
        if module != "main" {
            assert!(
                main.lines().any(|line| line == format!("mod {module};")),
                "tests/it/{file} is not declared in tests/it/main.rs"
            );
        }
    }
}

/// The README's "Layout" section names every module file and directory at the top of each
/// crate's `src/` (the deeper files are described by their directory), so that a module added
/// without a word on where it belongs fails here.
#[test]
fn the_readme_layout_names_every_top_level_module_of_both_crates() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(crates.join("../README.md")).unwrap();
    let layout = &readme[readme.find("## Layout").expect("a Layout section")..];
    let layout = &layout[..layout[3..]
        .find("\n## ")
        .map_or(layout.len(), |end| end + 3)];
    let mut missing = Vec::new();
    for crate_dir in ["floodgate", "floodgate-gateway"] {
        for name in names_in(&crates.join(crate_dir).join("src")) {
            let is_module = name.ends_with(".rs") || !name.contains('.');
            if !is_module || ["lib.rs", "main.rs"].contains(&name.as_str()) {
                continue;
            }
            let spelled = if name.ends_with(".rs") {
                format!("`{name}`")
            } else {
                format!("`{name}/`")
            };
            if !layout.contains(&spelled) {
                missing.push(format!("{crate_dir}/src/{name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "README's Layout does not name {missing:?}"
    );
}
