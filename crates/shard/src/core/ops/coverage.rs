//! Every method of Burn's ops traits is implemented by the generated forwarding, so none is
//! left silently on its default (which would replace the inner backend's kernels by Burn's
//! compositions, and bypass the sharding policies).

/// Method names per trait, parsed from burn-backend 0.21.0's sources: the workspace's patched
/// copy (`vendor/burn-backend`, what kiln builds against), else the cargo registry's.
fn trait_methods(file: &str, trait_name: &str) -> Vec<String> {
    let vendored = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../vendor/burn-backend/src/backend")
        .join(file);
    let home = std::env::var("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cargo")
        });
    let registry = home.join("registry/src");
    let src = Some(vendored)
        .filter(|p| p.exists())
        .or_else(|| {
            std::fs::read_dir(&registry)
                .ok()?
                .flatten()
                .map(|d| d.path().join("burn-backend-0.21.0/src/backend").join(file))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| {
            panic!("burn-backend-0.21.0 sources not found (vendor/ or {registry:?})")
        });
    let text = std::fs::read_to_string(src).expect("readable");
    let start = text
        .find(&format!("pub trait {trait_name}"))
        .expect("trait present");
    // The trait body: up to the matching closing brace.
    let body = &text[start..];
    let open = body.find('{').expect("{");
    let mut depth = 0;
    let mut end = open;
    for (i, c) in body[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = open + i;
                    break;
                }
            }
            _ => {}
        }
    }
    let body = &body[open..end];
    let mut names = Vec::new();
    for line in body.lines() {
        let line = line.trim();
        if line.starts_with("//") {
            continue;
        }
        for prefix in ["fn ", "async fn "] {
            if let Some(rest) = line.strip_prefix(prefix) {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.push(name);
            }
        }
    }
    names.sort();
    names
}

fn implemented(trait_name: &str) -> Vec<String> {
    // One generated file per trait; the transaction is hand-written.
    let text = match trait_name {
        "FloatTensorOps" => include_str!("float.rs"),
        "IntTensorOps" => include_str!("int.rs"),
        "BoolTensorOps" => include_str!("bool.rs"),
        "ModuleOps" => include_str!("module.rs"),
        "ActivationOps" => include_str!("activation.rs"),
        "QTensorOps" => include_str!("qtensor.rs"),
        _ => include_str!("custom.rs"),
    };
    let marker = format!("impl<B: Backend> {trait_name}<Self> for Shard<B> {{");
    let start = text
        .find(&marker)
        .unwrap_or_else(|| panic!("no impl of {trait_name}"));
    let body = &text[start + marker.len()..];
    let end = body.find("\n}\n").expect("end of impl");
    let mut names: Vec<String> = body[..end]
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("fn ")
                .or_else(|| l.strip_prefix("async fn "))
                .map(|r| {
                    r.chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect()
                })
        })
        .collect();
    names.sort();
    names
}

#[test]
fn forwarding_covers_every_trait_method() {
    let traits = [
        ("ops/tensor.rs", "FloatTensorOps", 124),
        ("ops/int_tensor.rs", "IntTensorOps", 104),
        ("ops/bool_tensor.rs", "BoolTensorOps", 39),
        ("ops/modules/base.rs", "ModuleOps", 56),
        ("ops/activation.rs", "ActivationOps", 14),
        ("ops/qtensor.rs", "QTensorOps", 80),
        ("ops/transaction.rs", "TransactionOps", 1),
    ];
    let mut total = 0;
    for (file, name, count) in traits {
        let expected = trait_methods(file, name);
        assert_eq!(
            expected.len(),
            count,
            "{name}: the parser found a different method count"
        );
        assert_eq!(
            implemented(name),
            expected,
            "{name}: implemented methods differ from the trait's"
        );
        total += count;
    }
    assert_eq!(total, 418);
}
