//! The memory timeline: what it records, the per-scope series it derives, and its JSON and SVG forms.

use ndscope::{Device, Error, EventKind, Workspace, root};

#[test]
fn every_kind_of_event_is_recorded_with_its_scope_and_tensor() {
    root(Device::Cpu, |s| {
        let before = s.zeros(&[8])?.named("before recording");
        s.record_timeline();
        let kept = s.named_scope("batch", |b| {
            let t = b.ones(&[16])?.named("kept");
            let gone = b.ones(&[4])?;
            drop(gone);
            std::mem::forget(b.ones(&[2])?.named("forgotten"));
            let detached = b.ones(&[3])?.move_out()?;
            drop(detached);
            b.ret(t)
        })?;
        let timeline = s.take_timeline();
        let kinds: Vec<(EventKind, &str, usize)> = timeline
            .events()
            .iter()
            .map(|e| (e.kind, e.scope.as_str(), e.bytes))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (EventKind::Alloc, "batch", 64),
                (EventKind::Alloc, "batch", 16),
                (EventKind::Free, "batch", 16),
                (EventKind::Alloc, "batch", 8),
                (EventKind::Alloc, "batch", 12),
                (EventKind::Detach, "batch", 12),
                (EventKind::MoveOut, "batch", 64),
                (EventKind::MoveIn, "root", 64),
                (EventKind::Reclaim, "batch", 8),
            ]
        );
        let e = &timeline.events()[0];
        assert_eq!(e.tensor, None, "the name is given after the allocation");
        assert_eq!(
            timeline.events()[6].tensor,
            Some("kept"),
            "later events carry it"
        );
        assert!(
            e.created_at.starts_with("tests/timeline.rs:"),
            "{}",
            e.created_at
        );
        assert_eq!(timeline.events()[8].tensor, Some("forgotten"));
        assert_eq!(
            timeline.baseline()["root"],
            32,
            "the baseline holds what lived before recording"
        );
        let series = timeline.live_bytes_by_scope();
        assert_eq!(series["root"].first().map(|p| p.1), Some(32));
        assert_eq!(series["root"].last().map(|p| p.1), Some(32 + 64));
        assert_eq!(series["batch"].last().map(|p| p.1), Some(0));
        assert!(s.take_timeline().events().is_empty(), "recording stopped");
        drop((before, kept));
        assert!(
            s.take_timeline().events().is_empty(),
            "nothing is recorded after stopping"
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn steps_are_marked_and_workspace_cycles_show_as_a_sawtooth() {
    let mut ws = Workspace::new("cycle");
    root(Device::Cpu, |s| {
        s.record_timeline();
        for _ in 0..4 {
            s.workspace(&mut ws, |w| {
                let a = w.ones(&[64])?;
                let _b = a.add_scalar(1.0)?;
                Ok::<_, Error>(())
            })?;
            s.mark_step();
        }
        let timeline = s.take_timeline();
        let series = &timeline.live_bytes_by_scope()["cycle"];
        let levels: Vec<usize> = series.iter().map(|p| p.1).collect();
        assert_eq!(
            levels,
            [256, 512, 256, 0].repeat(4),
            "up and down within every step"
        );
        let steps: Vec<u64> = timeline.events().iter().map(|e| e.step).collect();
        assert_eq!(steps, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn json_and_svg_are_well_formed_and_escape_names() {
    root(Device::Cpu, |s| {
        s.record_timeline();
        s.named_scope("say \"hi\" <now>", |b| b.ones(&[4]).map(drop))?;
        let timeline = s.take_timeline();
        let json = timeline.to_json();
        assert!(json.starts_with("{\"baseline\": {"), "{json}");
        assert!(
            json.contains("\"scope\": \"say \\\"hi\\\" <now>\""),
            "{json}"
        );
        assert!(json.contains("\"kind\": \"alloc\"") && json.contains("\"kind\": \"free\""));
        assert_eq!(json.matches('{').count(), json.matches('}').count());
        assert_eq!(json.matches('[').count(), json.matches(']').count());
        let svg = timeline.to_svg("a <title> & more");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt;title&gt; &amp; more"));
        assert!(svg.contains("say &quot;hi&quot; &lt;now&gt;"));
        assert_eq!(svg.matches("<path").count(), 1, "one series");
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_long_recording_draws_a_bounded_chart() {
    root(Device::Cpu, |s| {
        s.record_timeline();
        for _ in 0..20_000 {
            s.named_scope("batch", |b| b.ones(&[16]).map(drop))?;
        }
        let timeline = s.take_timeline();
        assert_eq!(timeline.events().len(), 40_000);
        let svg = timeline.to_svg("many steps");
        assert!(
            svg.len() < 64 * 1024,
            "the chart is bucketed per pixel: {} bytes",
            svg.len()
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}
