//! A memory timeline: every change of a scope's live bytes (allocation, free, move, reclaim), recorded
//! on request, exported as JSON and drawn as an SVG chart of live bytes per scope over time — the
//! picture users of PyTorch's memory snapshots look at. A healthy training loop draws a flat model line
//! and a sawtooth of batch memory; a leak draws a staircase.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::Location;
use std::time::Instant;

use crate::memory::block::{BlockHeader, NO_SLOT};
use crate::memory::stats::xml_escape;
use crate::scope::node::{ScopeName, ScopeNode};

/// What happened to a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A new block in the scope.
    Alloc,
    /// The block's last handle dropped.
    Free,
    /// The block moved into the scope (`ret`, `move_to`).
    MoveIn,
    /// The block moved out of the scope.
    MoveOut,
    /// The scope closed while a forgotten handle still held the block.
    Reclaim,
    /// The block left the scope for the system scope (`detach`).
    Detach,
}

impl EventKind {
    /// The event's name in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Alloc => "alloc",
            EventKind::Free => "free",
            EventKind::MoveIn => "move_in",
            EventKind::MoveOut => "move_out",
            EventKind::Reclaim => "reclaim",
            EventKind::Detach => "detach",
        }
    }

    /// Whether the event adds bytes to the scope.
    pub fn adds(self) -> bool {
        matches!(self, EventKind::Alloc | EventKind::MoveIn)
    }
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryEvent {
    /// Microseconds since recording started.
    pub time_us: u64,
    /// The step counter ([`Scope::mark_step`](crate::Scope::mark_step)) when it happened.
    pub step: u64,
    /// The scope's name (unnamed scopes are named by where they were opened).
    pub scope: String,
    /// What happened.
    pub kind: EventKind,
    /// Bytes of the block.
    pub bytes: usize,
    /// The tensor's name when the event happened (an allocation comes before `.named(..)`; later
    /// events of the same block carry the name).
    pub tensor: Option<&'static str>,
    /// Where the block was created.
    pub created_at: String,
    /// The block's slot in its planned workspace cycle (an index into the workspace's
    /// [`Plan::slots`](crate::Plan::slots), which gives its offset, size and live interval); `None`
    /// for other blocks.
    pub slot: Option<u32>,
}

/// An event as recorded: copies of static data only, so recording allocates nothing but the list.
#[derive(Clone, Copy)]
struct RawEvent {
    nanos: u64,
    step: u64,
    scope: ScopeName,
    kind: EventKind,
    bytes: usize,
    tensor: Option<&'static str>,
    created_at: &'static Location<'static>,
    slot: u32,
}

/// The recorder a tree carries; inactive until [`Scope::record_timeline`](crate::Scope::record_timeline).
#[derive(Default)]
pub(crate) struct Recorder {
    started: Cell<Option<Instant>>,
    step: Cell<u64>,
    events: RefCell<Vec<RawEvent>>,
    baseline: RefCell<BTreeMap<String, usize>>,
}

impl Recorder {
    /// Starts recording from the tree of `root`, whose open scopes' live bytes are the baseline.
    pub(crate) fn start(&self, root: &ScopeNode) {
        let mut baseline = BTreeMap::new();
        let mut pending = vec![root];
        while let Some(node) = pending.pop() {
            *baseline.entry(node.name.to_string()).or_default() += node.stats.borrow().live_bytes;
            pending.extend(node.children());
        }
        *self.baseline.borrow_mut() = baseline;
        self.events.borrow_mut().clear();
        self.step.set(0);
        self.started.set(Some(Instant::now()));
    }

    pub(crate) fn stop(&self) -> Timeline {
        self.started.set(None);
        let raw = std::mem::take(&mut *self.events.borrow_mut());
        Timeline {
            baseline: std::mem::take(&mut *self.baseline.borrow_mut()),
            events: raw
                .into_iter()
                .map(|e| MemoryEvent {
                    time_us: e.nanos / 1_000,
                    step: e.step,
                    scope: e.scope.to_string(),
                    kind: e.kind,
                    bytes: e.bytes,
                    tensor: e.tensor,
                    created_at: format!("{}:{}", e.created_at.file(), e.created_at.line()),
                    slot: (e.slot != NO_SLOT).then_some(e.slot),
                })
                .collect(),
        }
    }

    pub(crate) fn mark_step(&self) -> u64 {
        self.step.set(self.step.get() + 1);
        self.step.get()
    }

    /// Records `kind` for block `h` in the scope named `scope`, when recording.
    #[inline]
    pub(crate) fn record(&self, scope: ScopeName, kind: EventKind, h: &BlockHeader) {
        let Some(started) = self.started.get() else {
            return;
        };
        self.events.borrow_mut().push(RawEvent {
            nanos: started.elapsed().as_nanos() as u64,
            step: self.step.get(),
            scope,
            kind,
            bytes: h.bytes.get(),
            tensor: h.name.get(),
            created_at: h.created_at.get(),
            slot: h.slot.get(),
        });
    }
}

/// A recorded memory timeline, from [`Scope::take_timeline`](crate::Scope::take_timeline).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    baseline: BTreeMap<String, usize>,
    events: Vec<MemoryEvent>,
}

/// Colours of the chart's series, in order.
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

impl Timeline {
    /// The events, in the order they happened.
    pub fn events(&self) -> &[MemoryEvent] {
        &self.events
    }

    /// Live bytes of each scope open when recording started, by scope name.
    pub fn baseline(&self) -> &BTreeMap<String, usize> {
        &self.baseline
    }

