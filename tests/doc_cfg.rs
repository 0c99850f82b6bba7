//! docs.rs shows which cargo feature each feature-gated public item needs.
//!
//! Every published crate of the workspace (a member with a `src/lib.rs` and without
//! `publish = false`) must
//!
//! - build its docs.rs documentation with `--cfg docsrs` and every feature
//!   (`[package.metadata.docs.rs]`: `all-features = true`,
//!   `rustdoc-args = ["--cfg", "docsrs"]`),
//! - turn on rustdoc's `doc_cfg` there (`#![cfg_attr(docsrs, feature(doc_cfg))]` in its
//!   `lib.rs`), and
//! - mark every public item behind `#[cfg(PREDICATE)]` that names a feature with
//!   `#[cfg_attr(docsrs, doc(cfg(PREDICATE)))]` in the same attribute block, so the item's
//!   page and the index say "Available on crate feature X only".
//!
//! The scan is by lines, as rustfmt lays attributes out: an attribute block is the run of
//! `#[...]`, `///` and `//` lines around the `#[cfg(...)]`, and the item is the first line
//! after it. An item is public when that line starts with `pub ` (not `pub(crate)` and the
//! like) or the block has `#[macro_export]`.
//!
//! To see the result (the stable toolchain refuses `feature(doc_cfg)`; this is what docs.rs
//! runs, on nightly):
//!
//! ```text
//! RUSTC_BOOTSTRAP=1 RUSTDOCFLAGS="--cfg docsrs" cargo doc --workspace --all-features --no-deps
//! ```

use std::fs;
use std::path::{Path, PathBuf};

const CRATE_ATTRIBUTE: &str = "#![cfg_attr(docsrs, feature(doc_cfg))]";

/// The workspace's published library crates, as directories.
fn published_crates() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest = read_toml(&root.join("Cargo.toml"));
    let members = manifest["workspace"]["members"]
        .as_array()
        .expect("[workspace] members");
    members
        .iter()
        .map(
            |member| match member.as_str().expect("a member is a path") {
                "." => root.to_path_buf(),
                member => root.join(member),
            },
        )
        .filter(|dir| dir.join("src/lib.rs").is_file())
        .filter(|dir| {
            let manifest = read_toml(&dir.join("Cargo.toml"));
            manifest["package"]
                .get("publish")
                .and_then(toml::Value::as_bool)
                != Some(false)
        })
        .collect()
}

fn read_toml(path: &Path) -> toml::Table {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// Whether a trimmed line belongs to an attribute block: an attribute or a comment.
fn in_block(line: &str) -> bool {
    line.starts_with("#[") || line.starts_with("//")
}

/// The feature-gated public items in `text` without their `doc(cfg(..))`, as
/// `line: item (needs ATTRIBUTE)`.
fn undocumented_gates(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let mut missing = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(predicate) = line
            .strip_prefix("#[cfg(")
            .and_then(|rest| rest.strip_suffix(")]"))
        else {
            continue;
        };
        // Test-only code is not documented; `cfg!(..)` and `cfg_attr` are not gates.
        if !predicate.contains("feature") || predicate.contains("test") {
            continue;
        }
        let mut start = at;
        while start > 0 && in_block(lines[start - 1]) {
            start -= 1;
        }
        let mut end = at + 1;
        while end < lines.len() && in_block(lines[end]) {
            end += 1;
        }
        let Some(item) = lines.get(end) else {
            continue;
        };
        let block = &lines[start..end];
        let public = item.starts_with("pub ") || block.contains(&"#[macro_export]");
        let wanted = format!("#[cfg_attr(docsrs, doc(cfg({predicate})))]");
        if public && !block.contains(&wanted.as_str()) {
            missing.push(format!("{}: {item} (needs {wanted})", end + 1));
        }
    }
    missing
}

#[test]
fn every_published_crate_builds_its_docs_with_doc_cfg() {
    let crates = published_crates();
    assert!(
        crates.len() >= 5,
        "the facade, core and three backends: {crates:?}"
    );
    let mut problems = Vec::new();
    for dir in &crates {
        let manifest = read_toml(&dir.join("Cargo.toml"));
        let docs_rs = manifest
            .get("package")
            .and_then(|p| p.get("metadata"))
            .and_then(|m| m.get("docs"))
            .and_then(|d| d.get("rs"));
        let all_features = docs_rs
            .and_then(|d| d.get("all-features"))
            .and_then(toml::Value::as_bool);
        let rustdoc_args: Vec<&str> = docs_rs
            .and_then(|d| d.get("rustdoc-args"))
            .and_then(toml::Value::as_array)
            .map(|args| args.iter().filter_map(toml::Value::as_str).collect())
            .unwrap_or_default();
        if all_features != Some(true) || !rustdoc_args.windows(2).any(|w| w == ["--cfg", "docsrs"])
        {
            problems.push(format!(
                "{}/Cargo.toml: [package.metadata.docs.rs] needs all-features = true and \
                 rustdoc-args = [\"--cfg\", \"docsrs\"]",
                dir.display()
            ));
        }
        let lib = dir.join("src/lib.rs");
        let text = fs::read_to_string(&lib).expect("lib.rs");
        if !text.lines().any(|line| line.trim() == CRATE_ATTRIBUTE) {
            problems.push(format!("{}: needs {CRATE_ATTRIBUTE}", lib.display()));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_feature_gated_public_item_says_which_feature() {
    let mut files = Vec::new();
    for dir in published_crates() {
        rust_files(&dir.join("src"), &mut files);
    }
    let mut problems = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).expect("source file");
        for problem in undocumented_gates(&text) {
            problems.push(format!("{}:{problem}", file.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "feature-gated public items without #[cfg_attr(docsrs, doc(cfg(..)))]:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_scan_finds_what_it_is_for() {
    let gated = "#[cfg(feature = \"metrics\")]\npub use a::Metrics;\n";
    assert_eq!(undocumented_gates(gated).len(), 1);
    let documented = "/// Docs.\n#[cfg(feature = \"metrics\")]\n\
                      #[cfg_attr(docsrs, doc(cfg(feature = \"metrics\")))]\npub mod metrics;\n";
    assert!(undocumented_gates(documented).is_empty());
    let other_feature = "#[cfg(feature = \"a\")]\n#[cfg_attr(docsrs, doc(cfg(feature = \"b\")))]\n\
                         pub fn f() {}\n";
    assert_eq!(undocumented_gates(other_feature).len(), 1);
    let macro_export = "#[cfg(feature = \"x\")]\n#[macro_export]\nmacro_rules! m { () => {} }\n";
    assert_eq!(undocumented_gates(macro_export).len(), 1);
    let private = "#[cfg(feature = \"tls\")]\npub(crate) fn apply() {}\n\
                   #[cfg(feature = \"tls\")]\nfn load() {}\n\
                   #[cfg(all(test, feature = \"tls\"))]\npub mod tests {}\n";
    assert!(undocumented_gates(private).is_empty());
}
