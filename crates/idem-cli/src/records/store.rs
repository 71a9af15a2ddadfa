//! Connecting to the store a command names, and the three calls `idem records` makes
//! on it. Every message that could carry a URL goes through [`Redact`], so credentials
//! in a URL are never printed.

// Built without store clients, the calls below have nothing to use their arguments on.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres")),
    allow(unused_variables)
)]

#[cfg(any(feature = "redis", feature = "postgres"))]
use idem_store::Store;
use idem_store::{DeleteMode, Deletion, RecordInfo, Scope, StoreError};

use super::args::Target;

/// A store client.
pub(crate) enum Backend {
    #[cfg(feature = "redis")]
    Redis(idem_redis::RedisStore),
    #[cfg(feature = "postgres")]
    Postgres(idem_postgres::PostgresStore),
    /// Built without any store client: never made.
    #[cfg(not(any(feature = "redis", feature = "postgres")))]
    #[allow(dead_code)]
    None(std::convert::Infallible),
}

/// Most records a scope prefix may match before the command asks for a longer one.
pub(crate) const PREFIX_MATCHES_SHOWN: usize = 10;

/// `url` without its credentials: `redis://user:secret@host/0` → `redis://host/0`.
pub(crate) fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, url),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let rest = match rest[..authority_end].rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    match scheme {
        Some(s) => format!("{s}://{rest}"),
        None => rest.to_owned(),
    }
}

/// Removes every URL's credentials from messages about them.
pub(crate) struct Redact(Vec<String>);

impl Redact {
    pub(crate) fn of(target: &Target) -> Self {
        let urls = match target {
            Target::Redis(u) | Target::Postgres(u) => vec![u.clone()],
            Target::RedisCluster(us) => us.clone(),
        };
        let mut secrets = Vec::new();
        for u in urls {
            let rest = u.split_once("://").map_or(u.as_str(), |(_, r)| r);
            let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
            if let Some(at) = authority.rfind('@') {
                let userinfo = &authority[..at];
                secrets.push(userinfo.to_owned());
                if let Some((_, pass)) = userinfo.split_once(':')
                    && !pass.is_empty()
                {
                    secrets.push(pass.to_owned());
                }
            }
        }
        // Longest first, so a password inside the user:password pair goes with it.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.retain(|s| !s.is_empty());
        Redact(secrets)
    }

    pub(crate) fn text(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for s in &self.0 {
            out = out.replace(s.as_str(), "***");
        }
        out
    }
}

/// What the target is, for the output: `redis redis://host:6379`.
pub(crate) fn describe(target: &Target) -> String {
    match target {
        Target::Redis(u) => format!("redis {}", redact(u)),
        Target::RedisCluster(us) => format!(
            "redis-cluster {}",
            us.iter().map(|u| redact(u)).collect::<Vec<_>>().join(",")
        ),
        Target::Postgres(u) => format!("postgres {}", redact(u)),
    }
}

impl Backend {
    /// Connects with the store's defaults (its connect timeout bounds this).
    pub(crate) async fn connect(target: &Target, prefix: Option<&str>) -> Result<Self, String> {
        match target {
            #[cfg(feature = "redis")]
            Target::Redis(url) => {
                let b = idem_redis::RedisStore::builder(url.clone());
                Self::redis(b, prefix).await
            }
            #[cfg(feature = "redis")]
            Target::RedisCluster(nodes) => {
                let b = idem_redis::RedisStore::cluster_builder(nodes.iter().cloned());
                Self::redis(b, prefix).await
            }
            #[cfg(feature = "postgres")]
            Target::Postgres(url) => {
                let mut b = idem_postgres::PostgresStore::builder(url.clone())
                    .no_sweep()
                    .max_connections(2)
                    // An operator's read never creates tables or migrates them.
                    .manage_schema(false);
                if let Some(p) = prefix {
                    b = b.table_prefix(p);
                }
                b.connect()
                    .await
                    .map(Backend::Postgres)
                    .map_err(|e| e.to_string())
            }
            #[allow(unreachable_patterns)]
            _ => Err(
                "this idem was built without that store: build idem-cli with the `redis` \
                 and `postgres` features (the default)"
                    .into(),
            ),
        }
    }

    #[cfg(feature = "redis")]
    async fn redis(b: idem_redis::RedisStoreBuilder, prefix: Option<&str>) -> Result<Self, String> {
        let mut b = b.skip_server_check().max_in_flight_per_tenant(None);
        if let Some(p) = prefix {
            b = b.key_prefix(p);
        }
        b.connect()
            .await
            .map(Backend::Redis)
            .map_err(|e| e.to_string())
    }

    /// Where the record lives in the store, for the output.
    pub(crate) fn location(&self, scope: &Scope) -> String {
        match self {
            #[cfg(feature = "redis")]
            Backend::Redis(s) => format!("key {}", s.key_for(scope)),
            #[cfg(feature = "postgres")]
            Backend::Postgres(s) => format!(
                "row of {}records with scope = '\\x{}'",
                s.table_prefix(),
                scope.to_hex()
            ),
            #[cfg(not(any(feature = "redis", feature = "postgres")))]
            Backend::None(never) => match *never {},
        }
    }

    pub(crate) async fn read(&self, scope: &Scope) -> Result<Option<RecordInfo>, StoreError> {
        match self {
            #[cfg(feature = "redis")]
            Backend::Redis(s) => s.read_record(scope).await,
            #[cfg(feature = "postgres")]
            Backend::Postgres(s) => s.read_record(scope).await,
            #[cfg(not(any(feature = "redis", feature = "postgres")))]
            Backend::None(never) => match *never {},
        }
    }

    pub(crate) async fn delete(
        &self,
        scope: &Scope,
        mode: DeleteMode,
    ) -> Result<Deletion, StoreError> {
        match self {
            #[cfg(feature = "redis")]
            Backend::Redis(s) => s.delete_record(scope, mode).await,
            #[cfg(feature = "postgres")]
            Backend::Postgres(s) => s.delete_record(scope, mode).await,
            #[cfg(not(any(feature = "redis", feature = "postgres")))]
            Backend::None(never) => match *never {},
        }
    }

    pub(crate) async fn find(&self, prefix: &[u8]) -> Result<Vec<Scope>, StoreError> {
        let limit = PREFIX_MATCHES_SHOWN + 1;
        match self {
            #[cfg(feature = "redis")]
            Backend::Redis(s) => s.find_scopes(prefix, limit).await,
            #[cfg(feature = "postgres")]
            Backend::Postgres(s) => s.find_scopes(prefix, limit).await,
            #[cfg(not(any(feature = "redis", feature = "postgres")))]
            Backend::None(never) => match *never {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_reach_the_output() {
        assert_eq!(redact("redis://u:pw@h:1/0"), "redis://h:1/0");
        assert_eq!(redact("redis://:pw@h"), "redis://h");
        assert_eq!(redact("postgres://h/db?x=a@b"), "postgres://h/db?x=a@b");
        assert_eq!(redact("h:1"), "h:1");
        let t = Target::Postgres("postgres://me:s3cret@db/x".into());
        let r = Redact::of(&t);
        assert_eq!(
            r.text("failed for me:s3cret@db, password s3cret"),
            "failed for ***@db, password ***"
        );
        assert_eq!(describe(&t), "postgres postgres://db/x");
    }
}
