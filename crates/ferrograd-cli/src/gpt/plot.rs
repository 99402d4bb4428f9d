//! Loss curves from JSON-lines logs: `{"kind": "train", "step": S, "loss": L}` lines (and
//! `{"kind": "val", "step": S, "val_loss": L}`), which `gpt train` and `bench/gpt2_torch.py` both
//! write. One solid line per log's training loss, dashed for its validation loss.

use crate::plot::{init_font, plot_err, COLOURS};
use crate::CliResult;
use clap::Args;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// JSON-lines logs (OUT/log.jsonl of `gpt train`, or the PyTorch twin's --log).
    #[arg(required = true, value_name = "LOGS")]
    pub logs: Vec<PathBuf>,
    /// One label per log, comma-separated (default: the file names).
    #[arg(long, value_delimiter = ',')]
    pub labels: Vec<String>,
    #[arg(long, value_name = "FILE.png")]
    pub out: PathBuf,
    #[arg(long, default_value = "GPT training loss")]
    pub title: String,
}

pub fn run(a: PlotArgs, out: &mut dyn Write) -> CliResult<()> {
    draw(&a.logs, &a.labels, &a.out, &a.title)?;
    writeln!(out, "wrote {}", a.out.display())?;
    Ok(())
}

/// `(train, val)` points of one log.
type Curves = (Vec<(f64, f64)>, Vec<(f64, f64)>);

fn read_log(path: &Path) -> CliResult<Curves> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (mut train, mut val) = (vec![], vec![]);
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{} line {}: not JSON: {e}", path.display(), i + 1))?;
        let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
        let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or("train");
        match (kind, num("step"), num("loss"), num("val_loss")) {
            ("train", Some(s), Some(l), _) if l.is_finite() => train.push((s, l)),
            ("val", Some(s), _, Some(l)) if l.is_finite() => val.push((s, l)),
            _ => {}
        }
    }
    if train.is_empty() && val.is_empty() {
        return Err(format!("{}: no loss lines ({{\"step\": .., \"loss\": ..}})", path.display()).into());
    }
    Ok((train, val))
}

/// Draw the logs' curves into `png`.
pub fn draw(logs: &[PathBuf], labels: &[String], png: &Path, title: &str) -> CliResult<()> {
    init_font();
    if !labels.is_empty() && labels.len() != logs.len() {
        return Err(format!("{} labels for {} logs", labels.len(), logs.len()).into());
    }
    let curves = logs.iter().map(|l| read_log(l)).collect::<CliResult<Vec<_>>>()?;
    let all = curves.iter().flat_map(|(t, v)| t.iter().chain(v));
    let (mut x1, mut y0, mut y1) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in all {
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    // Drawn in memory and written atomically (crate::plot::render), like every plot we write.
    crate::plot::render(png, (crate::plot::WIDTH, 700), |root| {
        draw_curves(root, &curves, logs, labels, png, title, (x1, y0 - pad, y1 + pad))
    })
}

fn draw_curves(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    curves: &[Curves],
    logs: &[PathBuf],
    labels: &[String],
    png: &Path,
    title: &str,
    (x1, ylo, yhi): (f64, f64, f64),
) -> CliResult<()> {
    root.fill(&WHITE).map_err(|e| plot_err(png, e))?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x1, ylo..yhi)
        .map_err(|e| plot_err(png, e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("loss (nats/token)")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(|e| plot_err(png, e))?;
    for (i, ((train, val), log)) in curves.iter().zip(logs).enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let name = labels
            .get(i)
            .cloned()
            .unwrap_or_else(|| log.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());
        if !train.is_empty() {
            chart
                .draw_series(LineSeries::new(train.clone(), colour.stroke_width(2)))
                .map_err(|e| plot_err(png, e))?
                .label(format!("{name} train"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(2)));
        }
        if !val.is_empty() {
            chart
                .draw_series(DashedLineSeries::new(val.clone(), 8, 5, colour.stroke_width(2)))
                .map_err(|e| plot_err(png, e))?
                .label(format!("{name} val"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour.mix(0.6).stroke_width(2)));
            chart.draw_series(val.iter().map(|&p| Circle::new(p, 4, colour.filled()))).map_err(|e| plot_err(png, e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(|e| plot_err(png, e))?;
    Ok(())
}
