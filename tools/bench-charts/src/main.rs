//! Draws the bench's P11 and P12 figures as PNG charts, from the JSON the bench prints with
//! `--json` (the last line of its output; whole output files, bare JSON files and files of
//! several JSON lines are all read).
//!
//! ```text
//! cargo run -p bench-charts -- results/*.txt --out docs/charts/
//! ```
//!
//! - `p11.png`: the HTTP layer (P11) per backend: p50 of first requests and replays for bare
//!   axum, idem's `IdempotencyLayer` and the peer `axum-idempotent`, and requests/s at 16
//!   clients for idem and the peer.
//! - `p12-<backend>.png`: claim and replay p50/p99 against the ledger's size (P12), one chart
//!   per backend, the sizes of every run given merged.
//!
//! For P11 each backend's largest measurement is drawn (`--p11` and full-mode runs over quick
//! ones; the later of equals); for P12 a later run replaces an earlier one's figures at the same
//! backend and size. Text is drawn with DejaVu Sans compiled in (no system fonts).

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::Value;

type Res<T> = Result<T, Box<dyn Error>>;

const USAGE: &str = "usage: bench-charts FILE... [--out DIR]

Reads the JSON of `cargo run --release -p idem-bench -- --json` runs (whole output files are
fine: the JSON is found on its own line) and writes p11.png and p12-<backend>.png to DIR
(default docs/charts).";

const FONT: &str = "sans-serif";
const WIDTH: u32 = 1200;
const HEIGHT: u32 = 520;

/// The routes of P11 in the order they are drawn, with their colours.
const ROUTES: [(&str, RGBColor); 4] = [
    ("bare", RGBColor(150, 150, 150)),
    ("idem", RGBColor(31, 119, 180)),
    ("idem_sqlx", RGBColor(44, 160, 44)),
    ("peer", RGBColor(255, 127, 14)),
];

fn main() -> ExitCode {
    match run() {
        Ok(written) => {
            for path in written {
                println!("wrote {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench-charts: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<Vec<PathBuf>> {
    let (files, out) = parse_args()?;
    plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the bundled DejaVu Sans font could not be read")?;
    let mut runs = Vec::new();
    for file in &files {
        let found = runs_in(file)?;
        if found.is_empty() {
            return Err(format!("{}: no bench JSON found", file.display()).into());
        }
        runs.extend(found);
    }
    std::fs::create_dir_all(&out)?;
    let mut written = Vec::new();
    let p11 = P11::collect(&runs);
    if !p11.backends.is_empty() {
        let path = out.join("p11.png");
        p11.draw(&path)?;
        written.push(path);
    }
    for (backend, sizes) in p12_by_backend(&runs) {
        let path = out.join(format!("p12-{backend}.png"));
        draw_p12(&path, &backend, &sizes)?;
        written.push(path);
    }
    if written.is_empty() {
        return Err("the runs hold neither P11 nor P12 figures".into());
    }
    Ok(written)
}

fn parse_args() -> Res<(Vec<PathBuf>, PathBuf)> {
    let mut files = Vec::new();
    let mut out = PathBuf::from("docs/charts");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().ok_or("--out needs a directory")?.into(),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => match arg.strip_prefix("--out=") {
                Some(dir) => out = dir.into(),
                None if arg.starts_with("--") => {
                    return Err(format!("unknown option `{arg}`\n{USAGE}").into());
                }
                None => files.push(PathBuf::from(arg)),
            },
        }
    }
    if files.is_empty() {
        return Err(USAGE.into());
    }
    Ok((files, out))
}

/// The bench runs in a file: the whole file if it is one JSON object, else every line that is
/// one (the bench prints its JSON as the last line of its output).
fn runs_in(path: &Path) -> Res<Vec<Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let is_run = |v: &Value| v.get("backend").is_some_and(Value::is_string);
    if let Ok(v) = serde_json::from_str::<Value>(&text)
        && is_run(&v)
    {
        return Ok(vec![v]);
    }
    Ok(text
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(is_run)
        .collect())
}

fn number(v: &Value, path: &[&str]) -> Option<f64> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_f64()
}

fn backend_of(run: &Value) -> String {
    run.get("backend")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_owned()
}

