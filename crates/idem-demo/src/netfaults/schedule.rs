//! The seeded schedule of network faults: for each proxy, a sequence of faults with the
//! gaps between them, drawn from its own generator and printed as it is applied.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

use super::proxy::{Direction, FaultProxy, NetFault};

/// How faults are drawn.
#[derive(Debug, Clone)]
pub struct ScheduleSpec {
    /// Seed of the generators (each proxy's is derived from it and the proxy's index).
    pub seed: u64,
    /// Time without a fault between two faults of one proxy.
    pub gap: Range<Duration>,
    /// How long a partition or a half-open peer lasts.
    pub partition: Range<Duration>,
    /// How long a latency spike, a reset window or a drip lasts.
    pub other: Range<Duration>,
}

impl ScheduleSpec {
    /// Faults seeded with `seed`, partitions lasting `partition`, others 100 to 800 ms,
    /// 200 ms to 1.5 s apart on each proxy.
    pub fn new(seed: u64, partition: Range<Duration>) -> Self {
        ScheduleSpec {
            seed,
            gap: Duration::from_millis(200)..Duration::from_millis(1500),
            partition,
            other: Duration::from_millis(100)..Duration::from_millis(800),
        }
    }
}

/// One step of a proxy's schedule: wait, then put `fault` in force for `lasts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Time without a fault before this one.
    pub wait: Duration,
    /// The fault.
    pub fault: NetFault,
    /// How long it is in force.
    pub lasts: Duration,
}

/// The endless, seeded sequence of steps of proxy number `index`.
pub fn steps(spec: &ScheduleSpec, index: usize) -> impl Iterator<Item = Step> + use<> {
    let mut rng = StdRng::seed_from_u64(spec.seed ^ (0x6e65_7466 + index as u64 * 0x9e37));
    let spec = spec.clone();
    std::iter::from_fn(move || {
        let wait = draw(&mut rng, &spec.gap);
        let dir = match rng.random_range(0..3) {
            0 => Direction::Upstream,
            1 => Direction::Downstream,
            _ => Direction::Both,
        };
        let (fault, lasts) = match rng.random_range(0..5) {
            0 => (NetFault::Partition(dir), draw(&mut rng, &spec.partition)),
            1 => {
                let ms = rng.random_range(20..250);
                (
                    NetFault::Latency(Duration::from_millis(ms)),
                    draw(&mut rng, &spec.other),
                )
            }
            2 => (
                NetFault::ResetAfter(rng.random_range(0..4096)),
                draw(&mut rng, &spec.other),
            ),
            3 => (NetFault::StopReading(dir), draw(&mut rng, &spec.partition)),
            _ => (
                NetFault::Drip {
                    bytes: rng.random_range(1..64),
                    every: Duration::from_millis(rng.random_range(1..10)),
                },
                draw(&mut rng, &spec.other),
            ),
        };
        Some(Step { wait, fault, lasts })
    })
}

fn draw(rng: &mut StdRng, range: &Range<Duration>) -> Duration {
    if range.is_empty() {
        return range.start;
    }
    let ms = rng.random_range(range.start.as_millis() as u64..range.end.as_millis() as u64);
    Duration::from_millis(ms)
}

/// The faults applied so far, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultCounts {
    by_kind: BTreeMap<&'static str, u64>,
}

impl FaultCounts {
    /// Faults applied.
    pub fn total(&self) -> u64 {
        self.by_kind.values().sum()
    }

    /// Faults of `kind` (see [`NetFault::kind`]).
    pub fn of(&self, kind: &str) -> u64 {
        self.by_kind.get(kind).copied().unwrap_or(0)
    }

    fn add(&mut self, fault: &NetFault) {
        *self.by_kind.entry(fault.kind()).or_default() += 1;
    }
}

impl std::fmt::Display for FaultCounts {
    /// `37 network faults: 9 partitions, 8 latency spikes, …`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} network faults", self.total())?;
        const KINDS: [&str; 5] = [
            "partitions",
            "latency spikes",
            "resets",
            "half-open",
            "drips",
        ];
        let mut sep = ": ";
        for kind in KINDS {
            write!(f, "{sep}{} {kind}", self.of(kind))?;
            sep = ", ";
        }
        Ok(())
    }
}

/// The schedules of a set of proxies, running until [`FaultDriver::stop`].
pub struct FaultDriver {
    tasks: Vec<JoinHandle<()>>,
    proxies: Vec<Arc<FaultProxy>>,
    counts: Arc<Mutex<FaultCounts>>,
}

impl FaultDriver {
    /// Runs each proxy's [`steps`] (named by `name` in the printed lines, on standard
    /// error when `print`).
    pub fn start(
        spec: &ScheduleSpec,
        proxies: Vec<(String, Arc<FaultProxy>)>,
        print: bool,
    ) -> Self {
        let counts = Arc::new(Mutex::new(FaultCounts::default()));
        let started = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for (index, (name, proxy)) in proxies.iter().enumerate() {
            let (name, proxy, counts) = (name.clone(), proxy.clone(), counts.clone());
            let plan = steps(spec, index);
            tasks.push(tokio::spawn(async move {
                for step in plan {
                    tokio::time::sleep(step.wait).await;
                    counts.lock().expect("counts lock").add(&step.fault);
                    if print {
                        eprintln!(
                            "net fault +{:.3}s {name}: {} for {} ms",
                            started.elapsed().as_secs_f64(),
                            step.fault,
                            step.lasts.as_millis()
                        );
                    }
                    proxy.set(Some(step.fault));
                    tokio::time::sleep(step.lasts).await;
                    proxy.heal();
                }
            }));
        }
        FaultDriver {
            tasks,
            proxies: proxies.into_iter().map(|(_, p)| p).collect(),
            counts,
        }
    }

    /// Stops every schedule, heals every proxy, and says what was applied.
    pub fn stop(self) -> FaultCounts {
        for t in &self.tasks {
            t.abort();
        }
        for p in &self.proxies {
            p.heal();
        }
        self.counts.lock().expect("counts lock").clone()
    }
}
