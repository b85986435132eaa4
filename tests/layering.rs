//! The architecture, held by a test: each top-level module of `src/` sits in a layer and may name
//! (`crate::module`) only modules of lower layers, so the layering in docs/design.md cannot decay
//! silently and no import cycle between modules can appear. The backend is reached only through the
//! modules that hand it buffers (memory, tensor, ops); autograd, nn and optim go through ops.

use std::collections::BTreeSet;
use std::path::Path;

/// Layers from the bottom up; a module may use modules of strictly lower layers.
const LAYERS: &[&[&str]] = &[
    &["fastmath"],
    &["dtype"],
    &["error"],
    &["layout", "device", "rng", "quant", "threads"],
    &["gguf"],
    &["backend"],
    &["memory"],
    &["scope"],
    &["tensor"],
    &["ops", "replay"],
    &["autograd", "weights"],
    &["kv"],
    &["nn"],
    &["optim"],
    &["data", "checkpoint"],
    &["dist"],
    &["models"],
    &["serve"],
];

/// Modules that may name the backend. `dist` reaches NCCL through `tensor::GpuCommunicator`, which
/// hands a tensor's device memory to the backend as `ops` hands buffers to kernels (issue 36).
const BACKEND_USERS: &[&str] = &["memory", "tensor", "ops", "replay"];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The modules a source text names through `crate::`, outside comments.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let tail = &rest[at + "crate::".len()..];
            let name: String = tail
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                out.insert(name);
            }
            rest = tail;
        }
    }
    out
}

/// Every import of `module`'s source text that goes against the layers, as messages.
fn violations(module: &str, text: &str) -> Vec<String> {
    let Some(own) = layer(module) else {
        return vec![format!(
            "module `{module}` has no layer in tests/layering.rs; give it one"
        )];
    };
    named_modules(text)
        .into_iter()
        .filter(|used| used != module)
        .filter_map(|used| {
            let Some(theirs) = layer(&used) else {
                return Some(format!("`{module}` uses `{used}`, which has no layer"));
            };
            if theirs >= own {
                return Some(format!(
                    "`{module}` (layer {own}) uses `{used}` (layer {theirs}): an import against the \
                     layering; move the code, or change the design on purpose in docs/design.md"
                ));
            }
            if used == "backend" && !BACKEND_USERS.contains(&module) {
                return Some(format!(
                    "`{module}` uses the backend directly; go through ops (only {BACKEND_USERS:?} \
                     hand the backend buffers)"
                ));
            }
            None
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_module_uses_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut problems = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src/");
        let first = relative
            .components()
            .next()
            .expect("a path component")
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs");
        if module == "lib" {
            continue; // the crate root re-exports every layer
        }
        let text = std::fs::read_to_string(file).expect("a source file is readable");
        for v in violations(module, &text) {
            problems.push(format!("{}: {v}", relative.display()));
        }
    }
    assert!(files.len() > 40, "found only {} source files", files.len());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_check_refuses_imports_against_the_layers() {
    assert!(
        violations(
            "ops",
            "use crate::tensor::Tensor;\nuse crate::backend::op::Unary;"
        )
        .is_empty()
    );
    assert_eq!(
        violations("memory", "use crate::scope::node::ScopeNode;").len(),
        1
    );
    assert_eq!(
        violations("tensor", "    let t = crate::ops::same_dtype(a, b);").len(),
        1
    );
    assert_eq!(
        violations("autograd", "use crate::backend::op::Binary;").len(),
        1
    );
    assert_eq!(violations("layout", "use crate::device::Device;").len(), 1);
    assert!(
        violations("nn", "// see crate::optim::Adam").is_empty(),
        "comments do not count"
    );
    assert_eq!(
        violations("newthing", "").len(),
        1,
        "a new module needs a layer"
    );
}
