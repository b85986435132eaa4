//! Memory plans for workspaces: offsets for one cycle's allocations, solved from a recorded cycle.
//!
//! A planned [`Workspace`](crate::Workspace) records the sequence of its first cycle — every
//! allocation's (aligned) size and every free, in order — and solves an offset for each allocation
//! so that two allocations live at the same time never share a byte. Later cycles that make the same
//! sequence get their memory by a table lookup. The solver is the greedy placement of static
//! planners (TFLite's arena planner, XLA's heap simulator): take the allocations in some order and put
//! each into the smallest gap between the already placed allocations whose live intervals overlap
//! its own, or above them all. Placing optimally is NP-hard (dynamic storage allocation), and which
//! order does best depends on the cycle, so the solver tries several — largest first ("greedy by
//! size"), in allocation order, longest-lived first, largest size × lifetime first — and then seeded
//! shuffles while a work budget lasts, and keeps the smallest peak; it stops early when a plan reaches
//! the lower bound. Solving runs once per recorded cycle, never per allocation.
//!
//! Every plan is reported beside two numbers: the *lower bound*, the largest total of bytes live at
//! one time (no placement can do better), and the size the bump arena needs for the same cycle (a bump
//! arena reclaims a freed block only when it is the topmost one).

use std::fmt;

use crate::memory::block::NO_SLOT;
use crate::memory::stats::{Bytes, xml_escape};

/// One event of a recorded cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// The cycle's next allocation (its slot is the count of allocations before it), of `bytes`
    /// aligned bytes.
    Alloc { bytes: usize },
    /// Allocation `slot` was freed or left the cycle's scope.
    Free { slot: u32 },
}

impl Event {
    /// The event as one integer, for the replay's comparisons (allocations even, frees odd).
    #[inline]
    fn code(self) -> u64 {
        match self {
            Event::Alloc { bytes } => (bytes as u64) << 1,
            Event::Free { slot } => (u64::from(slot) << 1) | 1,
        }
    }
}

/// Where one allocation of a planned cycle lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlannedSlot {
    /// Byte offset in the arena.
    pub offset: usize,
    /// Aligned bytes.
    pub bytes: usize,
    /// Position of its allocation in the cycle's sequence of allocations and frees.
    pub start: usize,
    /// Position of its free (the sequence's length for an allocation alive when the cycle closed).
    pub end: usize,
}

impl PlannedSlot {
    fn overlaps_in_time(&self, other: &PlannedSlot) -> bool {
        self.start < other.end && other.start < self.end
    }

    fn overlaps_in_space(&self, other: &PlannedSlot) -> bool {
        self.offset < other.offset + other.bytes && other.offset < self.offset + self.bytes
    }
}

/// A workspace's memory plan: the recorded cycle, an offset per allocation, and its figures.
/// Read it with [`Workspace::plan`](crate::Workspace::plan); `Display` prints the slot table.
#[derive(Clone)]
pub struct Plan {
    events: Vec<Event>,
    /// `events` as codes, and each slot's offset: what a replay reads per event.
    codes: Vec<u64>,
    offsets: Vec<usize>,
    slots: Vec<PlannedSlot>,
    peak: usize,
    lower_bound: usize,
    bump_size: usize,
    orders_tried: usize,
}

impl Plan {
    /// Solves a plan for a recorded cycle. Frees of unknown slots are ignored; allocations never freed
    /// live to the end of the cycle.
    pub(crate) fn solve(events: Vec<Event>) -> Plan {
        let slots = live_intervals(&events);
        let lower_bound = lower_bound(&events);
        let (slots, orders_tried) = search(&slots, lower_bound);
        debug_assert!(conflict(&slots).is_none(), "a plan places live slots apart");
        Plan {
            peak: peak_of(&slots),
            lower_bound,
            bump_size: bump_size(&events),
            codes: events.iter().map(|e| e.code()).collect(),
            offsets: slots.iter().map(|s| s.offset).collect(),
            events,
            slots,
            orders_tried,
        }
    }

