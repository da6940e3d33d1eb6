//! The core's top-level modules form layers: no module imports, directly or through others, a
//! module that imports it back. Read from the source: every `crate::<module>` path outside
//! comments and test modules (brace groups expanded), names re-exported at the crate root counted
//! as the module they come from. Fails naming the cycle and the files that close it.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its `#[cfg(test)]` module (at the end, by habit).
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The first segment of every path after `crate::`, brace groups expanded to any depth.
fn uses(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group up to its closing brace, split at its top-level commas.
            let (mut depth, mut part, mut end) = (1, String::new(), group.len());
            for (i, ch) in group.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = i;
                    break;
                }
                if ch == ',' && depth == 1 {
                    out.push(ident(part.trim_start()));
                    part.clear();
                } else {
                    part.push(ch);
                }
            }
            out.push(ident(part.trim_start()));
            rest = &group[end..];
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

#[test]
fn the_core_s_modules_import_each_other_in_no_cycle() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let modules: BTreeSet<String> =
        lib.lines().filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';').map(str::to_string)).collect();
    assert!(modules.len() > 5, "lib.rs lists its modules as `pub mod x;`");
    // `pub use data::{...}` at the root: each capitalised name comes from that module.
    let mut reexports = BTreeMap::new();
    for stmt in lib.split("pub use ").skip(1) {
        let stmt = stmt.split(';').next().unwrap_or_default();
        let from = stmt.trim_start_matches("crate::").split("::").next().unwrap_or_default().to_string();
        for word in stmt.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if word.starts_with(|c: char| c.is_ascii_uppercase()) {
                reexports.insert(word.to_string(), from.clone());
            }
        }
    }
    let mut edges: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut all = Vec::new();
    files(&src(), &mut all);
    for path in all {
        let rel = path.strip_prefix(src()).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
        let me = first.trim_end_matches(".rs").to_string();
        if !modules.contains(&me) {
            continue;
        }
        for name in uses(&code(&std::fs::read_to_string(&path).unwrap())) {
            let to = if modules.contains(&name) { Some(name) } else { reexports.get(&name).cloned() };
            if let Some(to) = to.filter(|t| *t != me) {
                edges.entry(me.clone()).or_default().entry(to).or_default().insert(rel.display().to_string());
            }
        }
    }
    // Depth-first: a module met again on the current path closes a cycle.
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flat_map(|e| e.keys()) {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in &modules {
        if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
            let why: Vec<String> =
                cycle.windows(2).map(|w| format!("{} -> {}: {:?}", w[0], w[1], edges[&w[0]][&w[1]])).collect();
            panic!("the core's modules import each other in a cycle: {}\n{}", cycle.join(" -> "), why.join("\n"));
        }
    }
    // The ground floor imports nothing above it.
    for ground in ["error", "data"] {
        let above: Vec<&String> = edges
            .get(ground)
            .into_iter()
            .flat_map(|e| e.keys())
            .filter(|m| !["error", "data"].contains(&m.as_str()))
            .collect();
        assert!(above.is_empty(), "{ground} imports {above:?}");
    }
}

#[test]
fn the_reader_of_imports_expands_groups_and_skips_comments() {
    let text = "use crate::{a::b, c::{d, e::{f}}, G};\n// crate::hidden\nfn x() { crate::h::i(); }\n#[cfg(test)]\nmod tests { use crate::t; }";
    assert_eq!(uses(&code(text)), vec!["a", "c", "G", "h"]);
}
