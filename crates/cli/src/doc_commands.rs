//! The shell blocks of the README and the guides (`docs/*.md`) are checked, so that they cannot
//! drift from what they describe: every `kiln` command line is parsed by kiln's own argument
//! parser (the same `Cli` the binary parses; `kiln launch`'s program too when it is kiln), every
//! script they run exists, and every cargo package, test, binary and manifest they name exists.
//! They are parsed, not run: most start trainings of minutes or jobs on several machines; the
//! Rust blocks are compiled and run as doctests (`kiln`'s `docs` module, the README's example).

use super::Cli;
use clap::Parser;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The command lines of a markdown text's `sh`/`bash` blocks (continuation lines joined), with
/// their line numbers.
fn sh_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let (mut inside, mut current, mut start) = (false, String::new(), 0);
    for (n, line) in text.lines().enumerate() {
        if !inside {
            inside = line.starts_with("```sh") || line.starts_with("```bash");
            continue;
        }
        if line.starts_with("```") {
            inside = false;
            continue;
        }
        if current.is_empty() {
            start = n + 1;
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(line);
                out.push((start, std::mem::take(&mut current)));
            }
        }
    }
    out
}

/// A command line's shell words, quotes removed, up to a comment; `&&`, `|`, `;` and `>` end a
/// command (returned split into commands).
fn commands(line: &str) -> Vec<Vec<String>> {
    let (mut all, mut words, mut word) = (Vec::new(), Vec::new(), None::<String>);
    let mut chars = line.chars().peekable();
    let end_word = |words: &mut Vec<String>, word: &mut Option<String>| {
        if let Some(w) = word.take() {
            words.push(w);
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    w.push(c);
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => w.extend(chars.next()),
                        c => w.push(c),
                    }
                }
            }
            '\\' => word.get_or_insert_with(String::new).extend(chars.next()),
            '#' if word.is_none() => break,
            '&' | '|' | ';' | '>' => {
                end_word(&mut words, &mut word);
                if !words.is_empty() {
                    all.push(std::mem::take(&mut words));
                }
            }
            c if c.is_whitespace() => end_word(&mut words, &mut word),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    end_word(&mut words, &mut word);
    if !words.is_empty() {
        all.push(words);
    }
    all
}

/// The `[package]` name of every Cargo.toml in the repository (outside `target/` and `vendor/`),
/// with its directory, and every `[[bin]]` name.
fn packages() -> (Vec<(String, PathBuf)>, Vec<String>) {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() && !name.starts_with('.') && !["target", "vendor"].contains(&&*name) {
                walk(&p, found);
            } else if name == "Cargo.toml" {
                found.push(p);
            }
        }
    }
    let mut manifests = Vec::new();
    walk(&root(), &mut manifests);
    let (mut packages, mut bins) = (Vec::new(), Vec::new());
    for m in manifests {
        let text = std::fs::read_to_string(&m).unwrap_or_default();
        let mut section = String::new();
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_string();
            } else if let Some(v) = line.strip_prefix("name = ") {
                let v = v.trim_matches('"').to_string();
                match section.as_str() {
                    "[package]" => packages.push((v.clone(), m.parent().unwrap().to_path_buf())),
                    "[[bin]]" => bins.push(v),
                    _ => {}
                }
            }
        }
    }
    (packages, bins)
}

/// The built binary (`target/release/kiln`), not a directory that ends in kiln (`runs/kiln`).
fn is_kiln_binary(word: &str) -> bool {
    ["target/release/kiln", "target/debug/kiln"]
        .iter()
        .any(|b| word.ends_with(b))
}