    /// Live bytes of each scope name at the start and after every event that changed it:
    /// `(time_us, bytes)` points. Scopes opened again and again under one name (a batch scope per
    /// step) form one series.
    pub fn live_bytes_by_scope(&self) -> BTreeMap<String, Vec<(u64, usize)>> {
        let mut live: BTreeMap<String, usize> = self.baseline.clone();
        let mut series: BTreeMap<String, Vec<(u64, usize)>> = live
            .iter()
            .filter(|&(_, &b)| b > 0)
            .map(|(name, &b)| (name.clone(), vec![(0, b)]))
            .collect();
        for e in &self.events {
            let bytes = live.entry(e.scope.clone()).or_default();
            if e.kind.adds() {
                *bytes += e.bytes;
            } else {
                *bytes = bytes.saturating_sub(e.bytes);
            }
            series
                .entry(e.scope.clone())
                .or_default()
                .push((e.time_us, *bytes));
        }
        series
    }

    /// The timeline as JSON: `{"baseline": {"scope": bytes, ..}, "events": [{"time_us": .., "step": ..,
    /// "scope": "..", "kind": "alloc", "bytes": .., "tensor": ".." | null, "created_at": "file:line", "slot": .. | null}, ..]}` (`slot`: see
    /// [`MemoryEvent::slot`]).
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"baseline\": {");
        for (i, (scope, bytes)) in self.baseline.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let _ = write!(out, "{sep}\"{}\": {bytes}", escape(scope));
        }
        out.push_str("},\n\"events\": [\n");
        for (i, e) in self.events.iter().enumerate() {
            let tensor = e
                .tensor
                .map_or_else(|| "null".to_string(), |t| format!("\"{}\"", escape(t)));
            let _ = writeln!(
                out,
                "  {{\"time_us\": {}, \"step\": {}, \"scope\": \"{}\", \"kind\": \"{}\", \"bytes\": {}, \
                 \"tensor\": {}, \"created_at\": \"{}\", \"slot\": {}}}{}",
                e.time_us,
                e.step,
                escape(&e.scope),
                e.kind.as_str(),
                e.bytes,
                tensor,
                escape(&e.created_at),
                e.slot.map_or_else(|| "null".to_string(), |s| s.to_string()),
                if i + 1 < self.events.len() { "," } else { "" }
            );
        }
        out.push_str("]}\n");
        out
    }

    /// An SVG line chart of live bytes per scope over time, titled `title`.
    pub fn to_svg(&self, title: &str) -> String {
        let (width, height) = (900.0, 380.0);
        let (left, right, top, bottom) = (80.0, 170.0, 40.0, 50.0);
        let (plot_w, plot_h) = (width - left - right, height - top - bottom);
        let series = self.live_bytes_by_scope();
        let t_max = self.events.last().map_or(1, |e| e.time_us.max(1)) as f64;
        let b_max = series
            .values()
            .flat_map(|s| s.iter().map(|&(_, b)| b))
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        let x = |t: u64| left + plot_w * t as f64 / t_max;
        let y = |b: usize| top + plot_h * (1.0 - b as f64 / b_max);
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
             viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">"
        );
        let _ = writeln!(svg, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>",
            left + plot_w / 2.0,
            xml_escape(title)
        );
        // Axes, with four gridlines labelled in KiB and the time axis in milliseconds.
        for i in 0..=4 {
            let b = b_max * f64::from(i) / 4.0;
            let yy = top + plot_h * (1.0 - f64::from(i) / 4.0);
            let _ = writeln!(
                svg,
                "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.1} KiB</text>",
                left + plot_w,
                left - 6.0,
                yy + 4.0,
                b / 1024.0
            );
            let tt = t_max * f64::from(i) / 4.0;
            let xx = left + plot_w * f64::from(i) / 4.0;
            let _ = writeln!(
                svg,
                "<text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.1} ms</text>",
                top + plot_h + 18.0,
                tt / 1000.0
            );
        }
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">time since recording started</text>",
            left + plot_w / 2.0,
            height - 8.0
        );
        let _ = writeln!(
            svg,
            "<rect x=\"{left}\" y=\"{top}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#444\"/>"
        );
        for (i, (scope, points)) in series.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            // A step line (the level holds until the next event), bucketed per pixel column so long
            // recordings stay small: each column draws its highest level, then its last.
            let mut path = String::new();
            let _ = write!(path, "M{left:.1},{:.1}", y(0));
            let mut level = 0usize; // the level drawn so far
            let mut column: Option<(i64, usize, usize)> = None; // (pixel, highest, last)
            let mut flush = |path: &mut String, (px, high, last): (i64, usize, usize)| {
                let _ = write!(
                    path,
                    " L{px},{:.1} L{px},{:.1} L{px},{:.1}",
                    y(level),
                    y(high),
                    y(last)
                );
                level = last;
            };
            for &(t, b) in points {
                let px = x(t).round() as i64;
                column = match column {
                    Some((p, high, _)) if p == px => Some((p, high.max(b), b)),
                    Some(done) => {
                        flush(&mut path, done);
                        Some((px, b, b))
                    }
                    None => Some((px, b, b)),
                };
            }
            let last = column.map_or(0, |c| c.2);
            if let Some(done) = column {
                flush(&mut path, done);
            }
            let _ = write!(path, " L{:.1},{:.1}", left + plot_w, y(last));
            let _ = writeln!(
                svg,
                "<path d=\"{path}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\"/>"
            );
            let ly = top + 14.0 + 18.0 * i as f64;
            let _ = writeln!(
                svg,
                "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{colour}\" stroke-width=\"3\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
                left + plot_w + 12.0,
                left + plot_w + 32.0,
                left + plot_w + 38.0,
                ly + 4.0,
                xml_escape(scope)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// Escapes text for a JSON string.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}
