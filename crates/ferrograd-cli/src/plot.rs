//! `--plot FILE.png`: the figure a person would rather look at than a table.
//!
//! Two kinds of figure, both PNG through plotters' bitmap backend:
//!
//! - [`line_chart`]: figures against a size on log-log axes (matmul: GFLOP/s against n, one line
//!   per backend and dtype), with a tick at every measured size.
//! - [`bar_chart`]: one horizontal bar per table row, the rows grouped into one panel per unit (a
//!   transfer run has GB/s rows and µs rows; they do not share an axis). A panel whose values span
//!   more than [`LOG_SPAN`]× is drawn on a log axis and says so. Every bar carries its value.
//!
//! Text: plotters' default `ttf` feature finds fonts through fontconfig, which a GPU machine or a
//! container may not have. We build plotters with `ab_glyph` instead and register DejaVu Sans,
//! embedded in the binary by the `dejavu` crate, under the name "sans-serif" that plotters asks
//! for by default: the same figure on every machine, no system font needed.

use crate::bench::{fmt_value, Row};
use crate::CliResult;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

/// Figure width in pixels; heights follow the content.
pub const WIDTH: u32 = 1200;
/// A bar panel whose largest value is more than this many times its smallest uses a log axis.
const LOG_SPAN: f64 = 50.0;
const ROW_PX: u32 = 30;
const PANEL_EXTRA_PX: u32 = 90;
const TITLE_PX: u32 = 50;

/// Line colours, in series order (colour-blind-safe Okabe-Ito hues).
pub(crate) const COLOURS: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

static FONT: Once = Once::new();

/// Register the embedded font once per process (see the module documentation).
pub(crate) fn init_font() {
    FONT.call_once(|| {
        // DejaVu Sans is a valid TrueType font; should parsing ever fail, plotters reports
        // `FontUnavailable` when the first label is drawn and the plot fails with that message.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold());
    });
}

/// One line of a [`line_chart`]: (size, value) points, sizes ascending.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Draw on a `w` x `h` RGB canvas in memory and write it to `path` as a PNG, atomically
/// (`ferrograd_core::io::write_atomic`): plotters' own file backend would create the file when
/// drawing starts and leave it truncated if drawing failed. The path was checked before the bench
/// ran (`Job::outputs`).
pub(crate) fn render(
    path: &Path,
    (w, h): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> CliResult<()>,
) -> CliResult<()> {
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        draw(&root)?;
        root.present().map_err(|e| plot_err(path, e))?;
    }
    let mut png_bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png_bytes, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().map_err(|e| plot_err(path, e))?;
        writer.write_image_data(&rgb).map_err(|e| plot_err(path, e))?;
    }
    ferrograd_core::io::write_atomic(path, &png_bytes)?;
    Ok(())
}

pub(crate) fn plot_err(path: &Path, e: impl std::fmt::Display) -> crate::CliError {
    format!("cannot draw the plot {}: {e}", path.display()).into()
}

/// Values on a log axis must be positive and finite; anything else is left out of the figure
/// (the table still shows it).
fn plottable(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// Figures against a size, log-log. `x_desc`/`y_desc` label the axes.
pub fn line_chart(path: &Path, title: &str, x_desc: &str, y_desc: &str, series: &[Series]) -> CliResult<()> {
    init_font();
    let pts: Vec<(f64, f64)> =
        series.iter().flat_map(|s| s.points.iter().copied()).filter(|&(x, y)| plottable(x) && plottable(y)).collect();
    if pts.is_empty() {
        return Err(plot_err(path, "no positive figures to plot"));
    }
    let mut sizes: Vec<f64> = pts.iter().map(|p| p.0).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    // Half an octave of room on either side of the smallest and largest size.
    let (xlo, xhi) = (sizes[0] / 1.5, sizes[sizes.len() - 1] * 1.5);
    let (ymin, ymax) = pts.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));
    let (ylo, yhi) = (ymin / 2.0, ymax * 2.0);

    render(path, (WIDTH, 700), |root| {
        root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
        let mut chart = ChartBuilder::on(root)
            .caption(title, ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .build_cartesian_2d(
                (xlo..xhi).log_scale().with_key_points(sizes.clone()),
                (ylo..yhi).log_scale().with_key_points(decade_ticks(ylo, yhi)),
            )
            .map_err(|e| plot_err(path, e))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|v| format!("{}", v.round()))
            .y_label_formatter(&|v| fmt_tick(*v))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()
            .map_err(|e| plot_err(path, e))?;

        for (i, s) in series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let line: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| plottable(p.0) && plottable(p.1)).collect();
            chart
                .draw_series(LineSeries::new(line.clone(), colour.stroke_width(3)))
                .map_err(|e| plot_err(path, e))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(3)));
            chart
                .draw_series(line.iter().map(|&p| Circle::new(p, 5, colour.filled())))
                .map_err(|e| plot_err(path, e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 16))
            .draw()
            .map_err(|e| plot_err(path, e))?;
        Ok(())
    })
}

