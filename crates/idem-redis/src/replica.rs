//! Confirmation of writes on replicas with Redis `WAIT` ([`ReplicaAcks`]): the script and
//! `WAIT` in one pipeline, the count of acknowledgements checked, and a claim confirmed or
//! released again. See [`RedisStoreBuilder::replica_acks`](crate::RedisStoreBuilder::replica_acks).

use std::time::Duration;

use idem_store::{ClaimRequest, Fence, Scope, StoreError};
use redis::{ErrorKind, RedisError, Script, ServerErrorKind, Value};

use crate::reply::{array, corrupt, int, tag};
use crate::store::{RedisStore, ms};

/// Confirmation of claims and completions on replicas with Redis `WAIT` (see
/// [`RedisStoreBuilder::replica_acks`](crate::RedisStoreBuilder::replica_acks)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaAcks {
    /// How many replicas must acknowledge each claim, renewal and completion.
    pub replicas: usize,
    /// How long `WAIT` waits for them (less than the command timeout).
    pub timeout: Duration,
}

impl RedisStore {
    /// Runs `script` on `keys` (`EVALSHA`, loading the script on `NOSCRIPT`, e.g. after a
    /// Redis restart or on a node that joined the cluster). With `confirm` and replica
    /// confirmation on, `WAIT` follows in the same pipeline, so it runs on the
    /// connection that wrote and waits for this write; the second value is then the
    /// number of replicas that acknowledged it.
    pub(crate) async fn eval_confirmed(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
        limit: Duration,
        confirm: bool,
    ) -> Result<(Value, Option<i64>), StoreError> {
        let acks = self.backend.replica_acks.filter(|_| confirm);
        let size = 56
            + keys.iter().map(|k| k.len()).sum::<usize>()
            + args.iter().map(|a| a.len()).sum::<usize>();
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args.len(), size);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for k in keys {
            cmd.arg(*k);
        }
        for a in args {
            cmd.arg(*a);
        }
        let mut conn = self.connection();
        self.bounded(limit, async move {
            let mut loaded = false;
            loop {
                let reply = match acks {
                    None => cmd.query_async::<Value>(&mut conn).await.map(|v| (v, None)),
                    Some(a) => {
                        let mut pipe = redis::pipe();
                        pipe.add_command(cmd.clone())
                            .cmd("WAIT")
                            .arg(a.replicas)
                            .arg(ms(a.timeout));
                        pipe.query_async::<Vec<Value>>(&mut conn)
                            .await
                            .and_then(script_and_acks)
                    }
                };
                match reply {
                    Err(e)
                        if !loaded && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
                    {
                        script.prepare_invoke().load_async(&mut conn).await?;
                        loaded = true;
                    }
                    r => return r,
                }
            }
        })
        .await
    }

    /// `Unavailable` unless the write was acknowledged by the replicas asked for.
    pub(crate) fn check_acks(&self, acks: Option<i64>) -> Result<(), StoreError> {
        let (Some(want), Some(got)) = (self.backend.replica_acks, acks) else {
            return Ok(());
        };
        if usize::try_from(got).is_ok_and(|got| got >= want.replicas) {
            return Ok(());
        }
        Err(StoreError::Unavailable(
            format!(
                "write acknowledged by {got} of {} replicas within {:?} (WAIT)",
                want.replicas, want.timeout
            )
            .into(),
        ))
    }

    /// Confirms on the replicas that the record holds `fence` (in flight or completed):
    /// a write of the record to itself, then `WAIT`. `Fenced` when the record is not
    /// there with that fence (a failover lost it, or it was taken over).
    pub(crate) async fn confirm(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        let key = self.key_for(scope);
        let fence_s = crate::reply::Decimal::new(fence);
        let (v, acks) = self
            .eval_confirmed(
                &self.backend.scripts.confirm,
                &[&key],
                &[fence_s.as_bytes()],
                self.backend.command_timeout,
                true,
            )
            .await?;
        let mut it = array(v)?.into_iter();
        match tag(it.next())?.as_slice() {
            b"OK" => self.check_acks(acks),
            b"F" => Err(StoreError::Fenced {
                presented: fence,
                current: u64::try_from(int(it.next())?).ok(),
            }),
            _ => Err(corrupt("unexpected confirm reply tag")),
        }
    }

    /// Confirms an acquired claim on the replicas (replica confirmation on). Not
    /// confirmed in time: the claim is released again (best effort; nothing ran) and the
    /// caller gets `Unavailable`, so no handler runs on a claim a failover could forget.
    pub(crate) async fn confirm_claim(
        &self,
        req: &ClaimRequest<'_>,
        fence: Fence,
    ) -> Result<(), StoreError> {
        match self.confirm(req.scope, fence).await {
            Ok(()) => Ok(()),
            Err(e) => {
                if matches!(e, StoreError::Unavailable(_))
                    && let Err(r) = idem_store::Store::release(self, req.scope, fence).await
                {
                    tracing::debug!(error = %r, "unconfirmed claim not released; it lapses with its lease");
                }
                Err(match e {
                    StoreError::Fenced { .. } => StoreError::Unavailable(
                        "the claim was lost before replicas confirmed it (failover?)".into(),
                    ),
                    e => e,
                })
            }
        }
    }
}

/// The replies of an `EVALSHA` + `WAIT` pipeline: the script's reply (an error reply
/// raised as the error it is) and the number of replicas that acknowledged.
fn script_and_acks(items: Vec<Value>) -> Result<(Value, Option<i64>), RedisError> {
    let bad = || RedisError::from((ErrorKind::UnexpectedReturnType, "EVALSHA + WAIT reply"));
    let mut it = items.into_iter();
    let script = it.next().ok_or_else(bad)?.extract_error()?;
    match it.next().ok_or_else(bad)?.extract_error()? {
        Value::Int(n) => Ok((script, Some(n))),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::map_error;

    #[test]
    fn evalsha_and_wait_replies_of_any_shape_never_panic() {
        let ok = Value::Array(vec![Value::BulkString(b"OK".to_vec())]);
        assert!(matches!(
            script_and_acks(vec![ok.clone(), Value::Int(1)]),
            Ok((_, Some(1)))
        ));
        // Too short, WAIT not an integer, a script error: errors, not panics.
        assert!(script_and_acks(vec![]).is_err());
        assert!(script_and_acks(vec![ok.clone()]).is_err());
        assert!(script_and_acks(vec![ok.clone(), Value::Nil]).is_err());
        assert!(
            script_and_acks(vec![
                redis::parse_redis_value(b"-NOSCRIPT No matching script.\r\n")
                    .expect("an error reply parses as a value"),
                Value::Int(1),
            ])
            .is_err_and(|e| e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
        );
        // A WAIT error reply (e.g. a replica refusing it) is an error too.
        let wait_err = redis::RedisError::from((ErrorKind::Io, "gone"));
        assert!(map_error(wait_err).to_string().contains("gone"));
    }
}