    /// Bytes the plan needs: the end of its highest slot.
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// The largest total of bytes live at one time in the recorded cycle; no plan needs less.
    pub fn lower_bound(&self) -> usize {
        self.lower_bound
    }

    /// Bytes a bump arena needs for the recorded cycle (what an unplanned workspace learns).
    pub fn bump_size(&self) -> usize {
        self.bump_size
    }

    /// Every allocation of the cycle, in allocation order.
    pub fn slots(&self) -> &[PlannedSlot] {
        &self.slots
    }

    /// The plan as an SVG picture, titled `title`: one rectangle per slot, spanning its live
    /// interval (x, positions in the recorded cycle) and its bytes (y, offset in the arena), with the
    /// lower bound and the bump arena's size as lines for scale.
    pub fn to_svg(&self, title: &str) -> String {
        use std::fmt::Write as _;
        let (width, height) = (900.0, 420.0);
        let (left, right, top, bottom) = (90.0, 20.0, 40.0, 45.0);
        let (plot_w, plot_h) = (width - left - right, height - top - bottom);
        let t_max = self.events.len().max(1) as f64;
        let b_max = self.bump_size.max(self.peak).max(1) as f64;
        let x = |t: usize| left + plot_w * t as f64 / t_max;
        let y = |b: usize| top + plot_h * (1.0 - b as f64 / b_max);
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
             viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{left}\" y=\"22\" font-size=\"14\">{}</text>",
            xml_escape(title)
        );
        const FILLS: [&str; 6] = [
            "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b",
        ];
        for (i, s) in self.slots.iter().enumerate() {
            let _ = writeln!(
                svg,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\" \
                 fill-opacity=\"0.75\" stroke=\"white\" stroke-width=\"0.5\"><title>slot {i}: offset {}, \
                 {} bytes, live {}..{}</title></rect>",
                x(s.start),
                y(s.offset + s.bytes),
                (x(s.end) - x(s.start)).max(0.5),
                (y(s.offset) - y(s.offset + s.bytes)).max(0.5),
                FILLS[i % FILLS.len()],
                s.offset,
                s.bytes,
                s.start,
                s.end
            );
        }
        for (bytes, label, dash) in [
            (self.lower_bound, "lower bound", "4 3"),
            (self.peak, "plan", ""),
            (self.bump_size, "bump arena", "8 4"),
        ] {
            let _ = writeln!(
                svg,
                "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#d62728\" \
                 stroke-dasharray=\"{dash}\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" \
                 fill=\"#d62728\">{label} {}</text>",
                left + plot_w,
                left + plot_w - 4.0,
                y(bytes) - 4.0,
                Bytes(bytes),
                y = y(bytes)
            );
        }
        let _ = writeln!(
            svg,
            "<line x1=\"{left}\" x2=\"{left}\" y1=\"{top}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
             <line x1=\"{left}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">position in the cycle (allocations and \
             frees)</text>\n<text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" \
             text-anchor=\"middle\">offset in the arena</text>\n<text x=\"{:.1}\" y=\"{:.1}\" \
             text-anchor=\"end\">0</text>\n</svg>",
            top + plot_h,
            left + plot_w,
            top + plot_h,
            top + plot_h,
            left + plot_w / 2.0,
            height - 12.0,
            top + plot_h / 2.0,
            top + plot_h / 2.0,
            left - 6.0,
            top + plot_h + 4.0
        );
        svg
    }

    /// `peak / lower_bound` (1.0 is optimal; 1.0 for an empty plan).
    pub fn ratio_to_lower_bound(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.peak as f64 / self.lower_bound as f64
        }
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("slots", &self.slots.len())
            .field("peak", &self.peak)
            .field("lower_bound", &self.lower_bound)
            .field("bump_size", &self.bump_size)
            .field("orders_tried", &self.orders_tried)
            .finish()
    }
}