/// Tick values for a log axis over [lo, hi]: the powers of ten inside it, with 2x and 5x between
/// them when there would be fewer than four ticks.
fn decade_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let ticks = |mults: &[f64]| -> Vec<f64> {
        (a..=b).flat_map(|e| mults.iter().map(move |m| m * 10f64.powi(e))).filter(|&t| t >= lo && t <= hi).collect()
    };
    let mut v = ticks(&[1.0]);
    if v.len() < 4 {
        v = ticks(&[1.0, 2.0, 5.0]);
    }
    if v.is_empty() {
        v = vec![(lo * hi).sqrt()];
    }
    v
}

/// A tick label: millions and thousands as `2M` and `500k`, other whole numbers without decimals,
/// the rest with about three significant digits.
fn fmt_tick(v: f64) -> String {
    if v >= 1e6 {
        return format!("{}M", fmt_tick(v / 1e6));
    }
    if v >= 1e4 {
        return format!("{}k", fmt_tick(v / 1e3));
    }
    if v >= 1.0 && v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        let s = fmt_value(v);
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    }
}

/// One horizontal bar per row, a panel per unit. `extra` names a row extra (e.g. `pct_of_copy`)
/// printed after the value as a percentage.
pub fn bar_chart(path: &Path, title: &str, rows: &[Row], extra: Option<&str>) -> CliResult<()> {
    init_font();
    if rows.is_empty() {
        return Err(plot_err(path, "no rows to plot"));
    }
    // Units in order of first appearance.
    let mut units: Vec<&'static str> = Vec::new();
    for r in rows {
        if !units.contains(&r.unit) {
            units.push(r.unit);
        }
    }
    let panels: Vec<Vec<&Row>> = units.iter().map(|u| rows.iter().filter(|r| r.unit == *u).collect()).collect();
    let heights: Vec<u32> = panels.iter().map(|p| PANEL_EXTRA_PX + ROW_PX * p.len() as u32).collect();
    let height = TITLE_PX + heights.iter().sum::<u32>();
    let label_px = rows.iter().map(|r| r.name.chars().count()).max().unwrap_or(4) as u32 * 8 + 20;

    render(path, (WIDTH, height), |root| {
        root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
        let (top, mut rest) = root.split_vertically(TITLE_PX);
        top.titled(title, ("sans-serif", 24)).map_err(|e| plot_err(path, e))?;
        for (i, (panel, h)) in panels.iter().zip(&heights).enumerate() {
            let (area, below) = rest.split_vertically(*h);
            bar_panel(&area, path, panel, label_px, extra, COLOURS[i % COLOURS.len()])?;
            rest = below;
        }
        Ok(())
    })
}