/// What is wrong with one command, if anything.
fn check(words: &[String], packages: &[(String, PathBuf)], bins: &[String]) -> Vec<String> {
    let mut errors = Vec::new();
    let is_kiln = |w: &str| w == "kiln" || is_kiln_binary(w);
    // `kiln ...` (after env assignments, mpirun, srun, or as kiln launch's program).
    for (i, w) in words.iter().enumerate() {
        if !is_kiln(w) || (w == "kiln" && i > 0) {
            continue;
        }
        // `...` stands for arguments the text leaves out.
        let argv: Vec<&str> = std::iter::once("kiln")
            .chain(words[i + 1..].iter().map(String::as_str))
            .filter(|a| *a != "...")
            .collect();
        if let Err(e) = Cli::try_parse_from(&argv) {
            let first = e.to_string().lines().next().unwrap_or_default().to_string();
            errors.push(format!("`{}`: {first}", argv.join(" ")));
        }
    }
    let first = words.first().map(String::as_str).unwrap_or_default();
    if first == "bash" || first.starts_with("scripts/") {
        let script = if first == "bash" {
            words.get(1).map(String::as_str).unwrap_or_default()
        } else {
            first
        };
        if !root().join(script).is_file() {
            errors.push(format!("no script {script}"));
        }
    }
    if first == "cargo" {
        let mut named = Vec::new();
        for pair in words.windows(2) {
            let (flag, value) = (pair[0].as_str(), pair[1].as_str());
            match flag {
                "-p" | "--package" => match packages.iter().find(|(n, _)| n == value) {
                    Some((_, dir)) => named.push(dir.clone()),
                    None => errors.push(format!("no package {value}")),
                },
                "--bin" if !bins.iter().any(|b| b == value) => {
                    errors.push(format!("no binary {value}"))
                }
                "--manifest-path" if !root().join(value).is_file() => {
                    errors.push(format!("no manifest {value}"))
                }
                _ => {}
            }
        }
        for pair in words.windows(2).filter(|p| p[0] == "--test") {
            let test = &pair[1];
            let dirs = match named.is_empty() {
                true => packages.iter().map(|(_, d)| d.clone()).collect(),
                false => named.clone(),
            };
            if !dirs
                .iter()
                .any(|d| d.join("tests").join(format!("{test}.rs")).is_file())
            {
                errors.push(format!("no test target {test}"));
            }
        }
    }
    errors
}

#[test]
fn every_command_in_the_readme_and_guides_parses_and_names_what_exists() {
    let (packages, bins) = packages();
    assert!(
        packages.iter().any(|(n, _)| n == "kiln-cli"),
        "the workspace's packages were not found"
    );
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let (mut checked, mut kiln_lines, mut errors) = (0, 0, Vec::new());
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a readable guide");
        let name = file
            .strip_prefix(root())
            .unwrap_or(file)
            .display()
            .to_string();
        for (line, command_line) in sh_lines(&text) {
            for words in commands(&command_line) {
                checked += 1;
                kiln_lines += words.iter().any(|w| is_kiln_binary(w)) as usize;
                for e in check(&words, &packages, &bins) {
                    errors.push(format!("{name}:{line}: {e}"));
                }
            }
        }
    }
    assert!(
        errors.is_empty(),
        "commands in the documentation that kiln would refuse or that name what does not \
         exist:\n{}",
        errors.join("\n")
    );
    assert!(kiln_lines >= 20, "only {kiln_lines} kiln commands found");
    println!(
        "{checked} commands in {} files checked, {kiln_lines} of them kiln's",
        files.len()
    );
}

#[test]
fn the_check_finds_what_is_wrong() {
    let (packages, bins) = packages();
    let bad = [
        "target/release/kiln train --no-such-flag",
        "target/release/kiln launch --nproc-per-node 2 -- target/release/kiln train --steps x",
        "target/release/kiln trian",
        "bash scripts/no-such-script.sh",
        "cargo test -p no-such-package",
        "cargo test -p kiln --test no_such_test",
        "cargo run --bin no-such-bin",
    ];
    for line in bad {
        let words = &commands(line)[0];
        assert!(
            !check(words, &packages, &bins).is_empty(),
            "`{line}` passed the check"
        );
    }
    let good = "LD_LIBRARY_PATH=/x target/release/kiln launch --nproc-per-node 4 --master-port 0 -- \
                target/release/kiln train --set 'parallel.backend=\"mpi\"' --overwrite # a comment";
    let words = &commands(good)[0];
    assert_eq!(check(words, &packages, &bins), Vec::<String>::new());
    assert_eq!(
        commands("a && b > c | d")
            .iter()
            .map(|c| c.join(" "))
            .collect::<Vec<_>>(),
        ["a", "b", "c", "d"]
    );
}