impl fmt::Display for Plan {
    /// A summary line, then one line per slot: index, offset, size and live interval.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan: {} slots, peak {} = {:.3}x lower bound {}, bump arena {}",
            self.slots.len(),
            Bytes(self.peak),
            self.ratio_to_lower_bound(),
            Bytes(self.lower_bound),
            Bytes(self.bump_size)
        )?;
        writeln!(f, "  slot     offset        bytes  live")?;
        for (i, s) in self.slots.iter().enumerate() {
            writeln!(
                f,
                "  {i:>4} {:>10} {:>12}  {}..{}",
                s.offset, s.bytes, s.start, s.end
            )?;
        }
        Ok(())
    }
}

/// Plans kept for cycles of different shapes (a last, smaller batch of an epoch; an evaluation step).
const KEPT_PLANS: usize = 4;

/// The replay state of a planned workspace: which plan the current cycle follows and how far, or
/// the cycle's own recording once it follows none.
#[derive(Default)]
pub(crate) struct Planner {
    /// Solved plans, the one in use (or last used) first.
    plans: Vec<Plan>,
    /// Whether the current cycle has followed `plans[0]` (or, before its first allocation, may
    /// follow one of the plans) so far.
    replaying: bool,
    /// Events of `plans[0]` the current cycle has repeated.
    cursor: usize,
    /// The current cycle's events once it follows no plan.
    recording: Vec<Event>,
    /// Allocations of the current cycle (the next allocation's slot).
    allocations: u32,
    /// Bytes of arena the current cycle may replay a plan into.
    room: usize,
    pub(crate) replayed_cycles: u64,
    pub(crate) plans_solved: u64,
    pub(crate) last_cycle_replayed: bool,
}

impl Planner {
    /// The plans kept, the one in use (or last used) first.
    pub(crate) fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// Whether the current cycle has followed a plan so far.
    pub(crate) fn replaying(&self) -> bool {
        self.replaying
    }

    /// Starts a cycle whose arena holds `room` bytes. The plan in use first must fit it: a replay
    /// reads offsets without checking them again.
    pub(crate) fn begin(&mut self, room: usize) {
        self.room = room;
        self.allocations = 0;
        self.cursor = 0;
        self.recording.clear();
        match self.plans.iter().position(|p| p.peak <= room) {
            Some(i) => {
                self.plans[..=i].rotate_right(1);
                self.replaying = true;
            }
            None => self.replaying = false,
        }
    }

    /// The cycle's next allocation, of `size` aligned bytes: its slot, and its offset in the arena
    /// while the cycle follows a plan (`None`: the caller takes the memory from the pool).
    #[inline]
    pub(crate) fn alloc(&mut self, size: usize) -> (u32, Option<usize>) {
        let slot = self.allocations;
        if slot == NO_SLOT {
            return (NO_SLOT, None); // 2³² allocations in one cycle: the rest are not planned
        }
        self.allocations += 1;
        let event = Event::Alloc { bytes: size };
        let code = event.code();
        if self.replaying && (self.follows(code) || self.cursor == 0 && self.choose(code)) {
            self.cursor += 1;
            return (slot, Some(self.plans[0].offsets[slot as usize]));
        }
        self.diverge();
        self.recording.push(event);
        (slot, None)
    }

    /// Allocation `slot` of the current cycle was freed or left the cycle's scope.
    #[inline]
    pub(crate) fn free(&mut self, slot: u32) {
        let event = Event::Free { slot };
        if self.replaying && self.follows(event.code()) {
            self.cursor += 1;
            return;
        }
        self.diverge();
        self.recording.push(event);
    }