fn bar_panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    path: &Path,
    rows: &[&Row],
    label_px: u32,
    extra: Option<&str>,
    colour: RGBColor,
) -> CliResult<()> {
    let n = rows.len();
    let vals: Vec<f64> = rows.iter().map(|r| r.value).collect();
    let pos: Vec<f64> = vals.iter().copied().filter(|v| plottable(*v)).collect();
    let (vmin, vmax) = pos.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let unit = rows[0].unit;
    let better = if rows[0].higher_is_better { "higher is better" } else { "lower is better" };
    let log = !pos.is_empty() && vmax / vmin > LOG_SPAN;
    let caption = format!("{unit} ({better}{})", if log { "; log scale" } else { "" });
    // Row i sits in segment n - 1 - i, so that the first row is at the top.
    let seg = |i: usize| (n - 1 - i) as i32;
    let label_of = |v: &SegmentValue<i32>| -> String {
        let k = match v {
            SegmentValue::CenterOf(k) | SegmentValue::Exact(k) => *k,
            SegmentValue::Last => return String::new(),
        };
        usize::try_from(n as i32 - 1 - k).ok().and_then(|i| rows.get(i)).map(|r| r.name.clone()).unwrap_or_default()
    };
    let value_text = |r: &Row| -> String {
        let mut s = format!("{} {}", fmt_value(r.value), r.unit);
        if let Some(x) = extra.and_then(|k| r.extra.get(k)).and_then(|v| v.as_f64()) {
            if x.is_finite() {
                s += &format!(" ({x:.0}%)");
            }
        }
        s
    };
    let mut b = ChartBuilder::on(area);
    b.caption(caption, ("sans-serif", 18))
        .margin(10)
        .margin_right(40)
        .x_label_area_size(30)
        .y_label_area_size(label_px);

    // Room to the right of the longest bar for its value.
    macro_rules! draw {
        ($xrange:expr, $x0:expr) => {{
            let mut chart =
                b.build_cartesian_2d($xrange, (0..n as i32 - 1).into_segmented()).map_err(|e| plot_err(path, e))?;
            chart
                .configure_mesh()
                .disable_y_mesh()
                .light_line_style(WHITE)
                .y_labels(n)
                .y_label_formatter(&label_of)
                .x_label_formatter(&|v| fmt_tick(*v))
                .label_style(("sans-serif", 14))
                .draw()
                .map_err(|e| plot_err(path, e))?;
            for (i, r) in rows.iter().enumerate() {
                if !plottable(r.value) {
                    continue;
                }
                let (y0, y1) = (SegmentValue::Exact(seg(i)), SegmentValue::Exact(seg(i) + 1));
                let mut bar = Rectangle::new([($x0, y0), (r.value, y1)], colour.filled());
                bar.set_margin(5, 5, 0, 0);
                chart.draw_series(std::iter::once(bar)).map_err(|e| plot_err(path, e))?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        format!(" {}", value_text(r)),
                        (r.value, SegmentValue::CenterOf(seg(i))),
                        ("sans-serif", 14).into_font().color(&BLACK).pos(text_anchor()),
                    )))
                    .map_err(|e| plot_err(path, e))?;
            }
        }};
    }
    if pos.is_empty() {
        draw!(0f64..1f64, 0f64);
    } else if log {
        let (lo, hi) = (vmin / 3.0, vmax * 12.0);
        draw!((lo..hi).log_scale().with_key_points(decade_ticks(lo, hi)), lo);
    } else {
        draw!(0f64..vmax * 1.35, 0f64);
    }
    Ok(())
}

