//! `dump()`: the scope tree as text, with counts, bytes and where each live tensor was created.

use std::fmt::Write;

use crate::device::Device;
use crate::memory::arena::Workspace;
use crate::memory::stats::Bytes;
use crate::scope::node::ScopeNode;

/// Live tensors listed per scope before the rest is summarised.
const MAX_TENSORS_SHOWN: usize = 16;

pub(crate) fn dump_tree(root: &ScopeNode) -> String {
    let mut out = String::new();
    let tree = root.tree();
    let _ = writeln!(
        out,
        "scope tree on {}: cache {} ({} header bytes)",
        root.device,
        Bytes(tree.cached_bytes()),
        tree.slab.borrow().bytes()
    );
    node(&mut out, root, "");
    out
}

fn node(out: &mut String, n: &ScopeNode, indent: &str) {
    let stats = *n.stats.borrow();
    let _ = write!(out, "{indent}scope \"{}\": {stats}", n.name);
    if let Some(arena) = n.with_own_arena(|ws| describe_workspace(ws)) {
        out.push_str(&arena);
    }
    if n.is_capped() {
        out.push_str(" [capped]");
    }
    if let Some(b) = n.budget() {
        let _ = write!(out, " [budget {}]", Bytes(b));
    }
    if let Some(d) = n.autocast() {
        let _ = write!(out, " [autocast {d}]");
    }
    if n.tf32() {
        out.push_str(" [tf32 products]");
    }
    if n.is_strict() {
        out.push_str(" [strict]");
    }
    out.push('\n');
    let child_indent = format!("{indent}  ");
    if let Some(first) = n.first_outer_allocation() {
        let _ = writeln!(
            out,
            "{child_indent}{} allocations here while child \"{}\" was open; the first: {} {:?} created at {}:{}:{}",
            stats.outer_allocations,
            first.child,
            first.dtype,
            first.shape,
            first.at.file(),
            first.at.line(),
            first.at.column()
        );
    }
    for line in n.notes() {
        let _ = writeln!(out, "{child_indent}{line}");
    }
    for (shown, h) in n.blocks().enumerate() {
        if shown == MAX_TENSORS_SHOWN {
            let rest = n.blocks().count() - shown;
            let _ = writeln!(out, "{child_indent}... and {rest} more tensors");
            break;
        }
        let at = h.created_at.get();
        let _ = writeln!(
            out,
            "{child_indent}tensor {} {}{} {:?} {} (refs {}), created at {}:{}:{}",
            h.name
                .get()
                .map_or_else(|| "_".to_string(), |s| format!("\"{s}\"")),
            h.dtype.get(),
            match h.device.get() {
                Device::Cpu => String::new(),
                gpu => format!(" on {gpu}"),
            },
            h.shape.get(),
            Bytes(h.bytes.get()),
            h.refs(),
            at.file(),
            at.line(),
            at.column()
        );
    }
    for c in n.children() {
        node(out, c, &child_indent);
    }
}

/// ` [workspace "name" arena 1.0 MiB]`, with the plan's figures for a planned workspace.
fn describe_workspace(ws: &Workspace) -> String {
    let mut text = format!(
        " [workspace \"{}\" arena {}",
        ws.name(),
        Bytes(ws.capacity())
    );
    if let Some(plan) = ws.plan() {
        let _ = write!(
            text,
            ", planned: {} slots, peak {} ({:.2}x lower bound {}; bump {}), {}",
            plan.slots().len(),
            Bytes(plan.peak()),
            plan.ratio_to_lower_bound(),
            Bytes(plan.lower_bound()),
            Bytes(plan.bump_size()),
            if ws.replaying() {
                "this cycle replays it"
            } else {
                "this cycle diverged and is recorded"
            }
        );
    } else if ws.is_planned() {
        text.push_str(", recording its first cycle");
    }
    text.push(']');
    text
}
