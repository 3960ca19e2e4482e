//! The walls between kiln's files, checked on the sources:
//!
//! - no crate has an import circle between its files (a file that names `crate::a::b`, in a
//!   `use` or inline, imports the file of module `a::b`; re-exports are followed to the file
//!   that defines the name);
//! - in kiln-shard, imports run down the layers only: `core/` imports nothing above it,
//!   `features/` only the core (and never another feature), `strategy/` the core and the
//!   features, and the step and measurement files at the top anything.
//!
//! A failure names each offending import with its file and line.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// A crate's files by module path.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)
            .expect("a source directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                if path.file_name() != Some("bin".as_ref()) {
                    stack.push(path);
                }
                continue;
            }
            if path.extension() != Some("rs".as_ref()) {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let last = parts.last().cloned().unwrap_or_default();
            if parts.len() == 1 && (last == "lib" || last == "main") {
                parts.clear();
            } else if last == "mod" {
                parts.pop();
            }
            out.insert(parts, path);
        }
    }
    out
}

/// The text without comments, string and char literals, and `#[cfg(test)]` modules.
fn code(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let end = text[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
            out.extend(text[i..end].chars().filter(|&c| c == '\n'));
            i = end;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A char literal ('a', '\n'); lifetimes ('a) have no closing quote here.
            let end = text[i + 1..].find('\'').map_or(b.len(), |e| i + 1 + e + 1);
            i = end;
        } else {
            let ch = text[i..].chars().next().expect("a char");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    match out.find("#[cfg(test)]\nmod ") {
        Some(cut) => out[..cut].to_string(),
        None => out,
    }
}

/// The paths a `use` tree names, from its text after `use` up to `;`.
fn use_paths(tree: &str) -> Vec<Vec<String>> {
    fn parse(s: &[char], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut path = prefix;
        loop {
            while *i < s.len() && s[*i].is_whitespace() {
                *i += 1;
            }
            if *i >= s.len() {
                break;
            }
            if s[*i] == '{' {
                *i += 1;
                loop {
                    parse(s, i, path.clone(), out);
                    while *i < s.len() && s[*i].is_whitespace() {
                        *i += 1;
                    }
                    if *i < s.len() && s[*i] == ',' {
                        *i += 1;
                        continue;
                    }
                    if *i < s.len() && s[*i] == '}' {
                        *i += 1;
                    }
                    return;
                }
            }
            let start = *i;
            while *i < s.len() && (s[*i].is_alphanumeric() || s[*i] == '_' || s[*i] == '*') {
                *i += 1;
            }
            let word: String = s[start..*i].iter().collect();
            if word.is_empty() {
                break;
            }
            if word != "self" || path.is_empty() {
                path.push(word);
            }
            while *i < s.len() && s[*i].is_whitespace() {
                *i += 1;
            }
            if s[*i..].starts_with(&[':', ':']) {
                *i += 2;
                continue;
            }
            // `as alias`, then the end of this path.
            while *i < s.len() && s[*i] != ',' && s[*i] != '}' {
                *i += 1;
            }
            break;
        }
        if !path.is_empty() {
            out.push(path);
        }
    }
    let chars: Vec<char> = tree.chars().collect();
    let mut out = Vec::new();
    parse(&chars, &mut 0, Vec::new(), &mut out);
    out
}

/// A reference from a file: the module path it names, and the line.
struct Ref {
    path: Module,
    line: usize,
}

/// Every `crate::`, `super::` or `self::` path a file names, made absolute.
fn refs(code: &str, module: &Module) -> Vec<Ref> {
    let mut out = Vec::new();
    let absolute = |p: &[String]| -> Option<Module> {
        let (head, rest) = p.split_first()?;
        match head.as_str() {
            "crate" => Some(rest.to_vec()),
            "super" => {
                let mut m = module.clone();
                let mut rest = rest;
                m.pop();
                while rest.first().map(String::as_str) == Some("super") {
                    m.pop();
                    rest = &rest[1..];
                }
                m.extend(rest.iter().cloned());
                Some(m)
            }
            "self" => {
                let mut m = module.clone();
                m.extend(rest.iter().cloned());
                Some(m)
            }
            _ => None,
        }
    };
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    // `use` trees.
    let mut at = 0;
    while let Some(found) = code[at..].find("use ") {
        let start = at + found;
        at = start + 4;
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let Some(end) = code[at..].find(';') else {
            break;
        };
        for p in use_paths(&code[at..at + end]) {
            if let Some(path) = absolute(&p) {
                out.push(Ref {
                    path,
                    line: line_of(start),
                });
            }
        }
        at += end;
    }
    // Inline paths.
    for head in ["crate::", "super::", "self::"] {
        let mut at = 0;
        while let Some(found) = code[at..].find(head) {
            let start = at + found;
            at = start + head.len();
            let before = code[..start].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let tail: String = code[start..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let parts: Vec<String> = tail
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            if let Some(path) = absolute(&parts) {
                out.push(Ref {
                    path,
                    line: line_of(start),
                });
            }
        }
    }
    out
}

/// `pub use` re-exports: (module of the re-export + name) -> what it names.
fn reexports(mods: &BTreeMap<Module, PathBuf>) -> HashMap<Module, Module> {
    let mut out = HashMap::new();
    for (module, file) in mods {
        let text = code(&std::fs::read_to_string(file).expect("readable"));
        let mut at = 0;
        while let Some(found) = text[at..].find("pub use ") {
            let start = at + found + "pub use ".len();
            let Some(end) = text[start..].find(';') else {
                break;
            };
            for p in use_paths(&text[start..start + end]) {
                let absolute = match p.first().map(String::as_str) {
                    Some("crate") => p[1..].to_vec(),
                    Some("self") => module.iter().chain(&p[1..]).cloned().collect(),
                    Some("super") => {
                        let mut m = module.clone();
                        m.pop();
                        m.extend(p[1..].iter().cloned());
                        m
                    }
                    // A path relative to this module (`pub use tensor::X` in lib.rs).
                    Some(first) if mods.contains_key(&child(module, first)) => {
                        module.iter().chain(&p).cloned().collect()
                    }
                    _ => continue,
                };
                if let Some(name) = p.last().filter(|n| n.as_str() != "*") {
                    out.insert(child(module, name), absolute);
                }
            }
            at = start + end;
        }
    }
    out
}

fn child(module: &Module, name: &str) -> Module {
    let mut m = module.clone();
    m.push(name.to_string());
    m
}

/// The file a path lands in: re-exports followed, then the longest prefix that is a file.
fn target<'a>(
    path: &Module,
    mods: &'a BTreeMap<Module, PathBuf>,
    names: &HashMap<Module, Module>,
) -> Option<&'a PathBuf> {
    let mut p = path.clone();
    for _ in 0..4 {
        let hit = (1..=p.len())
            .rev()
            .find_map(|k| names.get(&p[..k]).map(|to| (k, to)));
        match hit {
            Some((k, to)) if !mods.contains_key(&p[..k]) => {
                p = to.iter().chain(&p[k..]).cloned().collect();
            }
            _ => break,
        }
    }
    (0..=p.len()).rev().find_map(|k| mods.get(&p[..k]))
}

/// File-to-file imports of a crate, with the line of the first occurrence.
fn imports(
    src: &Path,
) -> (
    BTreeMap<Module, PathBuf>,
    BTreeMap<(PathBuf, PathBuf), usize>,
) {
    let mods = modules(src);
    let names = reexports(&mods);
    let mut edges = BTreeMap::new();
    for (module, file) in &mods {
        let text = code(&std::fs::read_to_string(file).expect("readable"));
        for r in refs(&text, module) {
            if let Some(to) = target(&r.path, &mods, &names)
                && to != file
                && !to.ends_with("lib.rs")
                && !to.ends_with("main.rs")
            {
                edges.entry((file.clone(), to.clone())).or_insert(r.line);
            }
        }
    }
    (mods, edges)
}

/// Strongly connected components of more than one file.
fn circles(edges: &BTreeMap<(PathBuf, PathBuf), usize>) -> Vec<BTreeSet<PathBuf>> {
    let mut next: BTreeMap<&PathBuf, Vec<&PathBuf>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        next.entry(a).or_default().push(b);
    }
    let reach = |from: &PathBuf| -> BTreeSet<PathBuf> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from];
        while let Some(v) = stack.pop() {
            for w in next.get(v).into_iter().flatten() {
                if seen.insert((*w).clone()) {
                    stack.push(w);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&PathBuf, BTreeSet<PathBuf>> =
        next.keys().map(|v| (*v, reach(v))).collect();
    let mut out: Vec<BTreeSet<PathBuf>> = Vec::new();
    for (v, r) in &reaches {
        if !r.contains(*v) || out.iter().any(|c| c.contains(*v)) {
            continue;
        }
        let circle: BTreeSet<PathBuf> = r
            .iter()
            .filter(|w| reaches.get(w).is_some_and(|rw| rw.contains(*v)))
            .cloned()
            .collect();
        out.push(circle);
    }
    out
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn crates() -> Vec<PathBuf> {
    let root = workspace();
    let mut out = Vec::new();
    for top in ["crates", "models", "examples"] {
        for entry in std::fs::read_dir(root.join(top))
            .expect("a workspace folder")
            .flatten()
        {
            if entry.path().join("src").is_dir() {
                out.push(entry.path());
            }
        }
    }
    out.push(root.join("tests"));
    out.sort();
    out
}

fn short(p: &Path) -> String {
    p.strip_prefix(workspace())
        .unwrap_or(p)
        .display()
        .to_string()
}

#[test]
fn no_crate_has_an_import_circle_between_its_files() {
    let mut found = Vec::new();
    for krate in crates() {
        let (_, edges) = imports(&krate.join("src"));
        for circle in circles(&edges) {
            let inside: Vec<String> = edges
                .iter()
                .filter(|((a, b), _)| circle.contains(a) && circle.contains(b))
                .map(|((a, b), line)| format!("    {}:{line} -> {}", short(a), short(b)))
                .collect();
            found.push(format!(
                "{}: a circle of {} files:\n{}",
                short(&krate),
                circle.len(),
                inside.join("\n")
            ));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// A kiln-shard file's layer: 0 core, 1 features, 2 strategies, 3 step and measurement.
fn layer(src: &Path, file: &Path) -> usize {
    let rel = file.strip_prefix(src).expect("under src");
    match rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy())
    {
        Some(c) if c == "core" => 0,
        Some(c) if c == "features" => 1,
        Some(c) if c == "strategy" => 2,
        _ => 3,
    }
}

#[test]
fn kiln_shard_imports_run_down_its_layers_only() {
    const NAMES: [&str; 4] = ["core", "features", "strategies", "step"];
    let src = workspace().join("crates/shard/src");
    let (_, edges) = imports(&src);
    assert!(edges.len() > 50, "the scan found {} imports", edges.len());
    let mut wrong = Vec::new();
    for ((from, to), line) in &edges {
        let (a, b) = (layer(&src, from), layer(&src, to));
        let up = b > a;
        let across = a == 1 && b == 1;
        if up || across {
            wrong.push(format!(
                "  {}:{line} ({}) imports {} ({})",
                short(from),
                NAMES[a],
                short(to),
                NAMES[b]
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against kiln-shard's layers (core < features < strategies < step; features never \
         import one another):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_scanner_reads_use_trees_and_inline_paths() {
    let m = vec!["strategy".to_string(), "hook".to_string()];
    let text = code(
        "use super::{reduce::{A, B as C}, state};\nuse crate::core::scope::{self, Set};\n\
         fn f() { crate::features::zero::flat(); let s = \"crate::nope\"; } // crate::no",
    );
    let found: Vec<String> = refs(&text, &m).iter().map(|r| r.path.join("::")).collect();
    for want in [
        "strategy::reduce::A",
        "strategy::reduce::B",
        "strategy::state",
        "core::scope",
        "core::scope::Set",
        "features::zero::flat",
    ] {
        assert!(found.iter().any(|f| f == want), "{want} not in {found:?}");
    }
    assert!(!found.iter().any(|f| f.contains("nope") || f.contains("no")));
}
