//! `kiln train`'s output on stdout (rank 0): the run's opening lines, then a progress bar with
//! step, loss, learning rate, tokens/s and ETA when stdout is a terminal, or periodic step lines
//! when it is not (under `kiln launch`, redirected to a file); validation and snapshot lines; the
//! summary and the sample. The wording is kiln-train's ([`kiln_train::report`]).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln_train::report::{self, Event, Report, RunInfo, clock, human};
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};

/// Prints a run's events to stdout.
#[derive(Debug)]
pub struct Console {
    terminal: bool,
    info: Option<RunInfo>,
    bar: Option<Bar>,
}

/// The bar, and the text after it (loss, lr, tokens/s, ETA), which the bar's style reads when
/// it draws: set before the position, so that one draw shows a step's position and numbers.
#[derive(Debug)]
struct Bar {
    bar: ProgressBar,
    stats: Arc<Mutex<String>>,
}

impl Console {
    /// A bar when stdout is a terminal, lines otherwise.
    pub fn new() -> Console {
        Console {
            terminal: std::io::stdout().is_terminal(),
            info: None,
            bar: None,
        }
    }

    /// Prints a line above the bar, if there is one.
    fn line(&self, text: &str) {
        match &self.bar {
            Some(b) => b.bar.suspend(|| println!("{text}")),
            None => println!("{text}"),
        }
    }
}

impl Bar {
    fn new(info: &RunInfo) -> Bar {
        let stats = Arc::new(Mutex::new(String::new()));
        let text = stats.clone();
        let style = ProgressStyle::with_template("step {pos:>6}/{len} [{bar:24}] {stats}")
            .expect("a valid template")
            .progress_chars("#>.")
            .with_key(
                "stats",
                move |_: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = w.write_str(&text.lock().expect("not poisoned"));
                },
            );
        let bar = ProgressBar::with_draw_target(
            Some(info.total_steps as u64),
            ProgressDrawTarget::stdout(),
        )
        .with_position(info.first_step as u64)
        .with_style(style);
        Bar { bar, stats }
    }
}

impl Report for Console {
    fn report(&mut self, event: Event<'_>) {
        match event {
            Event::Started(info) => {
                for line in info.start_lines() {
                    println!("{line}");
                }
                if self.terminal && info.last_step > info.first_step {
                    self.bar = Some(Bar::new(info));
                }
                self.info = Some(info.clone());
            }
            Event::Step(s) => {
                let Some(info) = &self.info else { return };
                match &self.bar {
                    Some(b) => {
                        *b.stats.lock().expect("not poisoned") = format!(
                            "loss {:.4} lr {:.2e} {} tok/s ETA {}",
                            s.loss,
                            s.lr,
                            human(s.tokens_per_s),
                            clock(s.eta_s)
                        );
                        b.bar.set_position(s.step as u64);
                    }
                    None if info.prints_line_at(s.step) => println!("{}", info.step_line(s)),
                    None => {}
                }
            }
            Event::Validated { step, loss } => self.line(&report::validated_line(step, loss)),
            Event::Saved { step, dir } => self.line(&report::saved_line(step, dir)),
            Event::Finished { summary, elapsed_s } => {
                if let Some(b) = self.bar.take() {
                    b.bar.finish();
                }
                if let Some(info) = &self.info {
                    for line in info.summary_lines(summary, elapsed_s) {
                        println!("{line}");
                    }
                }
            }
            // Events added later are shown once this command knows them.
            _ => {}
        }
    }
}
