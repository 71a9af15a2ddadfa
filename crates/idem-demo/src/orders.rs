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
    orders_by_intent: Mutex<HashMap<String, u32>>,
    file: Option<Mutex<std::fs::File>>,
    next_id: AtomicU64,
}

impl Ledger {
    /// A ledger that appends each order's intent as a line of `path`.
    pub fn append_to(path: &std::path::Path) -> std::io::Result<Ledger> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Ledger {
            file: Some(Mutex::new(file)),
            ..Ledger::default()
        })
    }

    fn create(&self, intent: &str) -> u64 {
        if let Some(file) = &self.file {
            use std::io::Write;
            let line = format!("{intent}\n");
            file.lock()
                .expect("ledger lock")
                .write_all(line.as_bytes())
                .expect("append to the ledger file");
        } else {
            *self
                .orders_by_intent
                .lock()
                .expect("ledger lock")
                .entry(intent.to_owned())
                .or_default() += 1;
        }
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Orders per intent.
    pub fn by_intent(&self) -> HashMap<String, u32> {
        self.orders_by_intent.lock().expect("ledger lock").clone()
    }

    /// Orders per intent in a ledger file written by [`Ledger::append_to`].
    pub fn read_file(path: &std::path::Path) -> std::io::Result<HashMap<String, u32>> {
        let mut by_intent = HashMap::new();
        for line in std::fs::read_to_string(path)?.lines() {
            *by_intent.entry(line.to_owned()).or_default() += 1;
        }
        Ok(by_intent)
    }
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
            order_id: format!("ord-{id}"),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: self.instance.clone(),
        }))
    }
}