    /// Ends the cycle. A cycle that followed a plan changes nothing; one that did not is solved into
    /// a new plan, put first, whose peak (the arena size it needs) is returned.
    pub(crate) fn end(&mut self) -> Option<usize> {
        self.last_cycle_replayed = self.replaying;
        if self.replaying {
            self.replayed_cycles += 1;
            return None;
        }
        let plan = Plan::solve(std::mem::take(&mut self.recording));
        let peak = plan.peak;
        self.plans_solved += 1;
        self.plans.retain(|p| p.events != plan.events);
        self.plans.insert(0, plan);
        self.plans.truncate(KEPT_PLANS);
        Some(peak)
    }

    /// Whether the event coded `code` is the next one of the plan in use (which fits the arena:
    /// `begin` and `choose` put only such a plan first while replaying).
    #[inline]
    fn follows(&self, code: u64) -> bool {
        self.plans
            .first()
            .is_some_and(|p| p.codes.get(self.cursor) == Some(&code))
    }

    /// Before a cycle's first event: puts first the most recently used plan that fits the arena and
    /// starts with the event coded `code`, if there is one.
    fn choose(&mut self, code: u64) -> bool {
        let found = self
            .plans
            .iter()
            .position(|p| p.peak <= self.room && p.codes.first() == Some(&code));
        if let Some(i) = found {
            self.plans[..=i].rotate_right(1);
        }
        found.is_some()
    }

    /// The current cycle leaves its plan: what it repeated so far starts its own recording.
    fn diverge(&mut self) {
        if !self.replaying {
            return;
        }
        self.replaying = false;
        self.recording.clear();
        if let Some(plan) = self.plans.first() {
            self.recording
                .extend_from_slice(&plan.events[..self.cursor]);
        }
    }
}

/// Each allocation's size and live interval (positions in `events`), offsets still 0.
fn live_intervals(events: &[Event]) -> Vec<PlannedSlot> {
    let mut slots = Vec::new();
    for (at, e) in events.iter().enumerate() {
        match *e {
            Event::Alloc { bytes } => slots.push(PlannedSlot {
                offset: 0,
                bytes,
                start: at,
                end: events.len(),
            }),
            Event::Free { slot } => {
                if let Some(s) = slots.get_mut(slot as usize) {
                    s.end = s.end.min(at);
                }
            }
        }
    }
    slots
}

/// Work the solver may spend on one plan, in slot-pair visits (about 10 ms).
const SEARCH_BUDGET: usize = 20_000_000;

/// Shuffled orders tried at most, however small the cycle.
const MAX_SHUFFLES: usize = 256;

/// The plan with the smallest peak over the deterministic orders and seeded shuffles the budget allows;
/// returns it and the number of orders tried.
fn search(slots: &[PlannedSlot], lower_bound: usize) -> (Vec<PlannedSlot>, usize) {
    let n = slots.len();
    let mut orders: Vec<Vec<usize>> = Vec::new();
    let by = |key: &dyn Fn(&PlannedSlot) -> usize| {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(key(&slots[i])), slots[i].start));
        order
    };
    orders.push(by(&|s| s.bytes));
    orders.push((0..n).collect());
    orders.push(by(&|s| s.end - s.start));
    orders.push(by(&|s| s.bytes.saturating_mul(s.end - s.start)));
    let per_order = n.saturating_mul(n).max(1);
    let shuffles = (SEARCH_BUDGET / per_order).min(MAX_SHUFFLES);
    let mut rng = SplitMix64(0x9E37_79B9_7F4A_7C15 ^ n as u64);

    let mut best: Option<Vec<PlannedSlot>> = None;
    let mut tried = 0;
    let mut base = orders[0].clone();
    for k in 0..orders.len() + shuffles {
        let order = if k < orders.len() {
            std::mem::take(&mut orders[k])
        } else {
            // Perturb the size order: shuffle it, then stably re-sort by size rounded to a power of
            // two, so large slots still come first but ties and near-ties are tried in new orders.
            rng.shuffle(&mut base);
            base.sort_by_key(|&i| std::cmp::Reverse(slots[i].bytes.ilog2()));
            base.clone()
        };
        let placed = place(slots, &order);
        tried += 1;
        if best.as_ref().is_none_or(|b| peak_of(&placed) < peak_of(b)) {
            best = Some(placed);
        }
        if best.as_ref().is_some_and(|b| peak_of(b) <= lower_bound) {
            break;
        }
    }
    (best.unwrap_or_default(), tried)
}

