//! The demo's `shop.v1.Orders`: a [`Ledger`] of orders per intent (the intent id travels
//! in the request's `note`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_test_support::shop::Order;
use tonic::Response;

/// Where the service writes its orders: a map in this process, or a file that server
/// processes append to (one `write` per order, `O_APPEND`), so orders survive a SIGKILL
/// of the process that created them.
#[derive(Default)]
pub struct Ledger {
    /// Each order's intent and id, in the order they were created.
    orders: Mutex<Vec<(String, String)>>,
    file: Option<Mutex<std::fs::File>>,
    next_id: AtomicU64,
    /// What makes the order ids of a file unique across the processes that append to it
    /// (their process id), empty in memory.
    id_prefix: String,
}

impl Ledger {
    /// A ledger that appends each order as a line of `path`: its intent and its id.
    pub fn append_to(path: &std::path::Path) -> std::io::Result<Ledger> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Ledger {
            file: Some(Mutex::new(file)),
            id_prefix: format!("{}-", std::process::id()),
            ..Ledger::default()
        })
    }

    /// Writes one order of `intent`; returns its id.
    fn create(&self, intent: &str) -> String {
        let id = format!(
            "ord-{}{}",
            self.id_prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        );
        if let Some(file) = &self.file {
            use std::io::Write;
            let line = format!("{intent} {id}\n");
            file.lock()
                .expect("ledger lock")
                .write_all(line.as_bytes())
                .expect("append to the ledger file");
        } else {
            let mut orders = self.orders.lock().expect("ledger lock");
            orders.push((intent.to_owned(), id.clone()));
        }
        id
    }

    /// Orders per intent.
    pub fn by_intent(&self) -> HashMap<String, u32> {
        count_by_intent(&self.orders())
    }

    /// Each order's intent and id.
    pub fn orders(&self) -> Vec<(String, String)> {
        self.orders.lock().expect("ledger lock").clone()
    }

    /// Orders per intent in a ledger file written by [`Ledger::append_to`].
    pub fn read_file(path: &std::path::Path) -> std::io::Result<HashMap<String, u32>> {
        Ok(count_by_intent(&Ledger::read_orders(path)?))
    }

    /// Each order's intent and id in a ledger file written by [`Ledger::append_to`].
    pub fn read_orders(path: &std::path::Path) -> std::io::Result<Vec<(String, String)>> {
        let text = std::fs::read_to_string(path)?;
        Ok(text
            .lines()
            .map(|line| match line.split_once(' ') {
                Some((intent, id)) => (intent.to_owned(), id.to_owned()),
                None => (line.to_owned(), String::new()),
            })
            .collect())
    }
}

/// Orders per intent of a list of (intent, order id).
pub fn count_by_intent(orders: &[(String, String)]) -> HashMap<String, u32> {
    let mut by_intent = HashMap::new();
    for (intent, _) in orders {
        *by_intent.entry(intent.clone()).or_default() += 1;
    }
    by_intent
}

/// `shop.v1.Orders` writing each order to a [`Ledger`].
pub struct LedgerOrders {
    ledger: Arc<Ledger>,
    instance: String,
}

impl LedgerOrders {
    /// The service of instance `instance`, writing to `ledger`.
    pub fn new(ledger: Arc<Ledger>, instance: String) -> Self {
        LedgerOrders { ledger, instance }
    }
}

idem_test_support::create_only_orders! {
    LedgerOrders, why = "the demo only creates orders";
    create_order(&self, request) {
        let r = request.into_inner();
        let id = self.ledger.create(&r.note);
        Ok(Response::new(Order {
            order_id: id,
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: self.instance.clone(),
        }))
    }
}
