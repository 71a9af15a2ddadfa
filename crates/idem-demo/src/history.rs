//! The history checker: every intent's attempts and what the caller saw, against the
//! orders that exist at the end.
//!
//! The workload records each application-level call of an intent ([`History::attempt`])
//! and each OK with the order it names ([`History::ok`]). [`History::check`] then takes
//! the orders the service wrote (intent and order id of each) and asserts, for every
//! intent:
//!
//! - it created exactly one order (none: lost; more: duplicates);
//! - every OK its caller saw names that order;
//! - no OK (first answer or replay) named another intent's order.
//!
//! ```
//! use idem_demo::history::History;
//!
//! let history = History::default();
//! history.attempt("intent-0");
//! history.ok("intent-0", "ord-1");
//! let verdict = history.check(["intent-0"], [("intent-0", "ord-1")]);
//! assert!(verdict.is_exactly_once(), "{verdict}");
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// What the caller of one intent saw.
#[derive(Debug, Clone, Default)]
pub struct IntentHistory {
    /// Application-level calls made (the first and each application retry).
    pub attempts: u32,
    /// The order named by each OK, in the order they came.
    pub oks: Vec<String>,
}

/// Every intent's attempts and OKs, recorded as they happen (shared by the workload's
/// tasks).
#[derive(Debug, Default)]
pub struct History {
    intents: Mutex<HashMap<String, IntentHistory>>,
}

/// A broken promise found by [`History::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// The intent created more than one order.
    Duplicate {
        /// The intent.
        intent: String,
        /// Its orders.
        orders: Vec<String>,
    },
    /// The caller never got an OK.
    NeverOk {
        /// The intent.
        intent: String,
    },
    /// The caller got an OK, and the intent has no order.
    OkWithoutOrder {
        /// The intent.
        intent: String,
        /// The order the OK named.
        named: String,
    },
    /// An OK named an order that is not one of the intent's own.
    WrongOrder {
        /// The intent.
        intent: String,
        /// The order the OK named.
        named: String,
        /// The intent that order belongs to, if any.
        owner: Option<String>,
    },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::Duplicate { intent, orders } => {
                write!(
                    f,
                    "{intent} created {} orders: {}",
                    orders.len(),
                    orders.join(", ")
                )
            }
            Violation::NeverOk { intent } => write!(f, "{intent}: the caller never got an OK"),
            Violation::OkWithoutOrder { intent, named } => {
                write!(f, "{intent}: OK named {named}, and the intent has no order")
            }
            Violation::WrongOrder {
                intent,
                named,
                owner,
            } => match owner {
                Some(o) => write!(f, "{intent}: OK named {named}, an order of {o}"),
                None => write!(f, "{intent}: OK named {named}, which does not exist"),
            },
        }
    }
}

/// The outcome of [`History::check`].
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Intents checked.
    pub intents: u64,
    /// Orders beyond one per intent.
    pub duplicates: u64,
    /// Intents whose caller never got an OK.
    pub never_ok: u64,
    /// Intents whose caller got an OK although the intent has no order.
    pub ok_without_order: u64,
    /// OKs that named an order not of their intent.
    pub wrong_orders: u64,
    /// The first violations found (at most [`Verdict::SHOWN`]), for the message.
    pub violations: Vec<Violation>,
}

impl Verdict {
    /// How many violations a verdict keeps to show.
    pub const SHOWN: usize = 10;

    /// Intents whose caller never got an OK, or got one for an order that does not
    /// exist (the demo's `lost` column).
    pub fn lost(&self) -> u64 {
        self.never_ok + self.ok_without_order
    }

    /// Every intent created exactly one order, and every OK named it.
    pub fn is_exactly_once(&self) -> bool {
        self.duplicates == 0 && self.lost() == 0 && self.wrong_orders == 0
    }

    fn found(&mut self, v: Violation) {
        if self.violations.len() < Self::SHOWN {
            self.violations.push(v);
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} intents: {} duplicate orders, {} never OK, {} OK without an order, {} OKs naming another order",
            self.intents, self.duplicates, self.never_ok, self.ok_without_order, self.wrong_orders
        )?;
        for v in &self.violations {
            write!(f, "\n  {v}")?;
        }
        Ok(())
    }
}