/// A small seeded generator for the solver's shuffles (SplitMix64), so plans are reproducible.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn shuffle(&mut self, items: &mut [usize]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// Places the slots in `order`, each into the smallest gap that fits it between the placed slots
/// whose live intervals overlap its own (or above them all). O(n²) in the number of slots.
fn place(slots: &[PlannedSlot], order: &[usize]) -> Vec<PlannedSlot> {
    let mut placed = slots.to_vec();
    // Indices of placed slots, sorted by offset.
    let mut by_offset: Vec<usize> = Vec::with_capacity(slots.len());
    for &i in order {
        let me = placed[i];
        let mut below = 0; // the lowest free offset above the overlapping slots seen so far
        let mut best: Option<(usize, usize)> = None; // (gap, offset)
        for &j in &by_offset {
            let other = &placed[j];
            if !other.overlaps_in_time(&me) {
                continue;
            }
            if other.offset >= below {
                let gap = other.offset - below;
                if gap >= me.bytes && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, below));
                }
            }
            below = below.max(other.offset + other.bytes);
        }
        let offset = best.map_or(below, |(_, at)| at);
        placed[i].offset = offset;
        let at = by_offset.partition_point(|&j| placed[j].offset <= offset);
        by_offset.insert(at, i);
    }
    placed
}

fn peak_of(slots: &[PlannedSlot]) -> usize {
    slots.iter().map(|s| s.offset + s.bytes).max().unwrap_or(0)
}

/// The largest total of bytes live at once.
fn lower_bound(events: &[Event]) -> usize {
    let mut sizes = Vec::new();
    let mut freed = Vec::new();
    let (mut live, mut most) = (0usize, 0usize);
    for e in events {
        match *e {
            Event::Alloc { bytes } => {
                sizes.push(bytes);
                freed.push(false);
                live += bytes;
                most = most.max(live);
            }
            Event::Free { slot } => {
                let slot = slot as usize;
                if slot < sizes.len() && !freed[slot] {
                    freed[slot] = true;
                    live -= sizes[slot];
                }
            }
        }
    }
    most
}

/// What a bump arena needs for the cycle: allocations go on top, and a free rolls the top back only
/// when the freed block is the topmost one (as [`Workspace`](crate::Workspace) in bump mode does).
fn bump_size(events: &[Event]) -> usize {
    let mut placed: Vec<(usize, usize)> = Vec::new(); // (offset, bytes) per slot
    let (mut top, mut most) = (0usize, 0usize);
    for e in events {
        match *e {
            Event::Alloc { bytes } => {
                placed.push((top, bytes));
                top += bytes;
                most = most.max(top);
            }
            Event::Free { slot } => {
                if let Some(&(offset, bytes)) = placed.get(slot as usize)
                    && offset + bytes == top
                {
                    top = offset;
                }
            }
        }
    }
    most
}

