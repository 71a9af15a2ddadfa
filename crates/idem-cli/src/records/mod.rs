//! `idem records show|delete`: an operator's look at one idempotency record in Redis or
//! PostgreSQL, and its removal when the call must run again.
//!
//! The record is named as the server names it: by tenant, method and key (the scope is
//! computed exactly as the server layer computes it, `Scope::for_call`), or by the
//! scope hex that the server's logs and spans print (`scope=<16 hex digits>`), when that
//! prefix identifies one record.
//!
//! Exit status: 0 found (or deleted), 1 no such record, 2 bad arguments, a store that
//! cannot be reached, a record that cannot be read, or an in-flight record that
//! `delete` did not delete without `--force`.

mod args;
mod render;
mod store;

use std::process::ExitCode;

use idem_store::{DeleteMode, Deletion, RecordInfo, Scope, StoreError};

use args::{Args, Selector};
use store::{Backend, PREFIX_MATCHES_SHOWN, Redact};

/// Exit status: no such record.
const NOT_FOUND: u8 = 1;
/// Exit status: bad arguments, store unreachable, unreadable record, refused delete.
const FAILED: u8 = 2;

/// The usage text of `idem records`.
pub(crate) const USAGE: &str = "\
  idem records show STORE [--key-prefix P] RECORD [--proto FILE]... [-I DIR]... [--json]
                            print one idempotency record: its state, fence, lease,
                            times, and the stored response (messages as hex, or as
                            JSON with the service's --proto files)
  idem records delete STORE [--key-prefix P] RECORD [--force]
                            delete it, so the next call with its key runs again;
                            an in-flight record only with --force
      STORE   --redis URL | --redis-cluster URL,URL... | --postgres URL
      RECORD  --tenant T --method package.Service/Method --key K | --scope HEX
              (--scope takes the 16 hex digits of the logs' scope=, or all 64)
      --key-prefix  the Redis key prefix (default idem:) or PostgreSQL table prefix
                    (default idem_) the service uses

records exits with 0 when the record was found (or deleted), 1 when there is no such
record, and 2 on bad arguments, a store that cannot be reached, a record that cannot be
read, or an in-flight record not deleted without --force.
A record holds the response its call returned: access to the store is access to them.
";

/// Runs `idem records …` (`args` after `records`).
pub(crate) fn main(args: &[&str]) -> ExitCode {
    let (delete, rest) = match args {
        ["show", rest @ ..] => (false, rest),
        ["delete", rest @ ..] => (true, rest),
        [] => return fail("records needs show or delete"),
        [other, ..] => {
            return fail(&format!(
                "unknown records command {other:?}: use show or delete"
            ));
        }
    };
    let args = match args::parse(rest, delete) {
        Ok(a) => a,
        Err(e) => return fail(&e),
    };
    let redact = Redact::of(&args.target);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(&format!("cannot start: {e}")),
    };
    match runtime.block_on(run(&args, delete)) {
        Ok(Outcome {
            stdout,
            stderr,
            code,
        }) => {
            super::out(&redact.text(&stdout));
            super::err(&redact.text(&stderr));
            ExitCode::from(code)
        }
        Err(e) => {
            super::err(&format!("idem records: {}\n", redact.text(&e)));
            ExitCode::from(FAILED)
        }
    }
}

fn fail(message: &str) -> ExitCode {
    super::err(&format!("idem records: {message}\n\nUsage:\n{USAGE}"));
    ExitCode::from(FAILED)
}

struct Outcome {
    stdout: String,
    stderr: String,
    code: u8,
}

impl Outcome {
    fn not_found(what: String) -> Self {
        Outcome {
            stdout: String::new(),
            stderr: format!("idem records: {what}\n"),
            code: NOT_FOUND,
        }
    }
}

async fn run(args: &Args, delete: bool) -> Result<Outcome, String> {
    let method_path = match &args.selector {
        Selector::Call { method_path, .. } => Some(method_path.as_str()),
        Selector::Hex(_) => None,
    };
    // Compiled before the store is reached: a bad proto is bad input, whatever the store.
    let ty = render::response_type(&args.protos, &args.includes, method_path)?;
    let where_ = store::describe(&args.target);
    let backend = Backend::connect(&args.target, args.key_prefix.as_deref())
        .await
        .map_err(|e| format!("cannot reach the store ({where_}): {e}"))?;
    let unavailable = |e: StoreError| format!("store error ({where_}): {e}");
    let scope = match &args.selector {
        Selector::Call { scope, .. } => *scope,
        Selector::Hex(bytes) => match <[u8; 32]>::try_from(bytes.as_slice()) {
            Ok(full) => Scope(full),
            Err(_) => {
                let found = backend.find(bytes).await.map_err(unavailable)?;
                match found.as_slice() {
                    [] => {
                        return Ok(Outcome::not_found(format!(
                            "no record whose scope starts with {} in {where_}",
                            hex(bytes)
                        )));
                    }
                    [one] => *one,
                    many => {
                        let shown: Vec<String> = many
                            .iter()
                            .take(PREFIX_MATCHES_SHOWN)
                            .map(Scope::to_hex)
                            .collect();
                        return Err(format!(
                            "--scope {} matches {}{} records; give more digits:\n  {}",
                            hex(bytes),
                            if many.len() > PREFIX_MATCHES_SHOWN {
                                "more than "
                            } else {
                                ""
                            },
                            many.len().min(PREFIX_MATCHES_SHOWN),
                            shown.join("\n  ")
                        ));
                    }
                }
            }
        },
    };
    let location = backend.location(&scope);
    if !delete {
        let Some(info) = backend.read(&scope).await.map_err(unavailable)? else {
            return Ok(Outcome::not_found(format!(
                "no record {} in {where_} ({location})",
                scope.to_hex()
            )));
        };
        return Ok(Outcome {
            stdout: print(args, &scope, &location, &info, ty.as_ref())?,
            stderr: String::new(),
            code: 0,
        });
    }
    let mode = if args.force {
        DeleteMode::Force
    } else {
        DeleteMode::UnlessInFlight
    };
    match backend.delete(&scope, mode).await.map_err(unavailable)? {
        Deletion::NotFound => Ok(Outcome::not_found(format!(
            "no record {} in {where_} ({location})",
            scope.to_hex()
        ))),
        Deletion::RefusedInFlight(info) => Ok(Outcome {
            stdout: print(args, &scope, &location, &info, None)?,
            stderr: format!("idem records: {}\n", Deletion::RefusedInFlight(info)),
            code: FAILED,
        }),
        Deletion::Deleted(info) => {
            let warning = if info.is_in_flight() {
                format!(
                    "idem records: warning: deleted an in-flight record (--force): {}\n",
                    idem_store::FORCE_DELETE_RISK
                        .split(". Pass --force")
                        .next()
                        .unwrap_or_default()
                )
            } else {
                String::new()
            };
            // What was deleted: printed with hex messages, so a response that no longer
            // decodes does not hide that the delete happened.
            let printed = print(args, &scope, &location, &info, ty.as_ref())
                .or_else(|_| print(args, &scope, &location, &info, None))
                .unwrap_or_else(|e| format!("(the deleted response does not decode: {e})\n"));
            Ok(Outcome {
                stdout: format!("deleted\n{printed}"),
                stderr: warning,
                code: 0,
            })
        }
    }
}

fn print(
    args: &Args,
    scope: &Scope,
    location: &str,
    info: &RecordInfo,
    ty: Option<&prost_reflect::MessageDescriptor>,
) -> Result<String, String> {
    let v = render::record_json(scope, location, info, ty)?;
    Ok(if args.json {
        format!("{v}\n")
    } else {
        render::text(&v)
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