/// Text placed just right of the bar's end, centred vertically.
fn text_anchor() -> plotters::style::text_anchor::Pos {
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    Pos::new(HPos::Left, VPos::Center)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ferrograd-plot-{name}-{}.png", std::process::id()))
    }

    /// Decode a PNG; return (width, height, RGB pixels).
    fn decode(p: &Path) -> (u32, u32, Vec<u8>) {
        let bytes = std::fs::read(p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG signature");
        let mut dec = png::Decoder::new(std::io::Cursor::new(bytes));
        dec.set_transformations(png::Transformations::EXPAND);
        let mut reader = dec.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    /// Dark pixels in the rectangle (x0..x1, y0..y1) of an RGB image `w` wide.
    fn ink(px: &[u8], w: u32, (x0, x1): (u32, u32), (y0, y1): (u32, u32)) -> usize {
        let mut n = 0;
        for y in y0..y1 {
            for x in x0..x1 {
                let i = 3 * (y * w + x) as usize;
                if px[i] < 100 && px[i + 1] < 100 && px[i + 2] < 100 {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn the_embedded_font_draws_text() {
        init_font();
        let p = tmp("text");
        {
            let root = BitMapBackend::new(&p, (200, 60)).into_drawing_area();
            root.fill(&WHITE).unwrap();
            root.draw(&Text::new("GFLOP/s 123", (10, 20), ("sans-serif", 20).into_font().color(&BLACK))).unwrap();
            root.present().unwrap();
        }
        let (w, h, px) = decode(&p);
        std::fs::remove_file(&p).unwrap();
        assert_eq!((w, h), (200, 60));
        // Glyphs leave dark pixels; with no font, nothing would be drawn.
        assert!(ink(&px, w, (0, w), (0, h)) > 100, "the text left no ink");
    }

    #[test]
    fn line_chart_writes_a_png_with_a_title() {
        let p = tmp("line");
        let series = vec![
            Series { label: "CPU naive loop".into(), points: vec![(128.0, 7.0), (256.0, 8.6), (1024.0, 12.2)] },
            Series { label: "CUDA f32".into(), points: vec![(128.0, 440.0), (1024.0, 37_000.0)] },
            Series { label: "CUDA bf16".into(), points: vec![(8192.0, 673_000.0)] },
        ];
        line_chart(&p, "matmul", "n", "GFLOP/s", &series).unwrap();
        let (w, h, px) = decode(&p);
        std::fs::remove_file(&p).unwrap();
        assert_eq!((w, h), (WIDTH, 700));
        // The caption's glyphs sit in the top band, centred.
        assert!(ink(&px, w, (w / 2 - 100, w / 2 + 100), (0, 45)) > 50, "no caption drawn");
    }

    #[test]
    fn bar_chart_makes_a_panel_per_unit() {
        let p = tmp("bars");
        let rows = vec![
            Row::new("h2d pinned 256 MiB", 55.4, "GB/s", true),
            Row::new("h2d pageable 256 MiB", 26.4, "GB/s", true),
            Row::new("100 x 4 KiB h2d: separate copies", 230.8, "µs", false),
            Row::new("cached allocate+free 64 MiB", 0.0877, "µs", false),
            Row::new("broken", f64::NAN, "µs", false),
        ];
        bar_chart(&p, "transfer", &rows, None).unwrap();
        let (w, h, _) = decode(&p);
        std::fs::remove_file(&p).unwrap();
        assert_eq!(w, WIDTH);
        assert_eq!(h, TITLE_PX + 2 * PANEL_EXTRA_PX + 5 * ROW_PX);
    }

    #[test]
    fn nothing_to_plot_is_an_error_not_a_panic() {
        let p = tmp("empty");
        assert!(bar_chart(&p, "x", &[], None).is_err());
        let s = vec![Series { label: "zero".into(), points: vec![(0.0, 0.0)] }];
        assert!(line_chart(&p, "x", "n", "y", &s).unwrap_err().to_string().contains("no positive figures"));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn log_ticks_cover_the_range() {
        assert_eq!(decade_ticks(0.5, 1200.0), vec![1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(decade_ticks(3.0, 60.0), vec![5.0, 10.0, 20.0, 50.0]);
        assert_eq!(decade_ticks(6.0, 102.0), vec![10.0, 20.0, 50.0, 100.0]);
        assert_eq!(decade_ticks(3.0, 4.0).len(), 1);
        let ticks: Vec<String> = [100.0, 0.5, 2.5, 0.0125, 5000.0, 20_000.0, 1e6, 2.5e6].map(fmt_tick).to_vec();
        assert_eq!(ticks, ["100", "0.5", "2.5", "0.0125", "5000", "20k", "1M", "2.5M"]);
    }
}