/// Two slots live at the same time that share bytes, if any (a plan must have none).
fn conflict(slots: &[PlannedSlot]) -> Option<(usize, usize)> {
    for (i, a) in slots.iter().enumerate() {
        for (j, b) in slots.iter().enumerate().skip(i + 1) {
            if a.bytes > 0 && b.bytes > 0 && a.overlaps_in_time(b) && a.overlaps_in_space(b) {
                return Some((i, j));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn alloc(bytes: usize) -> Event {
        Event::Alloc { bytes }
    }

    fn free(slot: u32) -> Event {
        Event::Free { slot }
    }

    #[test]
    fn a_chain_of_temporaries_reuses_two_slots() {
        // x0 -> x1 -> x2 -> x3, each freed once the next exists: a bump arena needs the sum (freed
        // blocks are never on top), a plan the two live at once.
        let events = vec![
            alloc(64),
            alloc(64),
            free(0),
            alloc(64),
            free(1),
            alloc(64),
            free(2),
        ];
        let plan = Plan::solve(events);
        assert_eq!(plan.lower_bound(), 128);
        assert_eq!(plan.peak(), 128);
        assert_eq!(plan.bump_size(), 256);
        assert_eq!(plan.slots()[2].offset, plan.slots()[0].offset);
        assert_eq!(plan.slots()[3].end, 7, "alive when the cycle closed");
    }

    #[test]
    fn a_freed_large_block_hosts_two_small_ones() {
        let events = vec![
            alloc(256),
            alloc(64),
            free(0),
            alloc(128),
            alloc(128),
            free(3),
        ];
        let plan = Plan::solve(events);
        assert_eq!(plan.lower_bound(), 320);
        assert_eq!(plan.peak(), 320);
        assert!(conflict(plan.slots()).is_none());
    }

    #[test]
    fn the_summary_and_the_slot_table_print() {
        let plan = Plan::solve(vec![alloc(64), alloc(128), free(0)]);
        let text = plan.to_string();
        assert!(
            text.starts_with("plan: 2 slots, peak 192 B = 1.000x lower bound 192 B"),
            "{text}"
        );
        // Largest first: the 128-byte slot goes to offset 0.
        assert!(
            text.contains("     1          0          128  1..3"),
            "{text}"
        );
    }

    #[test]
    fn the_picture_has_a_rectangle_per_slot_and_the_three_sizes() {
        let plan = Plan::solve(vec![alloc(64), alloc(128), free(0), alloc(64)]);
        let svg = plan.to_svg("a <small> plan");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<title>slot ").count(), 3);
        assert!(svg.contains("a &lt;small&gt; plan"));
        for label in ["lower bound 192 B", "plan 192 B", "bump arena 256 B"] {
            assert!(svg.contains(label), "{label} in {svg}");
        }
    }

    #[test]
    fn an_empty_cycle_plans_nothing() {
        let plan = Plan::solve(Vec::new());
        assert_eq!(
            (plan.peak(), plan.lower_bound(), plan.bump_size()),
            (0, 0, 0)
        );
        assert_eq!(plan.ratio_to_lower_bound(), 1.0);
    }

    /// Random cycles: allocations of 64-byte multiples, each freed at a random later point or never.
    fn cycles() -> impl Strategy<Value = Vec<Event>> {
        prop::collection::vec((1usize..64, 0usize..8, any::<bool>()), 1..120).prop_map(|ops| {
            let mut events = Vec::new();
            let mut live: Vec<u32> = Vec::new();
            let mut next = 0u32;
            for (size, frees, grow) in ops {
                if grow || live.is_empty() {
                    events.push(alloc(size * 64));
                    live.push(next);
                    next += 1;
                }
                for k in 0..frees.min(live.len()) {
                    if (size + k) % 3 == 0 {
                        let slot = live.remove((size * 7 + k) % live.len());
                        events.push(free(slot));
                    }
                }
            }
            events
        })
    }

    proptest! {
        #[test]
        fn plans_never_overlap_live_slots_and_stay_between_the_bounds(events in cycles()) {
            let plan = Plan::solve(events.clone());
            prop_assert!(conflict(plan.slots()).is_none());
            prop_assert!(plan.peak() >= plan.lower_bound());
            prop_assert!(plan.peak() <= plan.slots().iter().map(|s| s.bytes).sum::<usize>());
            prop_assert!(plan.bump_size() >= plan.lower_bound());
            for s in plan.slots() {
                prop_assert_eq!(s.offset % 64, 0);
            }
        }
    }
}