/// Per backend, per route: first p50, replay p50 and requests/s.
#[derive(Debug, Default)]
struct P11 {
    backends: BTreeMap<String, BTreeMap<&'static str, [Option<f64>; 3]>>,
}

/// How much a run's P11 measured (keys per round times seconds of concurrent clients): the
/// chart takes each backend's largest.
fn p11_size(run: &Value) -> f64 {
    number(run, &["p11", "keys_per_round"]).unwrap_or(0.0)
        * number(run, &["p11", "seconds"]).unwrap_or(0.0)
}

impl P11 {
    fn collect(runs: &[Value]) -> Self {
        let mut out = Self::default();
        let mut sizes: BTreeMap<String, f64> = BTreeMap::new();
        for run in runs {
            let size = p11_size(run);
            if sizes
                .get(&backend_of(run))
                .is_some_and(|&taken| taken > size)
            {
                continue;
            }
            let Some(routes) = run.get("p11").and_then(|p| p.get("routes")) else {
                continue;
            };
            let mut figures = BTreeMap::new();
            for (route, _) in ROUTES {
                let Some(r) = routes.get(route).filter(|r| r.is_object()) else {
                    continue;
                };
                figures.insert(
                    route,
                    [
                        number(r, &["first_p50_us"]),
                        number(r, &["replay_p50_us"]),
                        number(r, &["requests_per_s"]),
                    ],
                );
            }
            if !figures.is_empty() {
                sizes.insert(backend_of(run), size);
                out.backends.insert(backend_of(run), figures);
            }
        }
        out
    }

    fn draw(&self, path: &Path) -> Res<()> {
        let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(WIDTH * 3 / 5);
        // Left: first and replay p50 per backend, every route.
        let mut groups = Vec::new();
        for (backend, routes) in &self.backends {
            for (i, what) in ["first", "replay"].into_iter().enumerate() {
                let bars = ROUTES
                    .iter()
                    .map(|(route, colour)| (routes.get(route).and_then(|f| f[i]), *colour))
                    .collect();
                groups.push((format!("{backend} {what}"), bars));
            }
        }
        bar_chart(&root, &left, "P11: p50 latency per request, µs", &groups)?;
        // Right: requests/s at 16 clients, idem and the peer (bare's is printed in the label:
        // it dwarfs both).
        let mut groups = Vec::new();
        for (backend, routes) in &self.backends {
            let bars = ROUTES[1..]
                .iter()
                .map(|(route, colour)| (routes.get(route).and_then(|f| f[2]), *colour))
                .collect();
            let bare = routes.get("bare").and_then(|f| f[2]);
            let label = match bare {
                Some(bare) => format!("{backend} (bare {bare:.0})"),
                None => backend.clone(),
            };
            groups.push((label, bars));
        }
        bar_chart(&root, &right, "P11: requests/s, 16 clients", &groups)?;
        legend(&root)?;
        root.present()?;
        Ok(())
    }
}

/// A group of bars: its label and, per route, its value (if measured) and colour.
type BarGroup = (String, Vec<(Option<f64>, RGBColor)>);

/// Bars in groups on `area`: one group per label, one bar per route (missing values left
/// out). Values and labels are drawn on `root`, whose coordinates are the bitmap's.
fn bar_chart(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    title: &str,
    groups: &[BarGroup],
) -> Res<()> {
    let top = groups
        .iter()
        .flat_map(|(_, bars)| bars.iter().filter_map(|b| b.0))
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 20))
        .margin(12)
        .margin_top(40)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..groups.len().max(1) as f64, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .y_label_style((FONT, 13))
        .draw()?;
    for (g, (label, bars)) in groups.iter().enumerate() {
        let width = 0.8 / bars.len().max(1) as f64;
        for (i, (value, colour)) in bars.iter().enumerate() {
            let Some(value) = value else { continue };
            let x0 = g as f64 + 0.1 + i as f64 * width;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.9, *value)],
                colour.filled(),
            )))?;
            let (px, py) = chart.backend_coord(&(x0 + width * 0.45, *value));
            root.draw(&Text::new(
                format!("{value:.0}"),
                (px - 12, py - 16),
                (FONT, 12),
            ))?;
        }
        let (px, py) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let offset = 5 * label.chars().count() as i32 / 2;
        root.draw(&Text::new(label.clone(), (px - offset, py + 8), (FONT, 13)))?;
    }
    Ok(())
}