impl History {
    /// The caller of `intent` makes a call.
    pub fn attempt(&self, intent: &str) {
        let mut intents = self.intents.lock().expect("history lock");
        intents.entry(intent.to_owned()).or_default().attempts += 1;
    }

    /// The caller of `intent` got an OK naming `order`.
    pub fn ok(&self, intent: &str, order: &str) {
        let mut intents = self.intents.lock().expect("history lock");
        let h = intents.entry(intent.to_owned()).or_default();
        h.oks.push(order.to_owned());
    }

    /// What the caller of `intent` saw.
    pub fn of(&self, intent: &str) -> Option<IntentHistory> {
        self.intents
            .lock()
            .expect("history lock")
            .get(intent)
            .cloned()
    }

    /// Checks every intent of `intents` against `orders` (intent, order id), the
    /// orders that exist.
    pub fn check<I, O, S, T>(&self, intents: I, orders: O) -> Verdict
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
        O: IntoIterator<Item = (T, T)>,
        T: AsRef<str>,
    {
        let mut by_intent: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut owner: HashMap<String, String> = HashMap::new();
        for (intent, order) in orders {
            let (intent, order) = (intent.as_ref().to_owned(), order.as_ref().to_owned());
            by_intent
                .entry(intent.clone())
                .or_default()
                .push(order.clone());
            owner.insert(order, intent);
        }
        let seen = self.intents.lock().expect("history lock");
        let mut v = Verdict::default();
        for intent in intents {
            let intent = intent.as_ref();
            v.intents += 1;
            let own = by_intent.get(intent).map(Vec::as_slice).unwrap_or(&[]);
            if own.len() > 1 {
                v.duplicates += own.len() as u64 - 1;
                v.found(Violation::Duplicate {
                    intent: intent.to_owned(),
                    orders: own.to_vec(),
                });
            }
            let oks = seen.get(intent).map(|h| h.oks.as_slice()).unwrap_or(&[]);
            if oks.is_empty() {
                v.never_ok += 1;
                v.found(Violation::NeverOk {
                    intent: intent.to_owned(),
                });
                continue;
            }
            if own.is_empty() {
                v.ok_without_order += 1;
                v.found(Violation::OkWithoutOrder {
                    intent: intent.to_owned(),
                    named: oks[0].clone(),
                });
                continue;
            }
            for named in oks.iter().filter(|o| !own.contains(o)) {
                v.wrong_orders += 1;
                v.found(Violation::WrongOrder {
                    intent: intent.to_owned(),
                    named: named.clone(),
                    owner: owner.get(named).cloned(),
                });
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_order_named_by_every_ok_is_exactly_once() {
        let h = History::default();
        for (i, o) in [("a", "1"), ("b", "2")] {
            h.attempt(i);
            h.attempt(i);
            h.ok(i, o);
            h.ok(i, o);
        }
        let v = h.check(["a", "b"], [("a", "1"), ("b", "2")]);
        assert!(v.is_exactly_once(), "{v}");
        assert_eq!(h.of("a").map(|h| h.attempts), Some(2));
    }

    #[test]
    fn finds_each_kind_of_violation() {
        let h = History::default();
        h.ok("dup", "1");
        h.ok("missing", "9");
        h.ok("swapped", "4");
        h.ok("other", "4");
        h.attempt("never");
        let orders = [("dup", "1"), ("dup", "2"), ("swapped", "3"), ("other", "4")];
        let v = h.check(["dup", "missing", "swapped", "other", "never"], orders);
        assert_eq!(v.duplicates, 1, "{v}");
        assert_eq!(v.ok_without_order, 1, "{v}");
        assert_eq!(v.wrong_orders, 1, "{v}");
        assert_eq!(v.never_ok, 1, "{v}");
        assert_eq!(v.lost(), 2);
        assert!(!v.is_exactly_once());
        assert!(v.violations.contains(&Violation::WrongOrder {
            intent: "swapped".into(),
            named: "4".into(),
            owner: Some("other".into()),
        }));
    }

    #[test]
    fn an_ok_naming_an_unknown_order_is_a_wrong_order() {
        let h = History::default();
        h.ok("a", "1");
        h.ok("a", "7");
        let v = h.check(["a"], [("a", "1")]);
        assert_eq!(v.wrong_orders, 1);
        assert!(v.to_string().contains("does not exist"), "{v}");
    }
}