fn legend(root: &DrawingArea<BitMapBackend<'_>, Shift>) -> Res<()> {
    for (i, (route, colour)) in ROUTES.iter().enumerate() {
        let x = 20 + i as i32 * 150;
        root.draw(&Rectangle::new([(x, 10), (x + 14, 24)], colour.filled()))?;
        let name = match *route {
            "idem" => "idem layer",
            "idem_sqlx" => "idem, sqlx store",
            "peer" => "axum-idempotent",
            other => other,
        };
        root.draw(&Text::new(name, (x + 20, 10), (FONT, 14)))?;
    }
    Ok(())
}

/// P12's figures at one size: claim p50, claim p99, replay p50, replay p99 (µs).
type AtSize = [f64; 4];

/// Per backend, per ledger size (records), the figures of the last run that measured it.
fn p12_by_backend(runs: &[Value]) -> BTreeMap<String, BTreeMap<u64, AtSize>> {
    let mut out: BTreeMap<String, BTreeMap<u64, AtSize>> = BTreeMap::new();
    for run in runs {
        let Some(sizes) = run
            .get("p12")
            .and_then(|p| p.get("sizes"))
            .and_then(Value::as_array)
        else {
            continue;
        };
        for size in sizes {
            let figures = [
                "claim_p50_us",
                "claim_p99_us",
                "replay_p50_us",
                "replay_p99_us",
            ]
            .map(|k| number(size, &[k]));
            let (Some(records), [Some(a), Some(b), Some(c), Some(d)]) =
                (size.get("records").and_then(Value::as_u64), figures)
            else {
                continue;
            };
            out.entry(backend_of(run))
                .or_default()
                .insert(records, [a, b, c, d]);
        }
    }
    out
}

fn draw_p12(path: &Path, backend: &str, sizes: &BTreeMap<u64, AtSize>) -> Res<()> {
    let root = BitMapBackend::new(path, (WIDTH * 2 / 3, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let (lo, hi) = match (sizes.keys().next(), sizes.keys().last()) {
        (Some(&lo), Some(&hi)) => (lo as f64, hi as f64),
        _ => return Err(format!("no P12 sizes for {backend}").into()),
    };
    let top = sizes
        .values()
        .flat_map(|f| f.iter().copied())
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("P12 on {backend}: latency as the ledger grows"),
            (FONT, 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d((lo / 2.0..hi * 2.0).log_scale(), 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("live records in the ledger")
        .y_desc("µs")
        // The measured sizes are labelled below (a log axis labels round powers only).
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .light_line_style(BLACK.mix(0.04))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()?;
    let lines = [
        ("claim p50", 0, RGBColor(31, 119, 180), false),
        ("claim p99", 1, RGBColor(31, 119, 180), true),
        ("replay p50", 2, RGBColor(44, 160, 44), false),
        ("replay p99", 3, RGBColor(44, 160, 44), true),
    ];
    for (name, i, colour, tail) in lines {
        let points: Vec<(f64, f64)> = sizes.iter().map(|(&n, f)| (n as f64, f[i])).collect();
        let style = if tail {
            colour.stroke_width(1)
        } else {
            colour.stroke_width(3)
        };
        chart
            .draw_series(LineSeries::new(points.clone(), style))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart.draw_series(
            points
                .iter()
                .map(|&p| Circle::new(p, if tail { 3 } else { 4 }, colour.filled())),
        )?;
    }
    for &n in sizes.keys() {
        let (px, py) = chart.backend_coord(&(n as f64, 0.0));
        let label = records_text(n as f64);
        let offset = 4 * label.chars().count() as i32;
        root.draw(&Text::new(label, (px - offset, py + 8), (FONT, 14)))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// 100000 → "100k", 10000000 → "10M".
fn records_text(x: f64) -> String {
    if x >= 1e6 {
        format!("{}M", trim(x / 1e6))
    } else if x >= 1e3 {
        format!("{}k", trim(x / 1e3))
    } else {
        trim(x)
    }
}

fn trim(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map_or(s.clone(), str::to_owned)
}
